"""Shared-prefix planning and packing (issue 36) against naive loops: which rows share a
prompt, the units a group splits into, the micro-batches that keep them whole, the
packed row's layout and mask, and the trainer-token count.

The references walk rows and tokens one at a time in plain Python and never call the
code under test. Random cases come from hypothesis.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate.trainer.batch import TrainBatch, make_batch
from colocate.trainer.packed import pack, prefix_groups, trainer_tokens
from colocate.trainer.packing import packed_micro_batches, shared_units, unit_micro_batches, unit_tokens

# a batch as (prompt id of each group, rows per group, response lengths): groups of 1-4 rows
group_st = st.tuples(st.integers(1, 6), st.lists(st.integers(0, 7), min_size=1, max_size=4))
batch_st = st.lists(group_st, min_size=1, max_size=5)


def batch_of(groups: list[tuple[int, list[int]]], other_prompt: bool = False) -> TrainBatch:
    """Group g: a prompt of `size` tokens (ids 100 + g, ...), then one row per response
    length (ids 200 + row, ...). `other_prompt`: the last row of each group of several
    rows gets a different prompt (its last token changed)."""
    prompts, responses, ids = [], [], []
    for g, (size, lengths) in enumerate(groups):
        for k, n in enumerate(lengths):
            prompt = [100 + g + i for i in range(size)]
            if other_prompt and len(lengths) > 1 and k == len(lengths) - 1:
                prompt[-1] = 99
            prompts.append(prompt)
            responses.append([200 + len(responses) + t for t in range(n)])
            ids.append(g)
    rows = len(prompts)
    return make_batch(prompts, responses, 0, [0.0] * rows, [[0.0] * len(r) for r in responses],
                      [[0] * len(r) for r in responses], groups=ids)


def naive_segments(batch: TrainBatch) -> list[list[int]]:
    out: list[list[int]] = []
    for b in range(batch.size):
        p = int(batch.response_start[b])
        key = (int(batch.groups[b]), batch.input_ids[b, :p].tolist())
        for seg in out:
            q = int(batch.response_start[seg[0]])
            if (int(batch.groups[seg[0]]), batch.input_ids[seg[0], :q].tolist()) == key:
                seg.append(b)
                break
        else:
            out.append([b])
    return out


def naive_tokens(batch: TrainBatch, shared: bool, budget: int | None) -> tuple[int, int]:
    """Walk segments; a part closes when the next response would pass the budget."""
    sample = int(batch.attention_mask.sum())
    if not shared:
        return sample, sample
    computed = 0
    for seg in naive_segments(batch):
        p = int(batch.response_start[seg[0]])
        if len(seg) == 1:
            computed += int(batch.attention_mask[seg[0]].sum())
            continue
        load = p
        for k, b in enumerate(seg):
            r = int(batch.attention_mask[b].sum()) - p
            if k and budget is not None and load + r > budget:
                computed += load
                load = p
            load += r
        computed += load
    return computed, sample


@settings(max_examples=60, deadline=None)
@given(batch_st, st.booleans(), st.sampled_from([None, 1, 6, 12, 64]))
def test_trainer_tokens_match_a_naive_count(groups, other_prompt, budget):
    batch = batch_of(groups, other_prompt)
    assert prefix_groups(batch) == naive_segments(batch)
    for shared in (False, True):
        assert trainer_tokens(batch, shared, budget) == naive_tokens(batch, shared, budget)


@settings(max_examples=60, deadline=None)
@given(batch_st, st.sampled_from([1, 6, 12, 64]), st.integers(1, 3))
def test_units_stay_whole_and_cover_every_row_once(groups, budget, world):
    batch = batch_of(groups)
    segments = prefix_groups(batch)
    prompts = batch.response_start.tolist()
    responses = (batch.attention_mask.sum(-1) - batch.response_start).tolist()
    units, tokens = shared_units(segments, prompts, responses, budget)
    assert sorted(r for u in units for r in u) == list(range(batch.size))
    for unit, n in zip(units, tokens):
        seg = next(s for s in segments if unit[0] in s)
        assert set(unit) <= set(seg) and n == prompts[unit[0]] + sum(responses[r] for r in unit)
        assert n <= budget or len(unit) == 1  # only a lone row may pass the budget
    plans = [unit_micro_batches(units, tokens, world, r, budget) for r in range(world)]
    assert len({len(p) for p in plans}) == 1  # every rank runs as many micro-batches
    placed = [r for plan in plans for mb in plan for r in mb]
    assert sorted(placed) == list(range(batch.size))
    for plan in plans:
        for mb in plan:
            assert mb == sorted(mb)
            for unit in units:  # a unit is in one micro-batch, whole
                assert not set(unit) & set(mb) or set(unit) <= set(mb)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=0, max_size=12), st.integers(1, 64), st.integers(1, 3))
def test_one_row_units_plan_as_unshared_packing(lengths, budget, world):
    units = [[r] for r in range(len(lengths))]
    for rank in range(world):
        assert unit_micro_batches(units, lengths, world, rank, budget) == packed_micro_batches(
            lengths, world, rank, budget)


def naive_visible(segment: list[int], part: list[int]) -> torch.Tensor:
    n = len(segment)
    out = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(i + 1):
            out[i, j] = segment[i] == segment[j] and (part[j] == 0 or part[j] == part[i])
    return out


@settings(max_examples=40, deadline=None)
@given(batch_st)
def test_shared_pack_layout_matches_a_naive_walk(groups):
    """The packed row token by token: ids, positions (continuing after the prompt), the
    position that predicts each response token, the mask, the segment boundaries."""
    batch = batch_of(groups)
    packed = pack(batch, share=True)
    if all(len(s) == 1 for s in naive_segments(batch)):
        assert packed.attention_mask is None
        return
    ids, pos, seg_of, part_of, keep, bounds = [], [], [], [], [], [0]
    predicts: dict[int, list[int]] = {}
    for s, seg in enumerate(naive_segments(batch)):
        p = int(batch.response_start[seg[0]])
        prompt = batch.input_ids[seg[0], :p].tolist()
        shared = len(seg) > 1
        ids += prompt
        pos += list(range(p))
        seg_of += [s] * p
        part_of += [0] * p
        last = len(ids) - 1
        for k, b in enumerate(seg, 1):
            r = int(batch.response_mask[b].sum())
            predicts[b] = [last] + [len(ids) + t for t in range(r - 1)] if r else []
            ids += batch.responses[b, :r].tolist()
            pos += list(range(p, p + r))
            seg_of += [s] * r
            part_of += [k if shared else 0] * r
        bounds.append(len(ids))
    for b in range(batch.size):
        keep += predicts[b]
    assert packed.input_ids[0].tolist() == ids and packed.position_ids[0].tolist() == pos
    assert packed.keep.tolist() == (keep or [0])
    assert packed.targets.tolist() == (batch.responses[batch.response_mask].tolist() or [0])
    assert packed.cu_seq_lens.tolist() == bounds
    assert torch.equal(packed.attention_mask[0, 0], naive_visible(seg_of, part_of))


def test_without_a_shared_group_the_packing_is_unchanged():
    """Group size 1, and groups whose rows' prompts differ: the same tensors as unshared."""
    for batch in (batch_of([(3, [2]), (4, [5]), (2, [0])]), batch_of([(3, [2, 4]), (2, [1, 1])], other_prompt=True)):
        a, b = pack(batch, share=True), pack(batch)
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            assert (x is None and y is None) or (x == y if isinstance(x, bool) else torch.equal(x, y)), f.name


