"""Padding-free rows: the sequences of a micro-batch concatenated into one row, and back.

Owns: `PackedRows` (built by `pack` from a right-padded `TrainBatch`): input ids [1, N]
(N = the rows' prompt + response tokens, no padding), position ids restarting at 0 at
each sequence, and the packed positions whose outputs predict (or value) each response
token; `unpack`, which scatters per-token results back into the [b, T] layout the PPO math
uses; `idle_batch`, a one-token row without response tokens for the idle micro-batches of
`trainer/packing.py`. Shared prefixes (`pack(batch, share=True)`, issue 36): rows of one
group with equal prompts (`prefix_groups`) become one segment, the prompt once and then
each response with positions continuing from the prompt's end, every response attending
to the prompt and to itself only (`visible`); `trainer_tokens` counts what
that saves.

Leaves out: models. Sequence boundaries reach attention in three ways: as `cu_seq_lens`
(`PackedRows.attention_kwargs`, taken by flash-attention 2 and `trainer/varlen_attention.py`,
which attend within each sequence only); as a flex attention BlockMask of `visible` (each
token's segment and part), one kernel per layer over the whole row; and through position
ids that restart, from which transformers (5.x, `masking_utils.find_packed_sequence_indices`,
with no attention mask and no KV cache) builds a block-diagonal causal mask for sdpa/eager.
Rotary embeddings see the same positions as in the right-padded row, so every result
equals the padded path's up to float rounding. A shared-prefix row's mask is not
block-diagonal: it goes to the model as a [1, 1, N, N] bool `attention_mask`, which
transformers (5.x, `masking_utils._preprocess_mask_arguments`) passes to sdpa as given,
plus its parts for `trainer/varlen_attention.py` (`PackedRows.prefix_blocks`: sdpa per
part over its prompt and itself), or as the BlockMask. Flash-attention 2 cannot take the mask
(the trainer does not share there, `TrainerSettings.shares_prefix`).
"""

from __future__ import annotations

import dataclasses

import torch

from .batch import TrainBatch, response_positions
from .packing import Plan, shared_units, unit_tokens


FLEX_BLOCK = 128  # flex attention's block (create_block_mask's default): a flex row is padded to a multiple


