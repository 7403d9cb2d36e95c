"""Trainer → actor engine weight sync in size-bounded buckets.

Owns: cutting a full (HF-named) state dict into buckets of at most ``bucket_bytes`` and
pushing them through the engine's tensor-update API under a new weight version (the
engine flushes its radix cache with the last bucket — or, while requests paused in place
hold KV, leaves the old KV in the old version's namespace of the cache, where no new
request looks — so no new request is served KV computed under the old weights). The state may be host tensors (CPU) or the trainer's device
tensors made one at a time (CUDA: cut and cast on the device, sent as CUDA-IPC handles;
with a tensor-parallel engine every rank of its group cuts the same buckets and each TP rank
loads its own training rank's copy). Leaves out: gathering the state from FSDP
(``trainer``); the exchange between the ranks of a TP group (``colocate.run.tp_exchange``).
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import torch

from colocate.run.tp_exchange import TPExchange

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


def buckets(state: Weights, bucket_bytes: int,
            dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of named tensors (a state dict, or (name, tensor) pairs made one
    at a time), each at most ``bucket_bytes`` (a single larger tensor gets a bucket of its
    own); floating tensors cast to ``dtype`` (the engine's) as each bucket is cut, so only
    one bucket's copy exists at a time."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items() if isinstance(state, Mapping) else state:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, tensor.detach().contiguous()))
        size += nbytes
    if cur:
        yield cur


def sync(engine, state: Weights, version: int, bucket_mb: int, tp: TPExchange | None = None) -> float:
    """Load ``state`` into ``engine`` as ``version``, in the engine's dtype; returns seconds
    taken. Requests paused at the last cut (``overlap.pause_mode`` in_place/retract) stay
    paused: the time-sharing lets them go on once the engine's KV cache is back
    (``colocate.run.timesharing``). ``tp``: a tensor-parallel engine's TP rank i gets
    training rank i's copy of each bucket (the other ranks :func:`serve` theirs)."""
    cut = buckets(state, bucket_mb << 20, getattr(torch, engine.cfg.dtype))
    if tp is None:
        return engine.update_weights(cut, version=version)
    return tp.push(lambda walk, exchange: engine.update_weights(walk, version=version, exchange=exchange), cut)


def serve(tp: TPExchange, state: Weights, bucket_mb: int) -> None:
    """A rank without engines in a tensor-parallel group: cut the same buckets as its host
    (``tp.dtype``, the engine's) from its own copy of ``state`` and serve them to the TP
    rank on its GPU. Collective over the group (and ``state``'s lazy gather)."""
    tp.serve(buckets(state, bucket_mb << 20, tp.dtype))