def test_a_group_over_the_budget_splits_into_parts_each_with_the_prompt():
    batch = batch_of([(5, [4, 4, 4, 3])])  # 5 + 15 = 20 tokens shared
    prompts, responses = batch.response_start.tolist(), [4, 4, 4, 3]
    units, tokens = shared_units(prefix_groups(batch), prompts, responses, 13)
    assert units == [[0, 1], [2, 3]] and tokens == [13, 12]
    assert unit_tokens(prefix_groups(batch), prompts, responses, 13) == (25, 35)
    assert unit_tokens(prefix_groups(batch), prompts, responses) == (20, 35)


def test_minibatches_keep_whole_groups_when_they_fit_and_split_rows_otherwise():
    import torch

    from colocate.trainer.batch import group_span, make_batch

    def batch(groups):
        n = len(groups)
        return make_batch([[5, 6]] * n, [[7]] * n, 0, [0.0] * n, [[-1.0]] * n, [[0]] * n, groups)

    assert [group_span(torch.tensor(g)) for g in ([0, 0, 1, 1], [3, 4, 5], [0, 0, 0, 1], [0, 0, 1, 1, 0, 0])] == \
        [2, 1, 1, 1]
    grouped = batch([i // 4 for i in range(16)])
    for seed in range(5):
        parts = grouped.minibatches(2, torch.Generator().manual_seed(seed))
        assert sorted(torch.cat(parts).tolist()) == list(range(16))
        for part in parts:  # each minibatch: whole groups, each group's rows in order
            rows = part.tolist()
            assert all(rows[k:k + 4] == list(range(rows[k], rows[k] + 4)) and rows[k] % 4 == 0
                       for k in range(0, 8, 4))
    # a minibatch of 4 rows cannot hold whole groups of 8: rows are shuffled as before
    assert sorted(torch.cat(batch([i // 8 for i in range(16)]).minibatches(4)).tolist()) == list(range(16))
    ungrouped = batch(list(range(8)))
    want = torch.randperm(8, generator=torch.Generator().manual_seed(1)).chunk(2)
    got = ungrouped.minibatches(2, torch.Generator().manual_seed(1))
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # group size 1: exactly today's split