@dataclasses.dataclass(frozen=True)
class PackedRows:
    input_ids: torch.Tensor  # [1, N] long, each row's prompt + response tokens, concatenated
    position_ids: torch.Tensor  # [1, N] long, 0, 1, ... restarting at each row
    keep: torch.Tensor  # [n'] long, packed position predicting each response token (row-major); n' = max(n, 1)
    targets: torch.Tensor  # [n'] long, the response token each kept position predicts
    response_mask: torch.Tensor  # [b, T] bool, where the n results go back
    cu_seq_lens: torch.Tensor  # [S + 1] int32: 0, then where each segment (a row, or a shared-prefix group) ends
    segment: torch.Tensor  # [N] long, each token's segment (0 … S-1)
    # [N] long, each token's part of its segment: 0 in a prompt part (and in every unshared
    # segment), k in a shared-prefix segment's k-th response
    part: torch.Tensor
    shared: bool = False  # some segment holds several responses after one prompt (not causal per segment)

    @property
    def tokens(self) -> int:
        """N, the tokens of the packed row."""
        return int(self.input_ids.shape[1])

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """Shared-prefix rows: [1, 1, N, N] bool, True where query i may attend to key j
        (`visible`); None: every segment is one causal sequence."""
        if not self.shared:
            return None
        index = torch.arange(self.tokens, device=self.segment.device)
        return visible(self.segment, self.part, index[:, None], index[None, :])[None, None]

    def padded(self, multiple: int) -> PackedRows:
        """The row with pad tokens appended up to a multiple of `multiple` tokens, in a
        segment of their own (no real token sees them; `keep` unchanged). Flex attention runs
        whole 128-token blocks: torch 2.11's inductor found no kernel for an 85-token row
        (scripts/gpu_flex_probe.py on an H200; 256 and 1,025 tokens compiled). Whole blocks
        also keep clear of pytorch#153799 (NaN gradients for a row ending inside a block
        with a score_mod beside the BlockMask, as transformers passes; not seen here)."""
        extra = -self.tokens % multiple
        if not extra:
            return self
        ids = self.input_ids.new_zeros(1, extra)
        tail = torch.arange(extra, device=self.segment.device)
        return dataclasses.replace(
            self, input_ids=torch.cat([self.input_ids, ids], 1),
            position_ids=torch.cat([self.position_ids, tail[None]], 1),
            cu_seq_lens=torch.cat([self.cu_seq_lens, self.cu_seq_lens.new_tensor([self.tokens + extra])]),
            segment=torch.cat([self.segment, torch.full_like(tail, len(self.cu_seq_lens) - 1)]),
            part=torch.cat([self.part, torch.zeros_like(tail)]))

    def for_attention(self, implementation: str | None) -> PackedRows:
        """The row as `implementation` runs it: padded to `FLEX_BLOCK` for flex attention."""
        return self.padded(FLEX_BLOCK) if implementation == "flex_attention" else self

    def attention_kwargs(self, implementation: str | None = None) -> dict[str, object]:
        """A model forward's attention keywords for transformers' `implementation`.
        "flex_attention": a BlockMask of `visible` (one kernel per layer, blocks no query
        sees skipped), which transformers passes to flex attention as given. Otherwise,
        without shared prefixes: the sequence boundaries as the keywords of transformers'
        varlen attention (flash-attention 2, `trainer/varlen_attention.py`); with them: the
        [1, 1, N, N] mask, which transformers passes to sdpa as given, and the segment
        parts as `shared_prefix_blocks` (`prefix_blocks`), with which
        `trainer/varlen_attention.py` runs sdpa per part (others ignore it)."""
        if implementation == "flex_attention":
            return dict(attention_mask=self.block_mask())
        if self.shared:
            return dict(attention_mask=self.attention_mask, shared_prefix_blocks=self.prefix_blocks())
        longest = int((self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).max())
        return dict(cu_seq_lens_q=self.cu_seq_lens, cu_seq_lens_k=self.cu_seq_lens,
                    max_length_q=longest, max_length_k=longest)

    def prefix_blocks(self) -> torch.Tensor:
        """[K, 4] long, one row per part of every segment in row order (a prompt, a response,
        an unshared sequence): the part's positions [q0, q1) and the prompt [p0, p1) it sees
        whole besides itself causally (p0 == p1 for part 0). `visible` as ranges: with it
        attention runs each part over its prompt and itself only (~part x (prompt + part)
        work), not the segment's whole block."""
        key = self.segment * (int(self.part.max()) + 1) + self.part  # one id per (segment, part)
        _, counts = torch.unique_consecutive(key, return_counts=True)
        ends = torch.cumsum(counts, 0).tolist()
        blocks, prompt = [], (0, 0)
        for start, end in zip([0, *ends[:-1]], ends):
            if int(self.part[start]) == 0:  # a prompt part (or an unshared sequence) starts a segment
                blocks.append((start, end, start, start))
                prompt = (start, end)
            else:
                blocks.append((start, end, *prompt))
        return torch.tensor(blocks, dtype=torch.long)

    def block_mask(self):  # noqa: ANN201 - torch.nn.attention.flex_attention.BlockMask
        """`visible` as flex attention's BlockMask over the packed row ([1, 1, N, N])."""
        from torch.nn.attention.flex_attention import create_block_mask

        segment, part = self.segment, self.part

        def mask_mod(b, h, q, kv):  # noqa: ANN001, ANN202 - flex attention's mask_mod signature
            return visible(segment, part, q, kv)

        return create_block_mask(mask_mod, None, None, self.tokens, self.tokens, device=segment.device)


