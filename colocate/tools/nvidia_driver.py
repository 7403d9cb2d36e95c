"""The NVIDIA driver check: CUDA 13, which the torch and SGLang builds colocate installs
on a GPU machine use, needs driver 580 or newer. On an older one torch sees no GPU and
SGLang falls back to its CPU path with the CUDA ``sgl_kernel``, which fails far from the
cause.

Owns: reading ``nvidia-smi --query-gpu=driver_version --format=csv,noheader`` output into
one line (:func:`driver_note`) and asking nvidia-smi (:func:`query`). Standard library
only: ``scripts/install.sh`` runs this file by its path before colocate is installed
(``python colocate/tools/nvidia_driver.py``: one line, exit status 1 on a driver too old);
``colocate doctor`` imports it. Leaves out: anything about the GPU beyond the driver.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

MIN_DRIVER = 580  # CUDA 13's minimum (Linux)


def driver_note(smi_output: str | None) -> tuple[bool, str]:
    """(whether the driver can run colocate's CUDA stack, one line saying so) from
    nvidia-smi's output (one version per GPU); None or empty: no NVIDIA driver (a CPU
    machine: fine)."""
    lines = [line.strip() for line in (smi_output or "").splitlines() if line.strip()]
    if not lines:
        return True, "none (no nvidia-smi): CPU only"
    version = lines[0]
    match = re.fullmatch(r"(\d+)(\.\d+)*", version)
    if match is None:
        return False, (f"nvidia-smi answered '{version[:120]}' instead of a driver version; "
                       "is the NVIDIA driver loaded?")
    if int(match.group(1)) < MIN_DRIVER:
        return False, (f"{version} is older than {MIN_DRIVER}, which CUDA 13 (colocate's torch and SGLang "
                       "builds) needs, so torch would see no GPU; update the NVIDIA driver, or install "
                       "for CPU (COLOCATE_DEVICE=cpu)")
    return True, f"{version} (CUDA 13 needs >= {MIN_DRIVER}: ok)"


def query() -> str | None:
    """nvidia-smi's driver versions (its error text when it fails); None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    return done.stdout if done.returncode == 0 else (done.stdout + done.stderr).strip() or f"exit {done.returncode}"


def main() -> int:
    ok, line = driver_note(query())
    print(f"[install] NVIDIA driver: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
