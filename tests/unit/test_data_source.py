"""DataSource: a group's members share one prompt, each with its own budget; two engine
ranks' streams interleave into exactly one rank's stream; the position (and the deferred
buffer) round-trips; a resume on another number of engine ranks deals every rank's
deferred groups anew (``redistribute``)."""

from __future__ import annotations

import itertools

from colocate.config import OverlapConfig, RolloutConfig
from colocate.rollout.sample import Sample, Status
from colocate.rollout.controllers import DeltaController
from colocate.rollout import data_source
from colocate.rollout.data_source import DataSource, TokenizedPrompt, response_budget

PROMPTS = [TokenizedPrompt((i, i + 1), {"id": i}) for i in range(5)]
LONG_TAIL = RolloutConfig(group_size=2, max_new_tokens=64, length_dist="lognormal", length_median=8)


def _draw(stream: DataSource, groups: int) -> list[tuple[int, int, int]]:
    """(prompt id, group, budget) of ``groups`` groups drawn in index order."""
    return [(s.record["id"], s.group, s.max_new_tokens)
            for members in itertools.islice(stream.groups(), groups) for s in members]


def test_members_share_the_prompt_with_budgets_of_their_own_and_the_cycle_wraps():
    stream = DataSource(PROMPTS, LONG_TAIL, seed=3)
    drawn = _draw(stream, 7)
    assert [p for p, _, _ in drawn] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0, 0, 1, 1]  # wraps after 5
    assert [g for _, g, _ in drawn] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert [b for _, _, b in drawn] == [response_budget(LONG_TAIL, 3, k) for k in range(14)]
    assert stream.drawn == 7