def visible(segment: torch.Tensor, part: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Whether query position q may attend to key position kv of a packed row (broadcast
    over q and kv): one segment, kv <= q, and kv in the prompt part or in q's response (a
    prompt part precedes its responses; an unshared segment is all part 0: causal)."""
    return (segment[q] == segment[kv]) & (kv <= q) & ((part[kv] == 0) | (part[kv] == part[q]))


def pack(batch: TrainBatch, share: bool = False) -> PackedRows:
    """The rows of `batch` as one padding-free row (see `PackedRows`); with `share`, rows
    that share a prompt (`prefix_groups`) as one shared-prefix segment each (`_pack_shared`);
    without such rows, exactly the unshared packing.

    With no response token in the batch, `keep` holds position 0 (so a forward still has
    an output to differentiate) and `unpack` writes nothing.
    """
    if share:
        segments = prefix_groups(batch)
        if any(len(rows) > 1 for rows in segments):
            return _pack_shared(batch, segments)
    used = batch.attention_mask.bool()  # [b, L], a prefix of each row (right padding)
    lengths = used.sum(-1)  # [b]
    columns = torch.arange(used.shape[1], device=used.device).expand_as(used)  # [b, L]
    offsets = torch.cumsum(lengths, 0) - lengths  # [b] packed position of each row's first token
    mask = batch.response_mask.bool()  # [b, T]
    keep = (response_positions(batch) + offsets[:, None])[mask]  # [n]
    targets = batch.responses[mask]  # [n]
    if keep.numel() == 0:
        keep, targets = keep.new_zeros(1), targets.new_zeros(1)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=used.device), lengths)  # [N]
    return PackedRows(
        input_ids=batch.input_ids[used][None],
        position_ids=columns[used][None],
        keep=keep,
        targets=targets,
        response_mask=mask,
        cu_seq_lens=torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32),
        segment=segment,
        part=torch.zeros_like(segment),
    )


def prefix_groups(batch: TrainBatch) -> list[list[int]]:
    """The rows of `batch` in segments that share a prompt: rows of one group (`groups`)
    whose prompt tokens are equal, in ascending order; every other row alone. Segments in
    the order of their first row."""
    prompts = [tuple(row[:start]) for row, start in zip(batch.input_ids.tolist(), batch.response_start.tolist())]
    segments: dict[tuple, list[int]] = {}
    for b, (group, prompt) in enumerate(zip(batch.groups.tolist(), prompts)):
        segments.setdefault((group, prompt), []).append(b)
    return list(segments.values())


def _pack_shared(batch: TrainBatch, segments: list[list[int]]) -> PackedRows:
    """`pack` with shared prefixes: each segment of several rows is its prompt (positions
    0 … P-1) then each row's response (positions P, P+1, … again for every response); a
    one-row segment is its row, as unshared. Row b's first response token is predicted by
    its prompt's last position (the same for the whole segment: `keep` repeats it), token
    t > 0 by its own response's token t - 1. The mask: token j is visible to token i iff
    both are in one segment, j <= i, and j is in the prompt part or in i's response."""
    device = batch.input_ids.device
    lengths = batch.attention_mask.sum(-1).tolist()
    starts = batch.response_start.tolist()
    ids, positions, segment_of, part_of = [], [], [], []
    first, response_at = [0] * batch.size, [0] * batch.size  # packed: predicts token 0, holds token 0
    offset = 0

    def add(tokens: torch.Tensor, start: int, segment: int, part: int) -> None:
        ids.append(tokens)
        positions.append(torch.arange(start, start + len(tokens), device=device))
        segment_of.append(torch.full((len(tokens),), segment, device=device))
        part_of.append(torch.full((len(tokens),), part, device=device))

    for s, rows in enumerate(segments):
        prompt = starts[rows[0]]
        if len(rows) == 1:  # unshared: prompt and response as one causal sequence
            b = rows[0]
            add(batch.input_ids[b, : lengths[b]], 0, s, 0)
            first[b], response_at[b] = offset + prompt - 1, offset + prompt
            offset += lengths[b]
            continue
        add(batch.input_ids[rows[0], :prompt], 0, s, 0)
        offset += prompt
        last = offset - 1  # the prompt's last position predicts every response's first token
        for k, b in enumerate(rows, 1):
            size = lengths[b] - prompt
            add(batch.input_ids[b, prompt : prompt + size], prompt, s, k)
            first[b], response_at[b] = last, offset
            offset += size
    segment, part = torch.cat(segment_of), torch.cat(part_of)  # [N]
    width = batch.responses.shape[1]
    where = torch.tensor(response_at, device=device)[:, None] - 1 + torch.arange(width, device=device)  # [b, T]
    where[:, 0] = torch.tensor(first, device=device)
    mask = batch.response_mask.bool()  # [b, T]
    keep, targets = where[mask], batch.responses[mask]  # [n]
    if keep.numel() == 0:
        keep, targets = keep.new_zeros(1), targets.new_zeros(1)
    bounds = torch.cumsum(torch.bincount(segment), 0)  # [S] where each segment ends
    return PackedRows(
        input_ids=torch.cat(ids)[None],
        position_ids=torch.cat(positions)[None],
        keep=keep,
        targets=targets,
        response_mask=mask,
        cu_seq_lens=torch.cat([bounds.new_zeros(1), bounds]).to(torch.int32),
        segment=segment,
        part=part,
        shared=True,
    )


def trainer_tokens(batch: TrainBatch, shared_prefix: bool, budget: int | None = None) -> tuple[int, int]:
    """(computed, sample_tokens) of one packed pass over `batch`: the tokens the trainer's
    forward runs (shared prefixes: each group's prompt once, once per part when a group is
    split over micro-batches of `budget` tokens), and every row's prompt + response."""
    segments = prefix_groups(batch) if shared_prefix else [[b] for b in range(batch.size)]
    return unit_tokens(segments, *_row_tokens(batch), budget)


def shared_plan_units(batch: TrainBatch, budget: int) -> tuple[Plan, list[int]]:
    """(units, their tokens) of `batch` for a shared-prefix plan (`packing.shared_units`):
    each group sharing a prompt whole, or in parts of at most `budget` tokens."""
    return shared_units(prefix_groups(batch), *_row_tokens(batch), budget)


def _row_tokens(batch: TrainBatch) -> tuple[list[int], list[int]]:
    """(prompt tokens, response tokens) of each row."""
    prompts = batch.response_start.tolist()
    return prompts, [n - p for n, p in zip(batch.attention_mask.sum(-1).tolist(), prompts)]


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
