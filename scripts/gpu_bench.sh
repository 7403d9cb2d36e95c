#!/usr/bin/env bash
# The GPU bench in one call of a lent CUDA machine (issue 53, item 3): `colocate bench --gpu`,
# a Qwen2.5-0.5B-shaped random actor and a random reward model of the same shape, batch 64,
# lognormal budgets up to 1,024 new tokens (ignore_eos), GRPO (groups of 4) then PPO, every
# mode in the order sequential, oppo, auto, inter, intra, and TRL's GRPOTrainer / PPO
# (bf16, HF generate, no vLLM) as peers, with CUDA graphs on (engines.cuda_graph's default)
# and the attention backend colocate's own rule picks (engine_config.default_attention_backend:
# triton on the kit). The bench's budget (--budget-s) leaves modes, peers and then the PPO
# workload out, in that order of worth, rather than come back with nothing.
# What comes back ($OUT, refreshed every 15 s so a cut-off run still reports; a device call
# returns at most 8 files): log.txt, report.md and results.json (rewritten after each
# workload), gpu_steps.tsv (every measured step's gpu/* memory, gpu/released_frac among them,
# one row a step) and bench.tgz: the per-step journals (<workload>_steps.jsonl, each record
# the moment it is measured), the request logs, the TRL peers' results and the plots.
#
# On the GPU machine (Python 3.12, torch 2.11 + CUDA 13, Triton, no index) the kit travels as
# .gpukit/site.tgz, made here by `bash scripts/gpu_kit/make.sh` (SGLang, and trl/datasets
# for the TRL peers); the device call carries [".gpukit/site.tgz"] and runs
# `bash scripts/gpu_bench.sh` with timeout_s ~40 s above GPU_BENCH_S (default 480 s all told;
# 2026-11-28 on an H100: GPU_BENCH_S=560, timeout_s 595, the machine's start ~40 s).
#   DEVICE=cpu OUT=/tmp/gb bash scripts/gpu_bench.sh     # dry run here: tiny shapes, batch 8 x 16 tokens
# Knobs: GPU_BENCH_S (the whole budget, default 480 s), MODES, WORKLOADS, STEPS, REPEATS,
# BATCH, TOKENS, SHAPE (a MODEL_SHAPES name), PEER=0 (no TRL peers), ENGINE_SETS (extra
# --set overrides of every run, space-separated). CUDA graphs are colocate's own rule
# (engine_config.releasable_graphs): decode graphs captured into the memory a release gives
# back, no prefill graphs. Should an engine not start that way (the bench ends within
# RETRY_WITHIN s having measured nothing), the bench runs once more in the time left with
# SGLANG_MEMORY_SAVER_CUDA_GRAPH=0 (graphs kept out of the release), and the log says so.
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
  ENGINE_SETS=${ENGINE_SETS-engines.sglang.sampling_backend=pytorch engines.sglang.bf16_gemm_backend=torch}
  source scripts/gpu_kit/setup.sh  # the kit onto the import path, colocate installed, the kit's switches
else
  SHAPE=${SHAPE:-tiny}; BATCH=${BATCH:-8}; TOKENS=${TOKENS:-16}; ENGINE_SETS=${ENGINE_SETS-}
fi
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import trl, datasets; print('trl', trl.__version__, 'datasets', datasets.__version__)" || echo "TRL peers unavailable here"
ATTN=$(python3 -c "from colocate.engine.engine_config import compiled_cuda_kernels, default_attention_backend
print(default_attention_backend('$DEVICE', compiled_cuda_kernels()) or 'sglang-pick')")

B="$W/bench"
pack() {  # at most 8 files come back from a device call: the report's three, the rest in one tarball
  [ -d "$B" ] || return 0
  for f in "$B"/report.md "$B"/results.json "$W"/report.txt; do [ -f "$f" ] && cp "$f" "$OUT/"; done
  for d in "$B"/trl-*; do
    [ -f "$d/trl_result.json" ] && cp "$d/trl_result.json" "$B/$(basename "$d").json"
  done
  (cd "$B" && tar czf "$OUT/bench.tgz.part" --exclude='trl-*/*' *_steps.jsonl *_requests.jsonl *.png trl-*.json 2>/dev/null; \
   mv "$OUT/bench.tgz.part" "$OUT/bench.tgz")
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

MODES=${MODES:-sequential,oppo,auto,inter,intra}
SETS=(--set engines.log_level=warning)
for s in $ENGINE_SETS; do SETS+=(--set "$s"); done
[ "$ATTN" = sglang-pick ] || SETS+=(--set engines.attention_backend="$ATTN")
(while sleep 15; do pack; done) & PACKER=$!
bench() {  # the CLI through python3 (pip's console script may land off PATH on the image)
  echo "== bench: $SHAPE, batch $BATCH x $TOKENS tokens, modes $MODES, attention $ATTN (colocate's rule), graph memory ${SGLANG_MEMORY_SAVER_CUDA_GRAPH:-released}, $(left) s left"
  timeout $(( $(left) > 20 ? $(left) - 5 : 15 )) python3 -c "from colocate.cli import main; main(prog_name='colocate')" bench --gpu --shape "$SHAPE" --batch "$BATCH" \
    --max-new-tokens "$TOKENS" --modes "$MODES" --budget-s $(( $(left) > 60 ? $(left) - 30 : 30 )) --out "$B" \
    ${WORKLOADS:+--workloads "$WORKLOADS"} ${STEPS:+--steps "$STEPS"} ${REPEATS:+--repeats "$REPEATS"} \
    $([ "${PEER:-1}" = 0 ] && echo --no-peer) "${SETS[@]}" > "$W/report.txt"
}
bench; RC=$?
if [ $RC != 0 ] && [ "$DEVICE" = cuda ] && [ -z "${SGLANG_MEMORY_SAVER_CUDA_GRAPH:-}" ] \
    && [ $(( $(date +%s) - T0 )) -lt ${RETRY_WITHIN:-200} ] && ! ls "$B"/*_steps.jsonl >/dev/null 2>&1; then
  echo "== bench rc $RC before any step: once more with SGLANG_MEMORY_SAVER_CUDA_GRAPH=0 (graphs not released)"
  export SGLANG_MEMORY_SAVER_CUDA_GRAPH=0
  rm -rf "$B"; bench; RC=$?
fi
echo "bench rc $RC"
kill $PACKER 2>/dev/null
pack
echo "done, $(left) s left; $OUT: $(ls "$OUT" | tr '\n' ' ')"
