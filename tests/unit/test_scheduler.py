"""The length-aware schedule of the data source's samples (``DataSource.plan`` and
``select``, colocate/rollout/data_source.py) and the overlap's controllers
(colocate/rollout/controllers.py): Δ adaptation against a hand computation, launch order
and unique indices, budget accounting across deferrals, exactly-B selection, staleness
drops, the chunk-size tuner, and JSON state round-trips. Each is handed an ``overlap``
section as a run's config holds it (:func:`deferring`: a mode that defers); its rules are
refused when the config is loaded. A real data source plans and selects as
``Rollouts.rollout`` has it do (:func:`plan`, ``DataSource.select``, with B/n and the Δ controller
a :class:`Rank` holds, as ``Rollouts`` does)."""

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate.config import OverlapConfig, RolloutConfig, load_config
from colocate.engine.errors import EngineError
from colocate.errors import ConfigError
from colocate.rollout.controllers import ChunkSizeTuner, DeltaController, reward_slope
from colocate.rollout.data_source import DataSource, TokenizedPrompt

PROMPTS = [TokenizedPrompt((1, 2, i), {}) for i in range(256)]  # stream position i: prompt [1, 2, i]


def deferring(**fields):
    """An ``overlap`` section of a mode that defers (``inter``: Δ is the section's), ``fields`` set."""
    return OverlapConfig(mode="inter", **fields)


def source(budget=8):
    """Fresh samples of one prompt each (n = 1) under indices 0, 1, 2, ..., every budget ``budget``."""
    return DataSource(PROMPTS, RolloutConfig(group_size=1, max_new_tokens=budget, length_dist="fixed"), seed=0)


class Rank:
    """What ``Rollouts`` holds for the plan of one engine rank's steps: the ``overlap``
    section, B/n (``batch_size`` B, ``group_size`` n) and the Δ controller."""

    def __init__(self, overlap, batch_size, group_size):
        self.overlap, self.batch_groups = overlap, batch_size // group_size
        self.delta_ctl = DeltaController(overlap)


class OutOfPrompts(DataSource):
    """A data source whose stream ends before index ``limit`` (``groups`` runs out)."""

    def __init__(self, limit, *args, **kw):
        super().__init__(*args, **kw)
        self.limit = limit

    def groups(self):
        return itertools.islice(super().groups(), max(0, self.limit - self.named))


def plan(rank, data, version, defer=True):
    """``data.plan`` of the step, as ``Rollouts.rollout`` calls it (Δ 0 in a step that does not defer)."""
    return data.plan(rank.batch_groups, rank.delta_ctl.delta if defer else 0, version,
                     drop_staleness=rank.overlap.drop_staleness)


def grow(sample, n, version, finish=None):
    """Pretend the engine generated ``n`` tokens (capped by the budget) under ``version``, and
    the step scored the sample if it finished (as ``Schedule.run`` scores what finishes)."""
    n = min(n, sample.remaining)
    sample.output_ids += [7] * n
    sample.logprobs += [-0.5] * n
    sample.versions += [version] * n
    sample.attempts += 1
    sample.finish_reason = finish or ("length" if sample.remaining == 0 else "abort")
    sample.settle()
    sample.score = 0.0 if sample.finished else None


def test_reward_slope_is_least_squares():
    assert reward_slope([1.0]) == 0.0
    assert reward_slope([0.0, 2.0]) == pytest.approx(2.0)
    # x = 0..3, y = 1, 3, 2, 5: x̄ = 1.5, ȳ = 2.75, Σ(x−x̄)(y−ȳ) = 5.5, Σ(x−x̄)² = 5
    assert reward_slope([1.0, 3.0, 2.0, 5.0]) == pytest.approx(1.1)


