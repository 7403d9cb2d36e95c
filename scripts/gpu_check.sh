#!/usr/bin/env bash
# The GPU check, in one call of a lent CUDA machine (no SGLang there: CUDA SGLang cannot be
# installed on it, so the engines are not part of it). What it runs, in order of worth:
#   1. the trainer's CUDA-only tests (FSDP2 on CUDA: offload/onload round trip, the device
#      weight gather before the offload);
#   2. the trainer's phases on CUDA (python -m colocate.bench.train_phases): SmolLM2's shape
#      full fine-tuning vs LoRA r16, then the Qwen2.5-1.5B shape full vs LoRA vs LoRA +
#      activation checkpointing vs full + checkpointing, at reasoning-like lengths.
# Results are measured into a work folder and packed into $OUT/results.tgz after each one
# (what comes back from the machine is a few files); a deadline (GPU_CHECK_S, default 480 s)
# skips what would not finish. Wheels the GPU image lacks travel in .whl (git-ignored via
# .git/info/exclude; the image has torch 2.11, Python 3.12), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#     msgspec==0.22.0 pyzmq==27.3.0 transformers==5.19.0 peft==0.21.2 nltk-vader-sentiment==1.0.0
#
#   DEVICE=cpu OUT=/tmp/gc SMALL=1 bash scripts/gpu_check.sh   # a dry run here, tiny shapes
#   ONLY="smollm2_lora big_lora" SKIP_TESTS=1 bash scripts/gpu_check.sh   # some of the runs
set -u
OUT=${OUT:-runs/gpu-check}
DEVICE=${DEVICE:-cuda}
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_S:-480} ))
W=$(mktemp -d /tmp/gpu-check-work.XXXX)
mkdir -p "$OUT"
pack() { tar czf "$OUT/results.tgz" -C "$W" . ; }
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if [ -d .whl ] && [ "$DEVICE" = cuda ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$W/install.log" 2>&1 || { cat "$W/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$W/gpu.txt"
fi
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"

left() { echo $(( DEADLINE - $(date +%s) )); }

if [ "$DEVICE" = cuda ]; then
  [ -n "${SKIP_TESTS:-}" ] || timeout 150 python3 -m pytest -q -p no:cacheprovider tests/integration/test_trainer.py -k cuda 2>&1 | tail -15 | tee "$W/pytest_cuda.log"; pack
fi

phases() {  # name, then train_phases arguments
  local name=$1; shift
  local need=${NEED:-60}
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  if [ "$(left)" -lt "$need" ]; then echo "skipped $name: $(left) s left" | tee -a "$W/skipped.txt"; return; fi
  echo "== $name ($(left) s left)"
  timeout "$(left)" python3 -m colocate.bench.train_phases --device "$DEVICE" --out "$W/$name" "$@" \
    >"$W/$name.log" 2>&1
  echo "rc $? $name" | tee -a "$W/rc.txt"
  grep -E "^step|^\| (critic|actor|ref|old_logp|values|sync_gather|total) |training state|peak allocated|Error" "$W/$name.log" | grep -v "warm-up"
  pack
}

if [ "${SMALL:-0}" = 1 ]; then
  small=(--shape tiny --batch 4 --prompt-tokens 8 --response-tokens 16 --steps 1 --warmup 1)
  big_shape=tiny; big=(--batch 4 --prompt-tokens 8 --response-tokens 32 --steps 1 --warmup 1)
else
  small=(--shape smollm2-135m --batch 16 --prompt-tokens 64 --response-tokens 256 --steps 3 --warmup 1)
  big_shape=qwen2.5-1.5b; big=(--batch 16 --prompt-tokens 128 --response-tokens 1024 --steps 2 --warmup 1)
fi
phases smollm2_full "${small[@]}"
phases smollm2_lora "${small[@]}" --set lora.rank=16
phases smollm2_lora_gc "${small[@]}" --set lora.rank=16 --set ppo.gradient_checkpointing=true
phases smollm2_full_gc "${small[@]}" --set ppo.gradient_checkpointing=true
if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" big_"* ]]; then pack; echo "done, $(left) s left"; exit 0; fi
BIG=/tmp/gpu-check-$big_shape
python3 -c "from colocate.assets.models import build_shaped_causal_lm as b; b('$BIG', '$big_shape')" >/dev/null 2>&1 \
  || { echo "could not build $big_shape"; exit 1; }
NEED=90 phases big_full --model "$BIG" "${big[@]}"
NEED=90 phases big_lora --model "$BIG" "${big[@]}" --set lora.rank=16
NEED=90 phases big_lora_gc --model "$BIG" "${big[@]}" --set lora.rank=16 --set ppo.gradient_checkpointing=true
NEED=90 phases big_full_gc --model "$BIG" "${big[@]}" --set ppo.gradient_checkpointing=true
pack
echo "done, $(left) s left"
