"""The data source's plan and select (colocate/rollout/data_source.py) with groups (group_size
n > 1): B/n + Δ groups launched, a group
trained only when every member is finished, in the order groups complete, incomplete
groups deferred whole (finished members wait, only unfinished ones are launched again),
stale groups dropped whole, the state round-trips through JSON, and group size 1 is the
per-sample schedule; a batch that is not a whole number of groups is refused when the
config is loaded. Each is handed an ``overlap`` section of a mode that defers
(:func:`deferring`). A real data source (``colocate.rollout.data_source.DataSource``)
plans and selects as ``Rollouts.rollout`` has it do (:func:`plan`, :func:`run`)."""

import json

import pytest

from colocate.config import OverlapConfig, RolloutConfig, load_config
from colocate.engine.errors import EngineError
from colocate.errors import ConfigError
from colocate.rollout.sample import Sample
from colocate.rollout.data_source import DataSource, TokenizedPrompt
from tests.unit.test_scheduler import Rank, plan

PROMPTS = [TokenizedPrompt((1, 2, i), {}) for i in range(64)]  # stream position g (group g): prompt [1, 2, g]


def deferring(**fields):
    """An ``overlap`` section of a mode that defers (``inter``: Δ is the section's), ``fields`` set."""
    return OverlapConfig(mode="inter", **fields)


def source(n, budget=8):
    """Fresh groups of n samples: group g (indices g·n … g·n + n − 1) shares prompt [1, 2, g]."""
    return DataSource(PROMPTS, RolloutConfig(group_size=n, max_new_tokens=budget, length_dist="fixed"), seed=0)


def finish(sample, tokens, version=0, done=True):
    tokens = min(tokens, sample.remaining)
    sample.output_ids += [7] * tokens
    sample.logprobs += [-0.5] * tokens
    sample.versions += [version] * tokens
    sample.attempts += 1
    sample.finish_reason = "stop" if done else "abort"
    sample.settle()
    sample.score = 1.0 if done else None


def run(sched, data, plan, finished_order, partial=()):
    """Finish the launched samples in ``finished_order`` (indices), abort ``partial`` ones
    after 1 token, leave the rest untouched (never started); ``data.select`` (what is
    deferred goes back to ``data``'s buffer)."""
    by_index = {s.index: s for s in plan.launch}
    for i in finished_order:
        finish(by_index[i], 2)
    for i in partial:
        finish(by_index[i], 1, done=False)
    ended = [by_index[i] for i in finished_order] + [s for s in plan.launch if s.index not in finished_order]
    return data.select(ended)


def test_b_over_n_plus_delta_groups_are_launched_with_shared_prompts():
    sched = Rank(deferring(delta_init=1, delta_max=2), 4, 2)
    p = plan(sched, source(2), 0)
    assert [s.index for s in p.launch] == [0, 1, 2, 3, 4, 5]  # 2 + 1 groups of 2
    assert [s.group for s in p.launch] == [0, 0, 1, 1, 2, 2]
    assert p.launch[0].prompt_ids == p.launch[1].prompt_ids != p.launch[2].prompt_ids


def test_groups_train_whole_in_completion_order_and_incomplete_ones_wait():
    sched = Rank(deferring(delta_init=1, delta_max=2, delta_adaptive=False), 4, 2)
    data = source(2)
    p1 = plan(sched, data, 0)
    # group 2 completes first (4, 5), then group 0 (0, 1); group 1 has 2 finished, 3 partial
    train, defer = run(sched, data, p1, [4, 2, 5, 0, 1], partial=[3])
    assert [s.index for s in train] == [4, 5, 0, 1]
    assert sorted(s.index for s in defer) == [2, 3]
    # next step: group 1's finished member waits, only its partial member is launched again
    p2 = plan(sched, data, 1)
    assert [s.index for s in p2.waiting] == [2]
    assert [s.index for s in p2.launch[:1]] == [3] and p2.resumed == 1
    assert [s.group for s in p2.launch[1:]] == [3, 3, 4, 4]  # two new groups
    train2, _ = run(sched, data, p2, [3, 6, 7], partial=[8])
    assert [s.index for s in train2] == [2, 3, 6, 7]  # group 1 completed by its resumed member
    groups = [s.group for s in train + train2]
    assert all(groups.count(g) == 2 for g in groups)  # never a group split across steps


