"""What the GPU's memory did at each sleep and wake of a step (CUDA runs only).

Owns: :class:`DeviceMemory`, the readings ``colocate.run.timesharing`` takes around its
calls, turned into a step's ``gpu/*`` metrics: the device's free memory before and after
the engines release (and what share of the memory they took at start that is), the
trainer's peak allocation while the engines sleep, the free memory after the weights are
woken and pushed and after the KV caches wake. The device's free memory counts every
process on it (the engines' schedulers are processes of their own); torch's allocator
counts this process's tensors only, which is what the trainer's peak is.

Leaves out: when the readings are taken (``colocate.run.timesharing``), writing them
(``colocate.monitor.metrics``). Readers are injected, so the arithmetic is tested on CPU.
"""

from __future__ import annotations

from typing import Callable

GIB = float(2**30)


class DeviceMemory:
    """Readings of one step. ``free_bytes()``: the device's free memory; ``peak_bytes()``
    and ``reset_peak()``: this process's peak allocation since the last reset;
    ``engines_bytes``: what the engines took when they started (their weights, KV pool,
    graphs; 0 when unknown)."""

    def __init__(self, free_bytes: Callable[[], int], peak_bytes: Callable[[], int],
                 reset_peak: Callable[[], None], engines_bytes: int = 0) -> None:
        self.free_bytes, self.peak_bytes, self.reset_peak = free_bytes, peak_bytes, reset_peak
        self.engines_bytes = engines_bytes
        self._stats: dict[str, float] = {}

    @classmethod
    def cuda(cls, engines_bytes: int = 0) -> DeviceMemory:
        """Readings of this process's current CUDA device."""
        import torch

        return cls(lambda: torch.cuda.mem_get_info()[0], torch.cuda.max_memory_allocated,
                   torch.cuda.reset_peak_memory_stats, engines_bytes)

    def before_release(self) -> None:
        self._before = self.free_bytes()

    def after_release(self) -> None:
        after = self.free_bytes()
        released = after - self._before
        self._stats.update({"gpu/free_gib_before_release": self._before / GIB,
                            "gpu/free_gib_for_training": after / GIB,
                            "gpu/released_gib": released / GIB})
        if self.engines_bytes > 0:
            self._stats["gpu/released_frac"] = released / self.engines_bytes
            self._stats["gpu/engines_started_gib"] = self.engines_bytes / GIB
        self.reset_peak()

    def trained(self) -> None:
        """The trainer's step is over (before anything is offloaded or woken)."""
        self._stats["gpu/train_peak_allocated_gib"] = self.peak_bytes() / GIB

    def weights_pushed(self) -> None:
        self._stats["gpu/free_gib_after_push"] = self.free_bytes() / GIB

    def woken(self) -> None:
        self._stats["gpu/free_gib_after_wake"] = self.free_bytes() / GIB

    def take(self) -> dict[str, float]:
        """The readings since the last call (empty when none were taken)."""
        out, self._stats = self._stats, {}
        return out
