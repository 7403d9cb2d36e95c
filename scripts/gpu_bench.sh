#!/usr/bin/env bash
# The GPU bench in one call of a lent CUDA machine (issue 53, item 3): `colocate bench --gpu`,
# a Qwen2.5-0.5B-shaped random actor and a random reward model of the same shape, batch 64,
# lognormal budgets up to 1,024 new tokens (ignore_eos), GRPO (groups of 4) then PPO, every
# mode in the order sequential, oppo, intra, inter, auto, and TRL's GRPOTrainer / PPO
# (bf16, HF generate, no vLLM) as peers, with CUDA graphs on (engines.cuda_graph's default)
# and the attention backend colocate's own rule picks (engine_config.default_attention_backend:
# triton on the kit). The bench's budget (--budget-s) leaves modes, peers and then the PPO
# workload out, in that order of worth, rather than come back with nothing.
# What comes back ($OUT, refreshed every 15 s so a cut-off run still reports): log.txt,
# report.md and results.json (rewritten after each workload), the per-step journals
# (<workload>_steps.jsonl: every measured step's record with its gpu/* memory, gpu/released_frac
# among them, the moment it is measured), gpu_steps.tsv (those gpu/* columns per step), the
# TRL peers' results and the plots.
#
# On the GPU machine (Python 3.12, torch 2.11 + CUDA 13, Triton, no index) the kit travels as
# .gpukit/site.tgz, made here by `bash scripts/gpu_kit/make.sh` (SGLang, and trl/datasets
# for the TRL peers); the device call carries [".gpukit/site.tgz"] and runs
# `bash scripts/gpu_bench.sh` with timeout_s ~520 (the default budget is 480 s all told).
#   DEVICE=cpu OUT=/tmp/gb bash scripts/gpu_bench.sh     # dry run here: tiny shapes, batch 8 x 16 tokens
# Knobs: GPU_BENCH_S (the whole budget, default 480 s), MODES, WORKLOADS, STEPS, REPEATS,
# BATCH, TOKENS, SHAPE (a MODEL_SHAPES name), PEER=0 (no TRL peers), ENGINE_SETS (extra
# --set overrides of every run, space-separated; on CUDA by default the prefill CUDA graph is
# off: SGLang's breakable prefill capture calls sgl_kernel.weak_ref_tensor, which the kit's
# stand-in has not; decode graphs stay on).
set -u
OUT=${OUT:-runs/gpu-bench}
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_BENCH_S:-480}
T0=$(date +%s)
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpu-bench.XXXX)
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

if [ "$DEVICE" = cuda ]; then
  SHAPE=${SHAPE:-qwen2.5-0.5b}; BATCH=${BATCH:-64}; TOKENS=${TOKENS:-1024}
  ENGINE_SETS=${ENGINE_SETS-engines.sglang.disable_prefill_cuda_graph=true engines.sglang.sampling_backend=pytorch engines.sglang.bf16_gemm_backend=torch}
  source scripts/gpu_kit/setup.sh  # the kit onto the import path, colocate installed, the kit's switches
else
  SHAPE=${SHAPE:-tiny}; BATCH=${BATCH:-8}; TOKENS=${TOKENS:-16}; ENGINE_SETS=${ENGINE_SETS-}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || echo "TRL peers unavailable here"
ATTN=$(python3 -c "from colocate.engine.engine_config import compiled_cuda_kernels, default_attention_backend
print(default_attention_backend('$DEVICE', compiled_cuda_kernels()) or 'sglang-pick')")

B="$W/bench"
pack() {
  [ -d "$B" ] || return 0
  for f in "$B"/report.md "$B"/results.json "$B"/*_steps.jsonl "$B"/*_requests.jsonl "$B"/*.png; do
    [ -f "$f" ] && cp "$f" "$OUT/"
  done
  for d in "$B"/trl-*; do
    [ -f "$d/trl_result.json" ] && cp "$d/trl_result.json" "$OUT/$(basename "$d").json"
  done
  # the gpu/* readings of every measured step, one row each (mode, step s, released fraction, ...)
  python3 - "$OUT" "$B" <<'EOF' 2>/dev/null
import glob, json, os, sys
out, bench = sys.argv[1:3]
rows = []
for path in sorted(glob.glob(os.path.join(bench, "*_steps.jsonl"))):
    workload = os.path.basename(path)[: -len("_steps.jsonl")]
    for line in open(path):
        r = json.loads(line)
        gpu = {k: v for k, v in r.items() if k.startswith("gpu/")}
        rows.append([workload, r.get("mode"), r.get("step"), round(r.get("step_s", float("nan")), 3),
                     *(f"{k}={round(v, 4) if isinstance(v, float) else v}" for k, v in sorted(gpu.items()))])
with open(os.path.join(out, "gpu_steps.tsv"), "w") as f:
    f.writelines("\t".join(map(str, row)) + "\n" for row in rows)
EOF
  return 0
}

MODES=${MODES:-sequential,oppo,intra,inter,auto}
SETS=(--set engines.log_level=warning)
for s in $ENGINE_SETS; do SETS+=(--set "$s"); done
[ "$ATTN" = sglang-pick ] || SETS+=(--set engines.attention_backend="$ATTN")
echo "== bench: $SHAPE, batch $BATCH x $TOKENS tokens, modes $MODES, attention $ATTN (colocate's rule), $(left) s left"
(while sleep 15; do pack; done) & PACKER=$!
# the CLI through python3 (pip's console script may land off PATH on the image)
timeout $(( $(left) > 20 ? $(left) - 5 : 15 )) python3 -c "from colocate.cli import main; main(prog_name='colocate')" bench --gpu --shape "$SHAPE" --batch "$BATCH" \
  --max-new-tokens "$TOKENS" --modes "$MODES" --budget-s $(( $(left) > 60 ? $(left) - 30 : 30 )) --out "$B" \
  ${WORKLOADS:+--workloads "$WORKLOADS"} ${STEPS:+--steps "$STEPS"} ${REPEATS:+--repeats "$REPEATS"} \
  $([ "${PEER:-1}" = 0 ] && echo --no-peer) "${SETS[@]}" > "$W/report.txt"
echo "bench rc $?"
kill $PACKER 2>/dev/null
pack
echo "done, $(left) s left; $OUT: $(ls "$OUT" | tr '\n' ' ')"
