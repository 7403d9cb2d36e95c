"""Padding-free rows: the sequences of a micro-batch concatenated into one row, and back.

Owns: `PackedRows` (built by `pack` from a right-padded `TrainBatch`): input ids [1, N]
(N = the rows' prompt + response tokens, no padding), position ids restarting at 0 at
each sequence, and the packed positions whose outputs predict (or value) each response
token; `unpack`, which scatters per-token results back into the [b, T] layout the PPO math
uses; `idle_batch`, a one-token row without response tokens for the idle micro-batches of
`trainer/packing.py`.

Leaves out: models. Sequence boundaries reach attention through the position ids alone:
transformers (5.x, `masking_utils.find_packed_sequence_indices`) detects packed sequences
from position ids that restart, when no attention mask and no KV cache are passed, and
keeps attention inside each sequence (a block-diagonal causal mask for sdpa/eager/flex;
flash-attention's varlen kernels on CUDA). Rotary embeddings see the same positions as
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

    @property
    def tokens(self) -> int:
        """N, the tokens of the packed row."""
        return int(self.input_ids.shape[1])


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
    )
