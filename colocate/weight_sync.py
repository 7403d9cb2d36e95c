"""Trainer → actor engine weight sync in size-bounded buckets.

Owns: cutting a full (HF-named) state dict into buckets of at most ``bucket_bytes`` and
pushing them through the engine's tensor-update API under a new weight version (the
engine flushes its radix cache with the last bucket, so no request is served KV computed
under the old weights). Leaves out: gathering the state from FSDP (``trainer``).
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch


def buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of named tensors, each at most ``bucket_bytes`` (a single larger
    tensor gets a bucket of its own)."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, tensor.detach().contiguous()))
        size += nbytes
    if cur:
        yield cur


def sync(engine, state: Mapping[str, torch.Tensor], version: int, bucket_mb: int) -> float:
    """Load ``state`` into ``engine`` as ``version``; returns seconds taken."""
    return engine.update_weights(buckets(state, bucket_mb << 20), version=version)
