"""Padding-free rows: the sequences of a micro-batch concatenated into one row, and back.

Owns: `PackedRows` (built by `pack` from a right-padded `TrainBatch`): input ids [1, N]
(N = the rows' prompt + response tokens, no padding), position ids restarting at 0 at
each sequence, and the packed positions whose outputs predict (or value) each response
token; `unpack`, which scatters per-token results back into the [b, T] layout the PPO math
uses; `idle_batch`, a one-token row without response tokens for the idle micro-batches of
`trainer/packing.py`.

Leaves out: models. Sequence boundaries reach attention in two ways: as `cu_seq_lens`
(`PackedRows.attention_kwargs`, taken by flash-attention 2 and `trainer/varlen_attention.py`,
which attend within each sequence only), and through position ids that restart, from
which transformers (5.x, `masking_utils.find_packed_sequence_indices`, with no attention
mask and no KV cache) builds a block-diagonal causal mask for sdpa/eager/flex. Rotary embeddings see the same positions as
in the right-padded row, so every result equals the padded path's up to float rounding.
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import TrainBatch, response_positions


@dataclasses.dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # [1, N] long, each row's prompt + response tokens, concatenated
    position_ids: torch.Tensor  # [1, N] long, 0, 1, ... restarting at each row
    keep: torch.Tensor  # [n'] long, packed position predicting each response token (row-major); n' = max(n, 1)
    targets: torch.Tensor  # [n'] long, the response token each kept position predicts
    response_mask: torch.Tensor  # [b, T] bool, where the n results go back
    cu_seq_lens: torch.Tensor  # [b + 1] int32: 0, then where each row ends in the packed row

    @property
    def tokens(self) -> int:
        """N, the tokens of the packed row."""
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict[str, torch.Tensor | int]:
        """The sequence boundaries as the keywords of transformers' varlen attention
        (flash-attention 2, `trainer/varlen_attention.py`), for a model's forward."""
        longest = int((self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).max())
        return dict(cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                    max_length_q=longest, max_length_k=longest)


def pack(batch: TrainBatch) -> PackedRows:
    """The rows of `batch` as one padding-free row (see `PackedRows`).

    With no response token in the batch, `keep` holds position 0 (so a forward still has
    an output to differentiate) and `unpack` writes nothing.
    """
    used = batch.attention_mask.bool()  # [b, L], a prefix of each row (right padding)
    lengths = used.sum(-1)  # [b]
    columns = torch.arange(used.shape[1], device=used.device).expand_as(used)  # [b, L]
    offsets = torch.cumsum(lengths, 0) - lengths  # [b] packed position of each row's first token
    mask = batch.response_mask.bool()  # [b, T]
    keep = (response_positions(batch) + offsets[:, None])[mask]  # [n]
    targets = batch.responses[mask]  # [n]
    if keep.numel() == 0:
        keep, targets = keep.new_zeros(1), targets.new_zeros(1)
    return PackedRows(
        input_ids=batch.input_ids[used][None],
        position_ids=columns[used][None],
        keep=keep,
        targets=targets,
        response_mask=mask,
        cu_seq_lens=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32),
    )


def unpack(flat: torch.Tensor, packed: PackedRows) -> torch.Tensor:
    """Per-kept-position results [n'] -> [b, T] (row-major into the response mask, 0 elsewhere).

    Differentiable with respect to `flat`.
    """
    mask = packed.response_mask.to(flat.device)
    return flat.new_zeros(mask.shape).masked_scatter(mask, flat)  # [b, T]


def idle_batch(batch: TrainBatch) -> TrainBatch:
    """Row 0 of `batch` cut to its first token, with no response token: a forward over it
    costs one token and (with its loss mask all False) contributes nothing."""
    row = batch.select(torch.zeros(1, dtype=torch.long))
    return dataclasses.replace(
        row,
        input_ids=row.input_ids[:, :1],
        attention_mask=torch.ones_like(row.attention_mask[:, :1]),
        response_start=torch.ones_like(row.response_start),
        response_mask=torch.zeros_like(row.response_mask),
        loss_mask=torch.zeros_like(row.loss_mask),
    )
