#!/usr/bin/env bash
# The trainer's shared-prefix and attention paths on a lent CUDA machine (issue 36), in one
# device call: no SGLang, only the trainer (the kit's transformers/peft, the image's torch).
#   1. tests/integration/test_shared_prefix.py -k cuda: shared-prefix rows equal separate and
#      padded rows on CUDA (float32: log-probs, entropy, values, every gradient) under the
#      varlen-sdpa and the flex-attention paths;
#   2. python -m colocate.bench.train_phases on the Qwen2.5-0.5B shape, GRPO n = 4 at
#      reasoning-like lengths (lognormal responses), bf16: ppo.attention sdpa / flex_attention
#      x ppo.shared_prefix false / true (RUNS: attention:shared pairs, in order), the same batches in each run.
# Results go to $OUT (log.txt, results.tgz with each run's train_phases.json/md), refreshed
# after each part; a deadline (GPU_CHECK_S, default 420 s) skips what would not finish.
# Knobs: RUNS, TOKENS (ppo.micro_batch_tokens of every run; default: each attention's own),
# STEPS (measured steps per run, default 2), PYTEST_S (the CUDA tests' share, default 150 s).
#   DEVICE=cpu OUT=/tmp/gpc bash scripts/gpu_prefix_check.sh   # dry run here (tiny shape, sdpa only)
# On the GPU machine: carry [".gpukit/site.tgz"] (bash scripts/gpu_kit/make.sh).
set -u
OUT=${OUT:-runs/gpu-prefix-check}
DEVICE=${DEVICE:-cuda}
BUDGET=${GPU_CHECK_S:-420}
T0=$(date +%s)
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
mkdir -p "$OUT"
W=$(mktemp -d /tmp/gpu-prefix-check.XXXX)
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
pack() { tar czf "$OUT/results.tgz" -C "$W" --exclude='model-*' . 2>/dev/null; return 0; }

if [ "$DEVICE" = cuda ]; then
  mkdir -p /tmp/site && tar xzf .gpukit/site.tgz -C /tmp/site || { echo "no .gpukit/site.tgz: run scripts/gpu_kit/make.sh and carry it"; exit 1; }
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$W/install.log" 2>&1 || { cat "$W/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  SHAPE=qwen2.5-0.5b; RUNS=${RUNS:-"sdpa:false sdpa:true flex_attention:true flex_attention:false"}
  SIZE=(--batch 64 --prompt-tokens 256 --response-tokens 1024 --lengths lognormal --steps "${STEPS:-2}" --warmup 1)
else
  SHAPE=tiny; RUNS=${RUNS:-"sdpa:false sdpa:true"}
  SIZE=(--batch 8 --prompt-tokens 16 --response-tokens 32 --lengths lognormal --steps 1 --warmup 1)
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 - "$DEVICE" <<'EOF'
import sys
from colocate.trainer.sections import PPOConfig
from colocate.trainer.settings import TrainerSettings, flash_attn_2_available
for dtype in ("bfloat16", "float32"):  # what ppo.attention=auto resolves to here
    s = TrainerSettings(actor_path="/m", device=sys.argv[1], dtype=dtype, ppo=PPOConfig(packing=True))
    print(f"auto, {dtype}: {s.attn_implementation}, {s.token_budget} tokens, shared prefix {s.shares_prefix}",
          f"(flash-attention 2 installed: {flash_attn_2_available()})")
EOF

echo "== CUDA tests ($(left) s left)"
if [ "$DEVICE" = cuda ]; then
  timeout "${PYTEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short tests/integration/test_shared_prefix.py \
    -k cuda >"$W/pytest_cuda.log" 2>&1
  grep -E "^E |Error|passed|failed" "$W/pytest_cuda.log" | head -30
  pack
fi

MODEL=$W/model-$SHAPE  # built once: every run loads the same random weights
python3 -c "from colocate.assets.models import build_shaped_causal_lm as b; b('$MODEL', '$SHAPE')" >/dev/null 2>&1 \
  || { echo "could not build $SHAPE"; exit 1; }
GRPO=(--set ppo.advantage=grpo --set rollout.group_size=4 --set ppo.kl_in=loss)
for run in $RUNS; do  # attention:shared_prefix, in order of worth
  attn=${run%:*}; shared=${run#*:}; name=${attn}_shared_$shared
  if [ "$(left)" -lt 45 ]; then echo "skipped $name: $(left) s left" | tee -a "$W/skipped.txt"; continue; fi
  echo "== $name ($(left) s left)"
  timeout "$(left)" python3 -m colocate.bench.train_phases --device "$DEVICE" --model "$MODEL" "${SIZE[@]}" \
    "${GRPO[@]}" --set ppo.attention="$attn" --set ppo.shared_prefix="$shared" ${TOKENS:+--set ppo.micro_batch_tokens=$TOKENS} \
    --out "$W/$name" >"$W/$name.log" 2>&1
  echo "rc $? $name" | tee -a "$W/rc.txt"
  grep -E "^step|^\| (ref|old_logp|actor|total) |^attention|peak allocated|Error" "$W/$name.log" | grep -v "warm-up" | head -20
  pack
done
pack
echo "done, $(left) s left"
