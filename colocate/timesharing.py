"""Time-sharing the devices between SGLang engines and FSDP training.

Owns: the order of sleep and wake per step. Before training: release the engines'
weights and KV cache. After training: gather the actor's full weights to host memory
while FSDP still holds its shards on the device (an all-gather over the device backend),
offload FSDP params and optimizer state, wake the actor's weights, push the new weights,
then wake the KV caches (waking KV before the push is how peers hit OOM at wake-up). On CPU, SGLang's memory saver does nothing (it needs
CUDA), so every call is a no-op by design; :class:`TimeSharing` says so once.

Leaves out: the weight sync itself (``colocate.weight_sync``).
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

State = TypeVar("State")


class TimeSharing:
    """Sleep/wake sequence for one actor engine, one reward engine and a trainer."""

    def __init__(self, engines: list, trainer, log: Callable[[str], None] = print) -> None:
        self.engines = [e for e in engines if e is not None]
        self.trainer = trainer
        self.active = any(e.device == "cuda" for e in self.engines)
        if not self.active and self.engines:
            log("time-sharing: CPU run — SGLang memory release/resume needs CUDA, so the "
                "sleep/wake calls are no-ops here (measured, not an error)")

    def sleep_engines(self) -> None:
        """Free engine weights + KV so training has the device."""
        if self.active:
            for e in self.engines:
                e.release_memory()
        self.trainer.onload()

    def wake_and_sync(self, gather: Callable[[], State], push: Callable[[State], float]) -> float:
        """Gather the full weights, offload training state, wake weights, push, wake KV.

        Returns the sync seconds: the gather's wall time plus what ``push`` reports."""
        start = time.perf_counter()
        state = gather()
        gathered = time.perf_counter() - start
        self.trainer.offload()
        if self.active:
            for e in self.engines:
                e.resume_memory(["weights"])
        seconds = gathered + push(state)
        if self.active:
            for e in self.engines:
                e.resume_memory(["kv_cache"])
        return seconds