def test_delta_follows_reward_slope_by_hand_and_respects_bounds():
    cfg = deferring(delta_init=2, delta_min=1, delta_max=4, window=3)
    ctl = DeltaController(cfg, inc=1, dec=2)
    rewards = [0.1, 0.2, 0.4, 0.8, 0.7, 0.5, 0.3, 0.2, 0.9, 1.0]
    # by hand: a least-squares slope over 3 points is (y2 - y0) / 2, over 2 it is y1 - y0;
    # windows and slope signs: +, +, +, +(.15), −, −, −, +(.3), +(.4)
    expected = [2, 3, 4, 4, 4, 2, 1, 1, 2, 3]
    got = [ctl.update(r) for r in rewards]
    assert got == expected
    assert all(cfg.delta_min <= d <= cfg.delta_max for d in got)


def test_delta_fixed_mode_flat_rewards_and_nan():
    fixed = DeltaController(deferring(delta_init=3, delta_adaptive=False))
    assert [fixed.update(r) for r in [0.0, 1.0, 2.0, 3.0]] == [3, 3, 3, 3]
    flat = DeltaController(deferring(delta_init=2, delta_max=4))
    assert [flat.update(1.0) for _ in range(3)] == [2, 1, 0]  # slope 0 counts as "not rising"
    nan = DeltaController(deferring(delta_init=2))
    assert nan.update(float("nan")) == 2 and nan.rewards == []


def test_delta_is_the_sections_when_a_step_defers_else_zero():
    """A default config (sequential) launches exactly B: Δ 0, never moving; a mode that
    defers takes Δ's bounds from the section (what tests/unit/test_one_set_of_defaults.py
    checked of the scheduler's former settings)."""
    sequential = DeltaController(OverlapConfig())
    assert (sequential.delta_init, sequential.delta_min, sequential.delta_max, sequential.adaptive) == (0, 0, 0, False)
    assert [sequential.update(r) for r in [0.0, 1.0, 2.0]] == [0, 0, 0]
    o = OverlapConfig(mode="oppo")
    oppo = DeltaController(o)
    assert (oppo.delta, oppo.delta_min, oppo.delta_max, oppo.adaptive) == (o.delta_init, o.delta_min, o.delta_max, True)
    assert (oppo.inc, oppo.dec) == (1, 1)  # OPPO's δinc, δdec


def test_config_errors_name_the_field():
    """Δ's and the tuner's rules are refused when the config is loaded."""
    with pytest.raises(ConfigError, match="overlap.delta_init"):
        load_config(overrides=["overlap.delta_init=9", "overlap.delta_max=8"])
    with pytest.raises(ConfigError, match="overlap.window"):
        load_config(overrides=["overlap.window=1"])
    with pytest.raises(ConfigError, match="overlap.retune_every"):
        load_config(overrides=["overlap.chunk_candidates=16,32,64", "overlap.retune_every=2"])
    with pytest.raises(ConfigError, match="overlap.chunk_candidates"):
        load_config(overrides=["overlap.chunk_candidates=16,0"])
    with pytest.raises(ConfigError, match="overlap.chunk_size"):  # the fixed chunk: chunk_size or candidates[0]
        load_config(overrides=["overlap.chunk_size=-1"])


def test_plan_puts_deferred_first_fifo_and_indices_stay_unique():
    sched = Rank(deferring(delta_init=2, delta_adaptive=False), 2, 1)
    data = source()
    p1 = plan(sched, data, 0)
    assert [s.index for s in p1.launch] == [0, 1, 2, 3] and p1.resumed == 0
    a, b, c, d = p1.launch
    grow(c, 8, 0, "stop"), grow(a, 3, 0, "stop"), grow(b, 2, 0), grow(d, 1, 0)
    train, defer = data.select([c, a, b, d])
    assert [s.index for s in train] == [2, 0] and [s.index for s in defer] == [1, 3]
    p2 = plan(sched, data, 1)
    assert [s.index for s in p2.launch] == [1, 3, 4, 5] and p2.resumed == 2
    for s in p2.launch:
        grow(s, 1, 1)  # nothing finishes: all deferred again
    assert data.select(p2.launch) == ([], p2.launch)
    p3 = plan(sched, data, 2)
    assert [s.index for s in p3.launch] == [1, 3, 4, 5]  # oldest first, no new ones needed
    seen = [s.index for p in (p1, p2, p3) for s in p.launch]
    assert data.named == 6 and len(set(seen)) == 6


