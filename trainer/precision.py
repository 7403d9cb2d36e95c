"""The precision ``models.dtype=auto`` trains in: the one the hardware multiplies at its full rate.

Owns: the CPU's native bfloat16 support read from its flags (Linux ``/proc/cpuinfo``:
AVX512-BF16 or AMX-BF16) and the choice with its reason in words: bfloat16 (mixed
precision over float32 master weights) on CUDA and on such CPUs, float32 elsewhere.
Measured on a 2-core AMD EPYC with AVX512-BF16: a bf16 GEMM at ~2.2x float32's rate, the
default task's step 0.81x float32's (docs/bench.md, time to reward); a CPU without these
flags emulates bf16 and is slower than in float32.

Leaves out: mixed precision itself (FSDP2's policy, ``trainer.distributed``), the engines'
dtype (colocate's builder follows the trainer's on CPU), an explicit ``models.dtype``.
"""

from __future__ import annotations

from pathlib import Path

BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo names of native bf16 multiplies
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The flags of the first processor listed in ``cpuinfo`` (default: this machine's
    ``/proc/cpuinfo``; empty where there is none, e.g. not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text(errors="replace")
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def auto_dtype(device_type: str, flags: frozenset[str]) -> tuple[str, str]:
    """(dtype, why) of ``models.dtype=auto`` for a trainer on ``device_type`` ("cuda" or
    "cpu") of a machine whose CPU has ``flags``."""
    if device_type == "cuda":
        return "bfloat16", "CUDA multiplies bfloat16 natively"
    native = [f for f in BF16_FLAGS if f in flags]
    if native:
        return "bfloat16", f"this CPU multiplies bfloat16 natively: {', '.join(native)}"
    return "float32", f"this CPU has no native bfloat16 multiply: none of {', '.join(BF16_FLAGS)}"


__all__ = ["BF16_FLAGS", "auto_dtype", "cpu_flags"]
