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
causal per segment; it comes with `shared_prefix_blocks`, its parts as ranges: a prompt (or
an unshared sequence) runs causal sdpa on itself, a response runs sdpa over the prompt's
keys and its own with the lower-right causal mask (the whole prompt visible, itself
causally): ~response x (prompt + response) work per response, not the ~segment^2 of the
segment's block of the [N, N] mask (3.3x more for 4 responses of 256 tokens after a
119-token prompt). Measured on our CPU, SmolLM2's heads, fwd + bwd of one layer's
attention (scripts/attention_parts_bench.py, medians): 152 -> 86 ms for 2 such groups,
but 55-61 -> 77-79 ms for 4 groups of short responses (40/64/90/126 tokens; equal minima);
the whole random SmolLM2-135M over a batch of lognormal responses (median 64, up to 256;
1,822 tokens): 10.53 -> 9.93 s (median of 6, interleaved). Batching parts into fewer calls
was tried and did not pay inside the model on this CPU (docs/bench.md).

On CPU, half-precision inputs (``models.dtype=bfloat16``) are attended in float32, part by
part, and each part's output cast back: torch's CPU sdpa kernels run slower in bf16 than in
float32, most in backward (a profile of one bf16 critic update: sdpa's backward 0.48 s against
float32's 0.13). One layer, SmolLM2's heads, 2,402 tokens in 8 shared-prefix groups, fwd + bwd,
medians of 10 interleaved runs: 171.7 -> 124.5 ms (unshared: 133.4 -> 84.2 ms). Casting the
whole row first was slower than bf16 (232 ms): each part's slice then back-propagates through
a full-size float32 tensor.

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
    shared_prefix_blocks: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature. query [1, H, N, D], key/value [1, Hkv, N, D]
    with `cu_seq_lens_q` [S + 1] (0, end of sequence 1, ..., N) -> ([1, N, H, D], None);
    with `shared_prefix_blocks` instead ([K, 4]: each part's positions [q0, q1) and the
    prompt [p0, p1) it sees, `PackedRows.prefix_blocks`): sdpa per part (the row's
    `attention_mask` is not read); with neither, transformers' sdpa (mask and all)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None and shared_prefix_blocks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, sliding_window=sliding_window, **kwargs)
    if shared_prefix_blocks is not None:
        blocks = shared_prefix_blocks.tolist()
    else:
        bounds = cu_seq_lens_q.tolist()
        blocks = [(a, b, a, a) for a, b in zip(bounds, bounds[1:])]
    if sliding_window is not None and max(p1 - p0 + q1 - q0 for q0, q1, p0, p1 in blocks) > sliding_window:
        raise NotImplementedError(f"{VARLEN_SDPA} has no sliding window ({sliding_window} tokens)")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    dropout_p = dropout if module.training else 0.0
    dtype = query.dtype
    upcast = query.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)  # the math in float32 (see above)

    def part(q0: int, q1: int, p0: int, p1: int) -> torch.Tensor:
        q = query[:, :, q0:q1]
        if p1 == p0:  # a sequence (or a prompt) on its own: causal
            k, v = key[:, :, q0:q1], value[:, :, q0:q1]
        else:
            k = torch.cat([key[:, :, p0:p1], key[:, :, q0:q1]], dim=2)
            v = torch.cat([value[:, :, p0:p1], value[:, :, q0:q1]], dim=2)
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        if p1 == p0:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                                    scale=scaling).to(dtype)
        seen = torch.ones(q1 - q0, p1 - p0 + q1 - q0, dtype=torch.bool, device=query.device).tril(p1 - p0)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=seen, dropout_p=dropout_p, scale=scaling).to(dtype)

    parts = [part(*block) for block in blocks if block[1] > block[0]]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None  # [1, N, H, D]


def register_varlen_sdpa() -> str:
    """Register `VARLEN_SDPA` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
    return VARLEN_SDPA