def test_two_engine_ranks_draw_one_ranks_stream_between_them():
    one = _draw(DataSource(PROMPTS, LONG_TAIL, seed=3), 6)
    ranks = [DataSource(PROMPTS, LONG_TAIL, 3, rank=r, ranks=2) for r in (0, 1)]
    shares = [_draw(s, 3) for s in ranks]
    union = [shares[k % 2][(k // 2) * 2 + m] for k in range(6) for m in range(2)]  # group k: rank k % 2
    assert [(p, b) for p, _, b in union] == [(p, b) for p, _, b in one]


def test_two_engine_ranks_name_their_samples_in_the_union_when_they_draw_them():
    """The names are the union's from birth: rank r's g-th group is group 2g + r, the two
    ranks' samples sorted by index are one rank's stream, name for name."""
    def named(stream, groups):
        return [(s.index, s.group, s.record["id"], s.max_new_tokens)
                for members in itertools.islice(stream.groups(), groups) for s in members]

    one = named(DataSource(PROMPTS, LONG_TAIL, seed=3), 6)
    shares = [named(DataSource(PROMPTS, LONG_TAIL, 3, rank=r, ranks=2), 3) for r in (0, 1)]
    assert [g for _, g, _, _ in shares[1]] == [1, 1, 3, 3, 5, 5]
    assert sorted(shares[0] + shares[1]) == one
    singles = [DataSource(PROMPTS, RolloutConfig(group_size=1, max_new_tokens=4), 0, rank=r, ranks=3) for r in range(3)]
    assert [[s.index for g in itertools.islice(d.groups(), 2) for s in g] for d in singles] == [[0, 3], [1, 4], [2, 5]]
    assert all(s.group is None for d in singles for g in itertools.islice(d.groups(), 1) for s in g)


def test_position_round_trips_and_continues_where_it_stopped():
    stream = DataSource(PROMPTS, LONG_TAIL, seed=3)
    _draw(stream, 3)
    state = stream.state_dict()
    assert stream.base == 0 and state == {"data_pos": 3, "named": 6, "dropped_total": 0, "deferred": []}
    again = DataSource(PROMPTS, LONG_TAIL, seed=3)
    again.load_state_dict(stream.base, state)
    a, b = next(again.groups()), next(stream.groups())
    assert [s.index for s in a] == [s.index for s in b] == [6, 7]
    assert a[0].record == b[0].record == {"id": 3}


def test_the_deferred_buffer_round_trips_oldest_first():
    stream = DataSource(PROMPTS, LONG_TAIL, seed=3)
    first, second, stale = itertools.islice(stream.groups(), 3)
    second[0].output_ids, second[0].finish_reason, second[0].score = [7], "stop", 0.5
    second[0].settle()
    stream.defer([*second, *stale])
    stream.defer(first)
    stream.take([], dropped=stale)  # a step dropped the stale group: counted, gone from the buffer
    state = stream.state_dict()
    assert [d["index"] for d in state["deferred"]] == [0, 1, 2, 3] and state["dropped_total"] == 2
    again = DataSource(PROMPTS, LONG_TAIL, seed=3)
    again.load_state_dict(4, state)
    assert again.base == 4 and again.deferred == stream.deferred and again.deferred[2].score == 0.5
    assert again.deferred == first + second
    again.take(first)  # a step took the oldest group: the younger one stays, in place
    assert again.deferred == second


# ---- a resume on another number of engine ranks ------------------------------------------------
def _sample(index: int, n: int = 1) -> Sample:
    return Sample(index, [1, 2], 4, output_ids=[7, 7], logprobs=[-0.5, -0.5], versions=[0, 0],
                  finish_reason="stop", status=Status.FINISHED, group=index // n if n > 1 else None, score=float(index))


def _data_state(deferred, named, data_pos, dropped=0):
    """A saved rank state (``DataSource.state_dict``)."""
    return {"data_pos": data_pos, "named": named, "dropped_total": dropped,
            "deferred": [s.state() for s in deferred]}


def test_same_number_of_ranks_keeps_every_ranks_state():
    states = [_data_state([], 0, 3), _data_state([], 0, 3)]
    assert data_source.redistribute(5, states, 2, 1) == (5, states, None)


def test_fewer_ranks_get_every_deferred_group_under_fresh_indices():
    n = 2
    # rank 0's local group 4 is the union's group 8; rank 1's local groups 3 and 5 are 7 and 11
    zero = _data_state([_sample(16, n), _sample(17, n)], named=12, data_pos=6, dropped=1)
    one = _data_state([_sample(14, n), _sample(15, n), _sample(22, n), _sample(23, n)], named=12, data_pos=5,
                      dropped=2)
    base, [state], note = data_source.redistribute(100, [zero, one], 1, n)
    assert base == 100 + 6 * 2  # the first position neither old stream reached
    assert note == ("2 engine ranks -> 1: 6 deferred samples (3 groups) dealt round-robin over the 1 ranks; "
                    "prompts continue from position 112")
    assert state["data_pos"] == 0 and state["named"] == 6 and state["dropped_total"] == 3
    # oldest first (the union's names are the age): rank 1's group 7, rank 0's group 8, rank 1's group 11
    assert [(d["index"], d["group"], d["score"]) for d in state["deferred"]] == [
        (0, 0, 14.0), (1, 0, 15.0), (2, 1, 16.0), (3, 1, 17.0), (4, 2, 22.0), (5, 2, 23.0)]
    # a real data source takes it and (with the first rank's Δ 2, as the session hands it
    # every rank) plans the carried groups before new ones
    data = DataSource(PROMPTS, RolloutConfig(group_size=n, max_new_tokens=4), seed=0)
    data.load_state_dict(base, state)
    overlap = OverlapConfig(mode="inter", delta_init=1, delta_max=2)
    delta = DeltaController(overlap)
    delta.load_state_dict({"delta": 2, "rewards": [0.1, 0.2]})
    plan = data.plan(4 // n, delta.delta, 0, drop_staleness=overlap.drop_staleness)
    assert [s.group_id for s in plan.ready] == [0, 0, 1, 1, 2, 2]
    # pool 2 + Δ 2 = 4 groups: the 3 carried, then one new group under the next fresh indices
    assert [(s.index, s.group) for s in plan.launch] == [(6, 3), (7, 3)]
    assert plan.launch[0].prompt_ids == list(PROMPTS[112 % len(PROMPTS)].ids)  # from the new base on


def test_more_ranks_share_the_deferred_samples_round_robin():
    one = _data_state([_sample(i) for i in (4, 5, 6)], named=7, data_pos=7)
    base, states, note = data_source.redistribute(0, [one], 2, 1)
    assert base == 7 and "1 engine ranks -> 2: 3 deferred samples (3 groups)" in note
    got = [[(d["index"], d["group"], d["score"]) for d in s["deferred"]] for s in states]
    # named in the new union: rank 0's two are its groups 0 and 1 (the union's 0 and 2), rank 1's the union's 1
    assert got == [[(0, None, 4.0), (2, None, 6.0)], [(1, None, 5.0)]]
    assert [s["named"] for s in states] == [2, 1]
    # and each new rank draws on after them, in the new union: rank 0's next is 4, rank 1's 3
    fresh = [DataSource(PROMPTS, RolloutConfig(group_size=1, max_new_tokens=4), 0, rank=r, ranks=2) for r in (0, 1)]
    for d, state in zip(fresh, states):
        d.load_state_dict(base, state)
    assert [next(d.groups())[0].index for d in fresh] == [4, 3]