def test_complete_groups_beyond_b_are_trained_first_next_step():
    sched = Rank(deferring(delta_init=1, delta_max=1, delta_adaptive=False), 2, 2)
    data = source(2)
    p1 = plan(sched, data, 0)
    train, defer = run(sched, data, p1, [0, 1, 2, 3])
    assert [s.index for s in train] == [0, 1] and [s.index for s in defer] == [2, 3]
    p2 = plan(sched, data, 1)
    assert [s.index for s in p2.ready] == [2, 3] and [s.group for s in p2.launch] == [2, 2]
    train2, _ = run(sched, data, p2, [4, 5])
    assert [s.index for s in train2] == [2, 3]  # the ready group; the new one waits


def test_a_group_with_a_too_stale_member_is_dropped_whole():
    sched = Rank(deferring(delta_init=1, delta_max=1, delta_adaptive=False, drop_staleness=1), 2, 2)
    data = source(2)
    p1 = plan(sched, data, 0)
    run(sched, data, p1, [0, 1, 2], partial=[3])  # group 1: member 2 finished at version 0, 3 partial
    p2 = plan(sched, data, 2)  # lag 2 > 1
    assert sorted(s.index for s in p2.dropped) == [2, 3]
    assert not p2.waiting and all(s.index >= 4 for s in p2.launch)


def test_state_round_trips_with_groups_scores_and_records():
    cfg = deferring(delta_init=1, delta_max=1, delta_adaptive=False)
    sched, data = Rank(cfg, 2, 2), source(2)
    p1 = plan(sched, data, 0)
    p1.launch[2].record = {"answer": "4"}
    run(sched, data, p1, [0, 1, 2], partial=[3])
    state = json.loads(json.dumps(sched.delta_ctl.state_dict()))
    data_state = json.loads(json.dumps(data.state_dict()))
    fresh, fresh_data = Rank(cfg, 2, 2), source(2)
    fresh.delta_ctl.load_state_dict(state)
    fresh_data.load_state_dict(data.base, data_state)
    a, b = plan(sched, data, 1), plan(fresh, fresh_data, 1)
    for x, y in ((a.waiting, b.waiting), (a.launch, b.launch)):
        assert [vars(s) for s in x] == [vars(s) for s in y]
    assert b.waiting[0].record == {"answer": "4"} and b.waiting[0].score == 1.0


def test_a_fresh_group_must_keep_the_group():
    class Misnamed(DataSource):
        def groups(self):
            yield [Sample(0, [1], 4, group=0), Sample(1, [1], 4, group=1)]  # member 1 claims group 1

    data = Misnamed(PROMPTS, RolloutConfig(group_size=2, max_new_tokens=4, length_dist="fixed"), seed=0)
    with pytest.raises(EngineError, match="group 0"):
        plan(Rank(deferring(delta_init=0), 2, 2), data, 0)


def test_batch_must_be_a_multiple_of_the_group():
    with pytest.raises(ConfigError, match="group_size"):
        load_config(overrides=["rollout.batch_size=6", "rollout.group_size=4"])


def test_group_size_one_is_the_per_sample_schedule():
    plain = Rank(deferring(delta_init=2, delta_max=2, delta_adaptive=False), 2, 1)
    ones = Rank(deferring(delta_init=2, delta_max=2, delta_adaptive=False), 2, 1)
    sources = {plain: source(1), ones: source(1)}
    for sched, data in sources.items():
        p = plan(sched, data, 0)
        run(sched, data, p, [3, 1], partial=[0])
    assert [vars(s) for s in sources[plain].deferred] == [vars(s) for s in sources[ones].deferred]
    assert [s.index for s in plan(plain, sources[plain], 1).launch] == [0, 2, 4, 5]


def test_group_member_encoding_round_trips():
    from colocate.rollout.sample import group_member, sample_index

    for n in (1, 2, 4):
        for index in range(20):
            group, member = group_member(index, n)
            assert sample_index(index // n, member, n) == index and 0 <= member < n
            assert group == (index // n if n > 1 else None)  # n = 1: each sample is a group of its own
