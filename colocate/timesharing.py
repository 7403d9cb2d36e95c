"""Time-sharing the devices between SGLang engines and FSDP training.

Owns: the order of sleep and wake. At start-up the engines give their memory back right
after they start, before the trainer loads its models (:func:`release`), and the first
wake pushes the trainer's weights (the actor's were released without a host copy). Before
training: release every engine's weights, KV cache and CUDA graphs, each engine first
waiting until its scheduler is idle (SGLang asserts it). After training: gather the
actor's full weights to host memory while FSDP still holds its shards on the device (an
all-gather over the device backend), offload FSDP params and optimizer state, wake the
engines' weights, push the new weights, empty torch's cache, then wake the KV caches and
CUDA graphs (waking KV before the push is how peers hit OOM at wake-up). On CPU, SGLang's
memory saver does nothing (it needs CUDA), so every call is a no-op by design;
:class:`TimeSharing` says so once.

Leaves out: the weight sync itself (``colocate.weight_sync``); the engine calls and their
guards (``engine.runtime``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, TypeVar

import torch

from colocate.engine.runtime import CUDA_GRAPH, KV_CACHE, MEMORY_TAGS, WEIGHTS

State = TypeVar("State")


def release(engines: Sequence) -> bool:
    """Release every tag of every engine (each waits for its scheduler to be idle first);
    True when anything was released (CUDA)."""
    released = False
    for e in engines:
        if e is not None:
            released = e.release_memory(MEMORY_TAGS) or released
    return released


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
        """Free engine weights, KV and CUDA graphs so training has the device."""
        if self.active:
            release(self.engines)
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
                e.resume_memory([WEIGHTS])
        seconds = gathered + push(state)
        if self.active:
            del state
            torch.cuda.empty_cache()  # what the push staged on the device goes back before KV wakes
            for e in self.engines:
                e.resume_memory([KV_CACHE, CUDA_GRAPH])
        return seconds
