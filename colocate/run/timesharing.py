"""Time-sharing the devices between SGLang engines and FSDP training.

Owns: the order of sleep and wake. At start-up the engines give their memory back right
after they start, before the trainer loads its models (:func:`release`), and the first
wake pushes the trainer's weights (the actor's were released without a host copy). Before
training: drain the inline reward feeder (``quiesce``: no scoring request may reach the
reward engine from here to its wake), then release every engine's weights, KV cache and
CUDA graphs, each engine first waiting until its scheduler is idle (SGLang asserts it).
After training (CUDA): offload what the weight gather does not need (optimizer states,
reference, critic: verl's order), wake the engines' weights, push the actor's weights
device to device while FSDP still holds its shards there (each tensor all-gathered in
turn, cut into buckets, cast, handed over as CUDA-IPC handles: no host round trip, as
slime and verl push), offload the actor, empty torch's cache, then wake the KV caches
and CUDA graphs (waking KV before the push is how peers hit OOM at wake-up), and only
then let requests paused at the cut go on (``overlap.pause_mode`` retract). The peak of
the push is then the actor's FSDP shard + the engines' weights + one gathered tensor +
two buckets, not the whole training state beside the engines' weights. A tensor-parallel
engine (``engines.tp_size`` > 1) holds shards on the GPUs of ranks that host no engine:
``barrier`` (every rank) keeps them from loading their trainer before the release is
done, and the engine from waking weights, then KV, before they have offloaded. On CPU, SGLang's
memory saver does nothing (it needs CUDA), so every call is a no-op by design;
:class:`TimeSharing` says so once.

Leaves out: the weight sync itself (``colocate.run.weight_sync``); the engine calls and their
guards (``engine.runtime``).
"""

from __future__ import annotations

import time
from typing import Callable, Sequence, TypeVar

import torch

from colocate.engine.runtime import CUDA_GRAPH, KV_CACHE, MEMORY_TAGS, WEIGHTS
from colocate.monitor.device_memory import DeviceMemory

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
    """Sleep/wake sequence for this rank's actor and reward engine and its trainer.
    ``device_push``: the weights go device to device (the trainer trains on CUDA); the
    same on every rank, engines or not, since the gather is collective. ``quiesce``: stops
    every request the engines would get from this rank's own tasks (the inline reward
    feeder's scoring, ``Rollouts.drain``) before they release. ``barrier``: waits for every
    rank (tensor-parallel engines, whose shards share GPUs with other ranks' trainers).
    ``memory``: readings of the device around each call (``gpu/*`` metrics of the step,
    :meth:`take_stats`); by default the CUDA device's when the engines run there."""

    def __init__(self, engines: list, trainer, log: Callable[[str], None] = print, *,
                 device_push: bool = False, quiesce: Callable[[], None] | None = None,
                 barrier: Callable[[], None] | None = None, memory: DeviceMemory | None = None) -> None:
        self.engines = [e for e in engines if e is not None]
        self.trainer = trainer
        self.device_push = device_push
        self.quiesce = quiesce
        self.barrier = barrier or (lambda: None)
        self.active = any(e.device == "cuda" for e in self.engines)
        if memory is None and self.active and torch.cuda.is_available():
            memory = DeviceMemory.cuda(sum(getattr(e, "start_gpu_bytes", 0) for e in self.engines))
        self.memory = memory
        self._stats: dict[str, float] = {}
        if not self.active and self.engines:
            log("time-sharing: CPU run — SGLang memory release/resume needs CUDA, so the "
                "sleep/wake calls are no-ops here (measured, not an error)")

    def sleep_engines(self) -> None:
        """Free engine weights, KV and CUDA graphs so training has the device (the
        feeder's scoring stopped first)."""
        if self.active:
            if self.quiesce is not None:
                self.quiesce()
            self._read("before_release")
            release(self.engines)
            self._read("after_release")
        self.barrier()  # a TP engine's shards are off every GPU before any trainer loads
        self.trainer.onload()

    def wake_and_sync(self, gather: Callable[[], State], push: Callable[[State], float]) -> float:
        """Push the trainer's weights into the engines, with the engines' memory woken
        around it; returns the sync seconds.

        CUDA: offload all but the actor's parameters, wake the engines' weights, push what
        ``gather`` makes (the actor's tensors gathered one at a time on the device from
        FSDP's shards, each bucket cast and sent device to device), then offload the actor,
        empty torch's cache and wake KV caches and CUDA graphs. Elsewhere: gather to host,
        offload (nothing to free), push."""
        start = time.perf_counter()
        self._read("trained")
        if self.device_push:
            self.trainer.offload(keep_actor=True)  # optimizer states, reference, critic: the gather needs none
            self.barrier()  # every rank's room made before a TP engine's weights wake on its GPU
            for e in self.engines:
                e.resume_memory([WEIGHTS])
            pushed = time.perf_counter()
            push(gather())
            self._stats["sync/push_s"] = time.perf_counter() - pushed  # gather + cast + push, device to device
            self._read("weights_pushed")
            self.trainer.offload()
            torch.cuda.empty_cache()  # what the push staged on the device goes back before KV wakes
            self.barrier()  # every rank offloaded before a TP engine's KV wakes on its GPU
            for e in self.engines:
                e.resume_memory([KV_CACHE, CUDA_GRAPH])
            self._read("woken")
            self._continue()
            return time.perf_counter() - start
        state = gather()
        gathered = time.perf_counter() - start
        self.trainer.offload()
        pushed = push(state)
        self._stats["sync/push_s"] = pushed
        self._continue()
        return gathered + pushed

    def _continue(self) -> None:
        """Requests paused at the cut (``overlap.pause_mode`` in_place/retract) go on under
        the new weights, only now that the KV cache is back: SGLang's continue does not check
        for released memory, and retracted requests would be scheduled into it."""
        for e in self.engines:
            if getattr(e, "paused", None) is not None:
                e.continue_paused()

    def _read(self, point: str) -> None:
        if self.memory is not None:
            getattr(self.memory, point)()

    def take_stats(self) -> dict[str, float]:
        """The last sleep/wake's ``sync/push_s`` and (CUDA) ``gpu/*`` readings; cleared."""
        out = {**self._stats, **(self.memory.take() if self.memory is not None else {})}
        self._stats = {}
        return out
