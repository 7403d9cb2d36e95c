"""trainer/packing.py, trainer/packed.py and trainer/rollout_logp.py against naive loops.

The references walk rows and tokens one at a time in plain Python and never call the
code under test. Random cases come from hypothesis.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate.trainer.batch import make_batch
from colocate.trainer.packed import idle_batch, pack, unpack
from colocate.trainer.packing import (
    balance_ranks, first_fit_decreasing, packed_micro_batches, row_micro_batches,
)
from colocate.trainer.rollout_logp import (
    drift_stats, drift_terms, on_policy_mask, rollout_old_logp, stale_rows,
)

lengths_st = st.lists(st.integers(1, 40), min_size=0, max_size=12)


def naive_ffd(lengths, budget):
    """First-fit decreasing, one row and one bin at a time."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins = []
    for row in order:
        for b in bins:
            if sum(lengths[r] for r in b) + lengths[row] <= budget:
                b.append(row)
                break
        else:
            bins.append([row])
    return [sorted(b) for b in bins]


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 60))
def test_first_fit_decreasing_matches_naive(lengths, budget):
    bins = first_fit_decreasing(lengths, budget)
    assert bins == naive_ffd(lengths, budget)
    assert sorted(itertools.chain(*bins)) == list(range(len(lengths)))  # every row once
    for b in bins:  # within budget, unless a single row is longer than it
        assert sum(lengths[r] for r in b) <= budget or len(b) == 1


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 4))
def test_balance_ranks_partitions_and_balances(lengths, world):
    shares = balance_ranks(lengths, world)
    assert len(shares) == world
    assert sorted(itertools.chain(*shares)) == list(range(len(lengths)))
    loads = [sum(lengths[r] for r in s) for s in shares]
    # LPT bound: the busiest rank exceeds the lightest by at most the longest row
    assert max(loads) - min(loads) <= max(lengths, default=0)


def test_balance_ranks_beats_contiguous_split_on_a_long_tail():
    lengths = [300, 10, 12, 9, 11, 250, 8, 10]
    loads = [sum(lengths[r] for r in s) for s in balance_ranks(lengths, 2)]
    assert sorted(loads) == [302, 308]  # a contiguous split gives 331 vs 279


@settings(max_examples=200, deadline=None)
@given(lengths_st.filter(bool), st.integers(1, 4), st.integers(1, 60))
def test_packed_micro_batches_same_count_on_every_rank(lengths, world, budget):
    plans = [packed_micro_batches(lengths, world, rank, budget) for rank in range(world)]
    assert len({len(p) for p in plans}) == 1 and len(plans[0]) >= 1
    rows = sorted(r for p in plans for mb in p for r in mb)
    assert rows == list(range(len(lengths)))
    for plan in plans:  # real micro-batches first, then idle ones
        sizes = [len(mb) for mb in plan]
        assert sizes == sorted(sizes, key=lambda n: n == 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20), st.integers(1, 4), st.integers(1, 5))
def test_row_micro_batches_matches_naive(rows, world, micro):
    plans = [row_micro_batches(rows, world, rank, micro) for rank in range(world)]
    share = -(-rows // world)
    for rank, plan in enumerate(plans):
        mine = [r for r in range(rows) if r // share == rank]
        assert [r for mb in plan for r in mb] == mine
        assert all(len(mb) <= micro for mb in plan)
    assert len({len(p) for p in plans}) == 1


def test_row_micro_batches_is_the_old_contiguous_split():
    assert row_micro_batches(8, 2, 1, 3) == [[4, 5, 6], [7]]
    assert row_micro_batches(8, 1, 0, 8) == [list(range(8))]


# ---------------------------------------------------------------- packed rows


@st.composite
def rollouts(draw):
    rows = draw(st.integers(1, 5))
    prompts = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=6)) for _ in range(rows)]
    responses = [draw(st.lists(st.integers(1, 50), min_size=0, max_size=5)) for _ in range(rows)]
    return prompts, responses


