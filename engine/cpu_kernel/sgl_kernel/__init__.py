"""CPU stand-in for the two ``sgl_kernel`` ops SGLang's CPU engine path calls.

PyPI ships no CPU build of ``sgl_kernel``; SGLang 0.5.x imports exactly two of its ops on
the CPU path (``mem_cache/allocation.py`` and ``kernels/ops/kvcache/cache_move.py``).
This package provides those two in plain PyTorch and nothing else: any other name fails
loudly with an ImportError that says so. ``colocate.engine.sglang_api.prepare`` puts
this folder on the import path (``sys.path`` and, for the spawned scheduler children,
``PYTHONPATH``) only when the real ``sgl_kernel`` is absent.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]
IS_COLOCATE_STANDIN = True


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # [B]
    req_to_token: torch.Tensor,  # [pool_rows, pool_len]
    start_offset: torch.Tensor,  # [B]
    end_offset: torch.Tensor,  # [B]
    out_cache_loc: torch.Tensor,  # [sum(end - start)]
    pool_len: int,
) -> None:
    """Write request i's slice of ``out_cache_loc`` into ``req_to_token[row_i, start_i:end_i]``."""
    del pool_len  # implied by req_to_token.shape[1]
    rows = req_pool_indices.tolist()
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    pos = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _byte_rows(ptr: int, stride: int, n_rows: int) -> torch.Tensor:
    """A zero-copy [n_rows, stride] uint8 view of the buffer at ``ptr``."""
    raw = (ctypes.c_uint8 * (n_rows * stride)).from_address(ptr)
    return torch.frombuffer(raw, dtype=torch.uint8).view(n_rows, stride)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,  # [L] uint64 buffer addresses
    strides: torch.Tensor,  # [L] bytes per slot (row)
    tgt_loc: torch.Tensor,  # [N]
    src_loc: torch.Tensor,  # [N]
) -> None:
    """For every layer buffer, copy slot ``src_loc[j]`` onto slot ``tgt_loc[j]``."""
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    n_rows = int(torch.maximum(tgt.max(), src.max()).item()) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _byte_rows(int(ptr), int(stride), n_rows)
        rows[tgt] = rows[src].clone()


def _missing_op(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not provided: colocate's CPU stand-in implements only "
            f"{__all__}. Install a real sgl_kernel build for this platform to use {name}."
        )

    missing.__name__ = name
    return missing


def __getattr__(name: str):
    """SGLang imports some CPU ops at module load (e.g. speculative decoding) that the
    paths colocate uses never call: resolve them to an op that fails loudly when called."""
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing_op(name)
