"""Variable-length attention without flash-attention: causal sdpa run per packed sequence.

Owns: `VARLEN_SDPA`, the name of an attention implementation for transformers models, and
`register_varlen_sdpa`, which registers it through transformers' own extension points
(`AttentionInterface.register` for the attention, `AttentionMaskInterface.register` with
transformers' sdpa mask for padded inputs). Given a packed row's sequence boundaries
(`cu_seq_lens_q`, the keyword flash-attention's varlen path takes, passed through the
model's forward) it runs torch's causal sdpa on each sequence's slice of queries, keys and
values: the work of each sequence is ~len^2 instead of the ~N^2 of sdpa over the whole row
with a block-diagonal mask. Measured on our CPU (thread CPU time, SmolLM2's 9 x 64 heads,
one layer, fwd + bwd): 58 / 155 / 375 ms for packed rows of 1200 / 2400 / 4000 tokens
against 234 / 1132 / 2650 ms for the masked whole-row sdpa.

A shared-prefix packed row (several responses after one prompt, `trainer/packed.py`) is not
causal per segment; it comes with its mask and `shared_prefix_bounds`: each segment runs
sdpa with its block of the mask (~segment^2 work, not ~N^2).

Leaves out: where the boundaries come from (`trainer/packed.py`) and when this
implementation is chosen (`TrainerSettings.attn_implementation`). Without boundaries
(the right-padded path) it is exactly transformers' sdpa with its mask.
"""

from __future__ import annotations

import torch

VARLEN_SDPA = "colocate_varlen_sdpa"


def varlen_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    sliding_window: int | None = None,
    shared_prefix_bounds: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query [1, H, N, D], key/value [1, Hkv, N, D]
    with `cu_seq_lens_q` [S + 1] (0, end of sequence 1, ..., N) -> ([1, N, H, D], None);
    with `shared_prefix_bounds` instead (segments of a shared-prefix packed row,
    `trainer/packed.py`) and its [1, 1, N, N] bool `attention_mask`: sdpa per segment with
    the segment's block of the mask; with neither, transformers' sdpa (mask and all)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    masked = shared_prefix_bounds is not None and cu_seq_lens_q is None
    if cu_seq_lens_q is None and not masked:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    bounds = (shared_prefix_bounds if masked else cu_seq_lens_q).tolist()
    if sliding_window is not None and max(b - a for a, b in zip(bounds, bounds[1:])) > sliding_window:
        raise NotImplementedError(f"{VARLEN_SDPA} has no sliding window ({sliding_window} tokens)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
            attn_mask=attention_mask[:, :, a:b, a:b] if masked else None,
            dropout_p=dropout if module.training else 0.0, is_causal=not masked, scale=scaling)
        for a, b in zip(bounds, bounds[1:]) if b > a
    ]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None  # [1, N, H, D]


def register_varlen_sdpa() -> str:
    """Register `VARLEN_SDPA` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    return VARLEN_SDPA
