#!/usr/bin/env bash
# The GPU check of the engine path, in one call of a lent CUDA machine (issue 35): SGLang's
# CUDA engine through the carried kit, then colocate train's loop in every mode.
#   1. scripts/gpu_probe.py: SGLang alone (torch_native and triton attention): start,
#      generate, release + re-fill the freed memory + resume, weight pushes by CUDA-IPC
#      (tensor list, flattened bucket), greedy tokens against HF on pushed weights;
#   2. python -m colocate.bench.loop_check: SmolLM2-shaped random actor + small random
#      reward model, 3 steps each of sequential, oppo, inter, GRPO, LoRA, multi-turn and
#      inter with retract pauses (one process, engines kept across parts), with the attention
#      backend colocate's own rule gives (engine_config.default_attention_backend: triton on
#      the kit) and CUDA graphs as colocate runs them (on, released with the engines;
#      GRAPHS=0: off); per step: phase seconds, gpu/* memory at each sleep and wake, sync.
# What comes back ($OUT, refreshed every 15 s so a cut-off run still reports): log.txt,
# probe.json, summary.json, runs.tgz (each part's metrics.jsonl and config.json).
#
# On the GPU machine (the image: Python 3.12, torch 2.11 + CUDA 13, Triton, no index) the
# kit travels as .gpukit/site.tgz, made here by `bash scripts/gpu_kit/make.sh`; the device
# call carries [".gpukit/site.tgz"] and runs `bash scripts/gpu_engine_check.sh`.
#   DEVICE=cpu OUT=/tmp/gec bash scripts/gpu_engine_check.sh          # dry run here, tiny shapes
#   DEVICE=cpu GPU_CHECK_S=0 bash scripts/gpu_engine_check.sh         # wiring only (the test)
#   PYTHONPATH=scripts/gpu_kit/image_sim:engine/cpu_kernel:scripts/gpu_kit/overlay DEVICE=cpu \
#     bash scripts/gpu_engine_check.sh   # dry run with the GPU image's missing packages hidden
# Knobs: GPU_CHECK_S (budget, default 420 s), PROBE_S (the probe's share, default 200 s),
# PARTS (comma list), STEPS, PART_STEPS (e.g. lora=2,grpo=2), BACKENDS (the probe's attention
# backends, in order), ATTN (the loop's attention backend; given, the probe is skipped),
# GRAPHS (1: CUDA graphs, colocate's default; 0: engines.cuda_graph=false, as before 2026-11-28).
set -u
OUT=${OUT:-runs/gpu-engine-check}
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_CHECK_S:-420}
T0=$(date +%s)
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpu-engine-check.XXXX)
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

if [ "$DEVICE" = cuda ]; then
  SHAPE=smollm2-135m; STEPS=${STEPS:-3}; BACKENDS=${BACKENDS:-torch_native,triton}
  source scripts/gpu_kit/setup.sh  # the kit onto the import path, colocate installed, the kit's switches
else
  SHAPE=tiny; STEPS=${STEPS:-1}; BACKENDS=${BACKENDS:-torch_native}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

pack() {
  [ -f "$W/loop/summary.json" ] && cp "$W/loop/summary.json" "$OUT/summary.json"
  [ -d "$W/loop" ] && tar czf "$OUT/runs.tgz" -C "$W/loop" --exclude=checkpoints . 2>/dev/null
  return 0
}

if [ -n "${ATTN:-}" ]; then
  echo "== probe skipped: ATTN=$ATTN given"
else
echo "== probe ($(left) s left)"
[ "$(left)" -gt 0 ] || BACKENDS=""
PROBE_S=${PROBE_S:-200}
timeout $(( $(left) > PROBE_S ? PROBE_S : ($(left) > 30 ? $(left) : 30) )) \
  python3 scripts/gpu_probe.py --device "$DEVICE" --shape "$SHAPE" --backends "$BACKENDS" --out "$OUT" \
  --work "$W/probe-models"
echo "probe rc $?"
fi
# the loop's attention backend: colocate's own rule, as a run on this machine gets it
# (engine_config.default_attention_backend: triton on the kit, SGLang's pick with its compiled
# kernels, torch_native on CPU); the probe above reports both backends, it does not choose
ATTN=${ATTN:-$(python3 -c "from colocate.engine.engine_config import compiled_cuda_kernels, default_attention_backend
print(default_attention_backend('$DEVICE', compiled_cuda_kernels()) or 'sglang-pick')")}
echo "== loop check, attention $ATTN ($(left) s left)"
ENG=(--set engines.log_level=warning)
[ "$ATTN" = sglang-pick ] || ENG+=(--set engines.attention_backend="$ATTN")
[ "$DEVICE" = cuda ] && ENG+=(--set engines.sglang.sampling_backend=pytorch --set engines.sglang.bf16_gemm_backend=torch)
[ "$DEVICE" = cuda ] && [ "${GRAPHS:-1}" = 0 ] && ENG+=(--set engines.cuda_graph=false)
(while sleep 15; do pack; done) & PACKER=$!
# at least 60 s: on a spent budget the loop check still imports SGLang and builds its models
# before it skips every part (9 s on a quiet CPU; a 10 s floor cut it off in CI, rc 124)
timeout $(( $(left) > 60 ? $(left) : 60 )) python3 -m colocate.bench.loop_check --device "$DEVICE" --shape "$SHAPE" \
  --steps "$STEPS" --out "$W/loop" --work "$W/models" --deadline-s $(( $(left) - 20 )) \
  ${PARTS:+--parts "$PARTS"} ${PART_STEPS:+--part-steps "$PART_STEPS"} "${ENG[@]}"
echo "loop check rc $?"
kill $PACKER 2>/dev/null
pack
echo "done, $(left) s left; $OUT: $(ls "$OUT" | tr '\n' ' ')"
