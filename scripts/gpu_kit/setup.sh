# Sourced by the GPU scripts on a lent CUDA machine (scripts/gpu_engine_check.sh,
# scripts/gpu_bench.sh): unpack the carried kit (.gpukit/site.tgz, made by
# scripts/gpu_kit/make.sh) onto the import path, install colocate into the image's Python
# without an index, and set the kit's switches. Needs $W (a scratch folder); exits on failure.
mkdir -p /tmp/site && tar xzf .gpukit/site.tgz -C /tmp/site || { echo "no .gpukit/site.tgz: run scripts/gpu_kit/make.sh and carry it"; exit 1; }
cp scripts/gpu_kit/overlay/cutedsl_dual_gemm.py /tmp/site/sglang/kernels/ops/gemm/
export PYTHONPATH=/tmp/site:$PWD/scripts/gpu_kit/overlay
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$W/install.log" 2>&1 || { cat "$W/install.log"; exit 1; }
# the kit's switches: SGLang's torch paths for fused ops, no sgl_kernel version check, the
# Python radix tree, no JIT kernels, no flashinfer; torch_memory_saver's preload library
# needs CUDA 13's runtime on the loader's path (without it release frees nothing)
export SGLANG_FORCE_FUSED_OP_BACKEND=torch SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
  SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python SGLANG_CRASH_ON_JIT_COMPILE=1 SGLANG_IS_FLASHINFER_AVAILABLE=false
CUDART=$(python3 -c "import glob, nvidia; print(sorted(f for p in nvidia.__path__ for f in glob.glob(p + '/**/libcudart.so.13', recursive=True))[0])")
export LD_LIBRARY_PATH=$(dirname "$CUDART")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