def build(prompts, responses, versions=None):
    versions = versions or [[0] * len(r) for r in responses]
    behaviour = [[-0.1 * (t + 1) - b for t in range(len(r))] for b, r in enumerate(responses)]
    return make_batch(prompts, responses, 0, [0.0] * len(prompts), behaviour, versions)


@settings(max_examples=200, deadline=None)
@given(rollouts())
def test_pack_matches_naive_concatenation(case):
    prompts, responses = case
    packed = pack(build(prompts, responses))
    ids, positions, keep, targets = [], [], [], []
    for prompt, response in zip(prompts, responses):
        start = len(ids)
        row = [*prompt, *response]
        ids += row
        positions += list(range(len(row)))
        for t, token in enumerate(response):  # logit at P - 1 + t predicts response token t
            keep.append(start + len(prompt) - 1 + t)
            targets.append(token)
    assert packed.input_ids.tolist() == [ids] and packed.position_ids.tolist() == [positions]
    assert packed.tokens == len(ids)
    assert packed.keep.tolist() == (keep or [0]) and packed.targets.tolist() == (targets or [0])
    for t, token in zip(keep, targets):
        assert ids[t + 1] == token  # the kept position is the one before its token


@settings(max_examples=100, deadline=None)
@given(rollouts())
def test_unpack_puts_each_result_at_its_token(case):
    prompts, responses = case
    batch = build(prompts, responses)
    packed = pack(batch)
    flat = torch.arange(1, packed.keep.numel() + 1, dtype=torch.float32)
    out = unpack(flat, packed)
    assert out.shape == batch.responses.shape
    k = 0
    for b, response in enumerate(responses):
        for t in range(out.shape[1]):
            if t < len(response):
                k += 1
                assert out[b, t] == k
            else:
                assert out[b, t] == 0


def test_idle_batch_is_one_token_without_response():
    batch = build([[5, 6, 7], [8]], [[1, 2], [3]])
    idle = idle_batch(batch)
    assert idle.size == 1 and idle.input_ids.tolist() == [[5]] and not idle.response_mask.any()
    packed = pack(idle)
    assert packed.tokens == 1 and packed.keep.tolist() == [0]
    assert torch.equal(unpack(torch.ones(1), packed), torch.zeros(1, 2))


# ---------------------------------------------------------------- old log-probs from the rollout


def test_rollout_old_logp_and_stale_rows_match_naive():
    responses = [[1, 2, 3], [4, 5], [6]]
    versions = [[3, 3, 3], [2, 3], [3]]
    batch = build([[9]] * 3, responses, versions)
    mask = batch.response_mask
    stale = stale_rows(batch.versions, mask, 3)
    assert stale.tolist() == [False, True, False]
    on = on_policy_mask(batch.versions, mask, 3)
    recomputed = torch.full_like(batch.behaviour_logp, -7.0)
    old = rollout_old_logp(batch.behaviour_logp, recomputed, stale, mask)
    for b, row in enumerate(versions):
        for t in range(old.shape[1]):
            if t >= len(row):
                assert old[b, t] == 0 and not on[b, t]
                continue
            assert on[b, t] == (row[t] == 3)
            expected = -7.0 if any(v != 3 for v in row) else float(batch.behaviour_logp[b, t])
            assert float(old[b, t]) == expected


def test_drift_terms_and_stats():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -3.0, 0.0]])
    behaviour = torch.tensor([[-1.1, -2.0, 0.0], [-0.5, -2.0, 0.0]])
    on = torch.tensor([[True, True, False], [True, False, False]])
    terms = drift_terms(logp, behaviour, on)
    torch.testing.assert_close(terms, torch.tensor([0.1, 3.0, 0.1]))  # the 1.0 gap is off-policy
    stats = drift_stats(terms[:2], terms[2])
    assert abs(stats["logp_drift_mean"] - 0.1 / 3) < 1e-7 and abs(stats["logp_drift_max"] - 0.1) < 1e-7
    assert drift_stats(torch.zeros(2), torch.zeros(())) == {}
