"""SGLang's own LoRA serving on an actor engine: adapters loaded by name beside the base weights.

Owns: starting an actor engine with LoRA enabled (:func:`start`: the max rank, the target
modules, the LoRA kernel backend: torch_native on CPU), loading or replacing a named adapter
from PEFT-named tensors and its PEFT config (:meth:`LoraEngine.load`: the old copy unloaded
first, every call guarded against a dead scheduler), and greedy generation with or without
an adapter (:func:`greedy`, also for a plain engine, so both sync modes decode through one path).

Leaves out: where the adapter tensors come from (``trainer.lora``, the benchmark), the
merged-weight push (``SglangEngine.update_weights``). SGLang keys its radix cache by the
adapter's load id (a fresh id per load, appended to the request's ``extra_key``), so a
request never reuses KV that another adapter, or an older copy of this one, computed.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any, Mapping, Sequence

import torch

from . import sglang_api
from .errors import EngineError, EngineStartError
from .engine_config import EngineConfig
from .runtime import SglangEngine, run_guarded
from .weight_payloads import rank_payloads

_rids = itertools.count()


def start(model_path: str, rank: int, target_modules: Sequence[str] = (), **engine_kw: Any) -> LoraEngine:
    """An actor engine on ``model_path`` that serves adapters of rank <= ``rank`` on
    ``target_modules`` (HF linear names, e.g. q_proj; (): every module SGLang supports)."""
    cfg = EngineConfig(model_path, role="actor", lora_rank=rank, lora_target_modules=",".join(target_modules),
                       **engine_kw)
    check_pinned_memory(cfg)
    return LoraEngine(SglangEngine(cfg))


def check_pinned_memory(cfg: EngineConfig) -> None:
    """Refuse, in one line, a LoRA engine where the host cannot pin memory (CPU without a
    CUDA driver). SGLang 0.5.23's LoRA layers pin host tensors whatever the device
    (``sglang/srt/lora/layers.py``, ``ColumnParallelLinearWithLoRA.__init__``:
    ``torch.tensor(..., pin_memory=True)``; ``torch_backend.prepare_lora_batch`` too), so
    its scheduler fails while wrapping the first linear, and SGLang's SIGQUIT handler then
    kills this whole process instead of raising: checked here, before the start."""
    if sglang_api.prepare(cfg.device).device != "cpu":
        return
    try:
        torch.empty(1, pin_memory=True)
    except RuntimeError as exc:
        raise EngineStartError(
            f"could not start the {cfg.label} with LoRA: SGLang's LoRA layers pin host memory "
            f"(sglang/srt/lora/layers.py), which this machine cannot ({str(exc).splitlines()[0][:120]}); "
            "serve a LoRA actor through the merged-weight sync instead") from None


class LoraEngine:
    """An actor engine started with LoRA and the adapters loaded into it by name."""

    def __init__(self, engine: SglangEngine):
        self.engine = engine
        self.adapters: set[str] = set()

    def load(self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> float:
        """Load adapter ``name`` from PEFT-named ``tensors`` (``...q_proj.lora_A.weight``) and
        its PEFT config (``r``, ``lora_alpha``, ``target_modules``), replacing a loaded
        adapter of that name; returns the seconds taken (unload included). SGLang copies the
        adapter into its per-batch memory pool at the first request that names it. The unload
        waits until no request uses the old copy (SGLang's ``LoRARegistry.wait_for_unload``):
        with a request paused in place on it, it would wait forever."""
        started = time.perf_counter()
        if name in self.adapters:
            self.unload(name)
        api = self.engine._api
        obj = api.LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=dict(config),
            serialized_named_tensors=rank_payloads(dict(tensors), self.engine.cfg.tp_size))
        self._check("load", name, run_guarded(
            [self.engine], self.engine._engine.tokenizer_manager.load_lora_adapter_from_tensors(obj, None)))
        self.adapters.add(name)
        return time.perf_counter() - started

    def unload(self, name: str) -> None:
        obj = self.engine._api.UnloadLoRAAdapterReqInput(lora_name=name)
        self.adapters.discard(name)
        self._check("unload", name, run_guarded(
            [self.engine], self.engine._engine.tokenizer_manager.unload_lora_adapter(obj, None)))

    def _check(self, call: str, name: str, out: Any) -> None:
        if not getattr(out, "success", False):
            message = " ".join(str(getattr(out, "error_message", out)).split())
            raise EngineError(f"{call} of LoRA adapter {name!r} into the {self.engine.cfg.label} failed: {message}")

    def shutdown(self) -> None:
        self.engine.shutdown()


def greedy(engine: SglangEngine, prompts: Sequence[list[int]], new_tokens: int,
           lora: str | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts``, exactly ``new_tokens`` each (EOS ignored), all
    requests at once; ``lora``: the name of a loaded adapter (None: the engine's weights)."""
    sampling = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": new_tokens}
    tag = f"lora{next(_rids):06d}"

    async def one(i: int, prompt: list[int]) -> list[int]:
        out: list[int] = []
        async for chunk in engine.generate_stream(f"{tag}-{i:06d}", list(prompt), sampling, lora=lora):
            out = list(chunk["output_ids"])
        return out

    async def every() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return run_guarded([engine], every())
