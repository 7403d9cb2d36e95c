"""``models.dtype=auto``'s choice from the CPU's flags (trainer/precision.py)."""

from __future__ import annotations

from colocate.trainer.precision import auto_dtype, cpu_flags

EPYC = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme sse2 avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu
"""
OLD = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"
SAPPHIRE = "processor\t: 0\nflags\t\t: avx512f amx_bf16 amx_tile amx_int8\n"


def test_flags_are_the_first_processors():
    assert cpu_flags(EPYC) == {"fpu", "vme", "sse2", "avx2", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert cpu_flags("") == frozenset() and cpu_flags("processor : 0\n") == frozenset()


def test_bf16_where_the_cpu_multiplies_it_natively_float32_elsewhere():
    assert auto_dtype("cpu", cpu_flags(EPYC)) == ("bfloat16", "this CPU multiplies bfloat16 natively: avx512_bf16")
    assert auto_dtype("cpu", cpu_flags(SAPPHIRE))[0] == "bfloat16" and "amx_bf16" in auto_dtype("cpu", cpu_flags(SAPPHIRE))[1]
    dtype, why = auto_dtype("cpu", cpu_flags(OLD))
    assert dtype == "float32" and why == "this CPU has no native bfloat16 multiply: none of amx_bf16, avx512_bf16"
    assert auto_dtype("cuda", cpu_flags(OLD)) == ("bfloat16", "CUDA multiplies bfloat16 natively")


def test_this_machine_reads_its_own_flags():
    flags = cpu_flags()
    on_linux = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    assert flags == cpu_flags(on_linux)
    assert auto_dtype("cpu", flags)[0] == ("bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32")