def test_budget_is_kept_across_several_deferrals():
    sched = Rank(deferring(delta_init=1, delta_adaptive=False, drop_staleness=100), 1, 1)
    data = source(budget=10)
    long_one = None
    for version in range(6):
        step = plan(sched, data, version)
        long_one = long_one or step.launch[0]
        for s in step.launch:
            if s is long_one:
                before = s.remaining
                grow(s, 3, version)
                assert s.remaining == before - min(3, before) >= 0
            else:
                grow(s, 1, version, "stop")  # the short one finishes first
        order = sorted(step.launch, key=lambda s: not s.finished)
        train, _ = data.select(order)
        if long_one in train:
            break
    assert long_one.finish_reason == "length" and long_one.remaining == 0
    assert len(long_one.output_ids) == len(long_one.versions) == 10
    assert long_one.versions == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]  # 3+3+3+1: capped at 10


def test_select_trains_exactly_b_and_defers_late_finishers_as_complete():
    sched = Rank(deferring(delta_init=3, delta_adaptive=False), 2, 1)
    data = source()
    p1 = plan(sched, data, 0)
    for s in p1.launch[:4]:
        grow(s, 2, 0, "stop")
    grow(p1.launch[4], 1, 0)
    order = [p1.launch[i] for i in (3, 1, 0, 2, 4)]
    train, defer = data.select(order)
    assert [s.index for s in train] == [3, 1]
    assert [s.index for s in defer] == [0, 2, 4]
    p2 = plan(sched, data, 1)
    assert [s.index for s in p2.ready] == [0, 2]  # complete: trained first, not regenerated
    assert [s.index for s in p2.launch] == [4, 5, 6] and len(p2.ready + p2.launch) == 5
    for s in p2.launch:
        grow(s, 1, 1, "stop")
    train, defer = data.select(p2.launch)
    assert [s.index for s in train] == [0, 2] and [s.index for s in defer] == [4, 5, 6]


def test_select_refuses_missing_samples_and_overrun_budgets():
    sched = Rank(deferring(delta_init=1), 1, 1)
    data = source(budget=2)
    p1 = plan(sched, data, 0)
    with pytest.raises(EngineError, match="every launched sample"):
        data.select(p1.launch[:1])
    p1.launch[0].output_ids += [1, 2, 3]
    with pytest.raises(EngineError, match="overran its budget"):
        data.select(p1.launch)
    with pytest.raises(EngineError, match="before select"):
        plan(sched, data, 0)


def test_stale_partials_are_dropped_and_reported():
    sched = Rank(deferring(delta_init=2, delta_adaptive=False, drop_staleness=2), 1, 1)
    data = source()
    p1 = plan(sched, data, 0)
    grow(p1.launch[0], 1, 0, "stop"), grow(p1.launch[1], 2, 0), grow(p1.launch[2], 0, 0)
    data.select(p1.launch)
    p2 = plan(sched, data, 2)  # lag 2 == S_hard: kept
    assert p2.dropped == [] and p2.resumed == 2
    for s in p2.launch:
        grow(s, 1, 2)
    data.select(p2.launch)
    p3 = plan(sched, data, 3)  # sample 1's oldest token lags 3 > 2
    assert [s.index for s in p3.dropped] == [1] and data.dropped_total == 1
    assert 1 not in [s.index for s in p3.launch] and 2 in [s.index for s in p3.launch]


def test_out_of_prompts_launches_fewer():
    sched = Rank(deferring(delta_init=2), 2, 1)
    data = OutOfPrompts(3, PROMPTS, RolloutConfig(group_size=1, max_new_tokens=8, length_dist="fixed"), seed=0)
    assert [s.index for s in plan(sched, data, 0).launch] == [0, 1, 2]


