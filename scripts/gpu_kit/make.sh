#!/usr/bin/env bash
# Makes .gpukit/site.tgz here (a CPU machine with PyPI): SGLang 0.5.23 and what the GPU
# image (Python 3.12, torch 2.11 + CUDA 13, Triton, no package index) lacks for colocate's
# engine path, unpacked for cp312 and trimmed to fit the 64 MiB a device call carries.
# scripts/gpu_engine_check.sh unpacks it on the GPU machine and puts overlay/ (beside this
# file) on the import path: a torch stand-in for the sgl_kernel names SGLang imports on
# CUDA, import-only stubs for tvm_ffi, IPython and xgrammar (SGLang's detokenizer imports its
# tool-call parsers, some of which import xgrammar: found on an H100), and the cutlass
# dual-GEMM module. image_sim/ simulates the image's missing packages for a CPU dry run.
#
#   bash scripts/gpu_kit/make.sh      # then: run the check with carry [".gpukit"]
#
# Trimmed (not on the in-process engine's path): sglang's multimodal_gen/, test/,
# benchmark/, and the Rust HTTP/gRPC/multimodal server extensions (srt/rust_extensions/_*.so);
# the Rust radix tree (built against torch 2.14.1's ABI) stays but is switched off by
# SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python. transformers 5.19 (SGLang's and colocate's
# pin; the image has 5.17), peft 0.21.2 and the pure-Python servers SGLang imports come along,
# and trl 1.12.0, datasets 5.2.0 and multiprocess for the GPU bench's TRL peers (scripts/gpu_bench.sh;
# the image has accelerate, pyarrow, pandas, xxhash, fsspec).
set -euo pipefail
cd "$(dirname "$0")/../.."
K=.gpukit
mkdir -p "$K/whl"
grep -qx '/.gpukit/' .git/info/exclude 2>/dev/null || echo '/.gpukit/' >> .git/info/exclude
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$K/whl"
   --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
   --platform manylinux_2_26_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${P[@]}" sglang==0.5.23 torch_memory_saver==0.0.10 \
  msgspec==0.22.0 pyzmq==27.3.0 orjson pybase64 setproctitle partial-json-parser dill gguf \
  pydantic pydantic-core annotated-types typing-inspection fastapi starlette uvicorn opentelemetry-api \
  openai==2.8.0 jiter distro sniffio compressed-tensors==0.18.0 loguru typing-extensions \
  transformers==5.19.0 peft==0.21.2 nltk-vader-sentiment==1.0.0 \
  trl==1.12.0 datasets==5.2.0 multiprocess==0.70.19
rm -rf "$K/site"
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  --target "$K/site" "$K"/whl/*.whl
S="$K/site/sglang"
rm -rf "$S/multimodal_gen" "$S/test" "$S/benchmark" "$K/site/bin"
rm -f "$S"/srt/rust_extensions/_*.so
find "$K/site" -name __pycache__ -prune -exec rm -rf {} +
tar czf "$K/site.tgz" -C "$K/site" .
rm -rf "$K/site"
du -h "$K/site.tgz"