def test_chunk_tuner_picks_fastest_and_retunes_every_n():
    tuner = ChunkSizeTuner(OverlapConfig(chunk_candidates="16,32,64", retune_every=5))
    costs = [{16: 3.0, 32: 1.0, 64: 2.0}, {16: 0.5, 32: 1.0, 64: 2.0}]
    used = []
    for step in range(10):
        chunk = tuner.chunk_for_step(step)
        used.append(chunk)
        tuner.record(step, chunk, costs[step // 5].get(chunk, 9.0))
    assert used == [16, 32, 64, 32, 32, 16, 32, 64, 16, 16]
    fixed = ChunkSizeTuner(OverlapConfig(chunk_size=48))
    assert {fixed.chunk_for_step(s) for s in range(100)} == {48}
    with pytest.raises(EngineError, match="took"):
        tuner.record(0, 16, float("nan"))


def test_chunk_tuner_incomplete_round_falls_back_to_fixed_and_round_trips():
    cfg = OverlapConfig(chunk_candidates="16,32", retune_every=4)
    tuner = ChunkSizeTuner(cfg)
    tuner.record(0, 16, 1.0)
    tuner.record(2, 16, 0.1)  # not a tuning step: ignored
    assert tuner.chunk_for_step(2) == tuner.fixed == 16  # tuning: the fixed chunk is the first candidate
    fresh = ChunkSizeTuner(cfg)
    fresh.load_state_dict(json.loads(json.dumps(tuner.state_dict())))
    fresh.record(1, 32, 0.5)
    assert fresh.chunk_for_step(3) == 32 and fresh.state_dict()["best"] == 32


def test_scheduler_state_round_trips_through_json():
    cfg = deferring(delta_init=1, delta_max=3, window=3)
    sched, data = Rank(cfg, 1, 1), source()
    p1 = plan(sched, data, 0)
    grow(p1.launch[0], 2, 0, "stop"), grow(p1.launch[1], 3, 0)
    data.select(p1.launch)
    sched.delta_ctl.update(0.1), sched.delta_ctl.update(0.3)
    state = json.loads(json.dumps(sched.delta_ctl.state_dict()))
    data_state = json.loads(json.dumps(data.state_dict()))
    fresh, fresh_data = Rank(cfg, 1, 1), source()
    fresh.delta_ctl.load_state_dict(state)
    fresh_data.load_state_dict(data.base, data_state)
    assert fresh.delta_ctl.state_dict() == sched.delta_ctl.state_dict() and fresh.delta_ctl.delta == 2
    assert fresh_data.state_dict() == data.state_dict()
    assert fresh_data.deferred == data.deferred and fresh_data.deferred[0].output_ids == [7, 7, 7]
    a, b = plan(sched, data, 1), plan(fresh, fresh_data, 1)
    assert [s.index for s in a.launch] == [s.index for s in b.launch] == [1, 2, 3]
    with pytest.raises(EngineError, match="between steps"):
        data.state_dict()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(0, 3), st.lists(st.lists(st.integers(0, 6), min_size=6,
                                                              max_size=6), min_size=1, max_size=6))
def test_invariants_over_random_steps(batch, delta, steps):
    """Budgets are never exceeded, indices are unique, nothing is lost, and exactly B are
    trained whenever B finished."""
    sched = Rank(deferring(delta_init=delta, delta_max=3, delta_adaptive=False, drop_staleness=100),
                                 batch, 1)
    data = source(budget=5)
    trained = []
    for version, grows in enumerate(steps):
        step = plan(sched, data, version)
        assert len(step.launch) + len(step.ready) == batch + delta
        for s, n in zip(step.launch, grows):
            grow(s, n, version, "stop" if n % 3 == 0 else None)
        ended = sorted(step.launch, key=lambda s: not s.finished)
        train, defer = data.select(ended)
        done = len(step.ready) + sum(s.finished for s in ended)
        assert len(train) == min(batch, done) and all(s.finished for s in train)
        trained += train
        for s in step.launch:
            assert 0 <= s.remaining and len(s.output_ids) == len(s.versions) <= 5
    ids = [s.index for s in trained] + [s.index for s in data.deferred]
    assert sorted(ids) == list(range(data.named))  # each sample trained or held, once
