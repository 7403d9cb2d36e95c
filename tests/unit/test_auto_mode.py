"""overlap.mode=auto's picker (colocate/rollout/auto_mode.py): plain Python, driven by hand."""

from __future__ import annotations

import dataclasses

import pytest

from colocate.rollout.auto_mode import AutoPolicy, ModePicker
from colocate.config import Config, ConfigError, load_config, validate
from colocate.rollout.rollouts import auto_policy


def run(picker: ModePicker, cost: dict[str, float], steps: int, trained: int = 4) -> list[str]:
    """``steps`` steps where mode m's rollout costs ``cost[m]`` s per trained sample."""
    ran = []
    for _ in range(steps):
        mode, measured = picker.choose()
        ran.append(mode)
        picker.record(mode, cost[mode] * trained, trained, measured)
    return ran


COST = {"sequential": 1.0, "intra": 1.2, "inter": 0.7, "oppo": 0.9}


def test_warm_up_then_each_candidate_trials_steps_then_the_cheapest():
    picker = ModePicker(AutoPolicy(trials=2, explore_every=100))
    ran = run(picker, COST, 15)
    assert ran[:9] == ["sequential"] * 3 + ["intra"] * 2 + ["inter"] * 2 + ["oppo"] * 2
    assert ran[9:] == ["inter"] * 6
    assert picker.cost("inter") == pytest.approx(0.7)


def test_the_warm_up_step_is_not_measured():
    picker = ModePicker(AutoPolicy(candidates=("sequential", "inter"), trials=1, explore_every=100))
    mode, measured = picker.choose()
    assert (mode, measured) == ("sequential", False)
    picker.record(mode, 100.0, 4, measured)  # a cold engine's step: ignored
    assert picker.cost("sequential") is None
    run(picker, COST, 2)
    assert picker.cost("sequential") == pytest.approx(1.0)


def test_an_overlap_must_beat_sequential_by_the_margin():
    near = {"sequential": 1.0, "intra": 0.98, "inter": 1.5, "oppo": 1.1}  # intra 2 % cheaper
    picker = ModePicker(AutoPolicy(trials=1, explore_every=100, margin=0.03))
    assert run(picker, near, 10)[5:] == ["sequential"] * 5
    picker = ModePicker(AutoPolicy(trials=1, explore_every=100, margin=0.01))
    assert run(picker, near, 10)[5:] == ["intra"] * 5


def test_re_exploration_sees_a_change_and_runs_the_incumbent_last():
    picker = ModePicker(AutoPolicy(trials=1, explore_every=3, window=1))
    ran = run(picker, COST, 8)  # warm-up, 4 trials, 3 steps of inter
    assert ran[5:] == ["inter"] * 3
    later = {**COST, "inter": 1.5}  # responses grew: deferral costs more now
    ran = run(picker, later, 4)
    assert ran == ["sequential", "intra", "oppo", "inter"]  # one step each, the incumbent last
    assert run(picker, later, 2) == ["oppo", "oppo"]


def test_median_of_the_window_ignores_one_noisy_step():
    picker = ModePicker(AutoPolicy(candidates=("sequential", "inter"), trials=3, explore_every=100, window=3))
    picker.record(*picker.choose()[:1], 4.0, 4, False)
    for cost in (1.0, 1.0, 1.0):
        picker.record("sequential", cost * 4, 4, picker.choose()[1])
    for cost in (0.8, 3.0, 0.8):  # one step hit by noise
        picker.record("inter", cost * 4, 4, picker.choose()[1])
    assert picker.best() == "inter"


def test_state_round_trip_and_a_cold_first_step_after_resume():
    picker = ModePicker(AutoPolicy(trials=1, explore_every=100))
    run(picker, COST, 3)  # warm-up, sequential, intra; inter and oppo still queued
    state = picker.state_dict()
    resumed = ModePicker(AutoPolicy(trials=1, explore_every=100))
    resumed.load_state_dict(state)
    assert resumed.costs == picker.costs
    mode, measured = resumed.choose()
    assert (mode, measured) == ("sequential", False)  # the cheapest so far, warming the engines
    resumed.record(mode, 99.0, 4, measured)
    assert run(resumed, COST, 2) == ["inter", "oppo"]


def test_resume_with_fewer_candidates_drops_the_others():
    picker = ModePicker(AutoPolicy(trials=1, explore_every=100))
    run(picker, COST, 4)
    fewer = ModePicker(AutoPolicy(candidates=("sequential", "inter"), trials=1, explore_every=100))
    fewer.load_state_dict(picker.state_dict())
    assert set(fewer.costs) == {"sequential", "inter"}
    assert all(m in ("sequential", "inter") for m in fewer.queue)


def test_config_auto_may_stream_and_defer_and_is_validated():
    cfg = load_config(overrides=["overlap.mode=auto"])
    assert cfg.overlap.modes == ("sequential", "intra", "inter", "oppo")
    assert cfg.overlap.streamed and cfg.overlap.deferral
    only = load_config(overrides=["overlap.mode=auto", "overlap.auto_modes=sequential,inter"])
    assert not only.overlap.streamed and only.overlap.deferral
    with pytest.raises(ConfigError, match="overlap.auto_modes"):
        load_config(overrides=["overlap.mode=auto", "overlap.auto_modes=sequential,fast"])
    rule = Config()
    rule = dataclasses.replace(rule, reward=dataclasses.replace(rule.reward, kind="rule", rule="gsm_symbolic"),
                               overlap=dataclasses.replace(rule.overlap, mode="auto"))
    with pytest.raises(ConfigError, match="overlap.auto_modes=sequential,inter"):
        validate(rule)


def test_auto_policy_leaves_out_streaming_without_a_reward_model():
    cfg = load_config(overrides=["overlap.mode=auto", "overlap.auto_trials=3", "overlap.auto_margin=0.1"])
    assert auto_policy(cfg.overlap).candidates == ("sequential", "intra", "inter", "oppo")
    policy = auto_policy(cfg.overlap, streams=False)
    assert policy.candidates == ("sequential", "inter") and policy.trials == 3 and policy.margin == 0.1


def test_auto_engines_get_every_core_like_sequential():
    from colocate.run import builder

    for mode, want in (("sequential", (2, 2)), ("inter", (1, 1)), ("auto", (2, 2)), ("oppo", (1, 1))):
        assert builder.engine_threads(load_config(overrides=[f"overlap.mode={mode}"]), 2) == want


def test_a_clear_loss_skips_the_remaining_trials_and_backs_off():
    dear = {"sequential": 1.0, "intra": 2.0, "inter": 1.1, "oppo": 0.9}  # intra: a clear loss (> 1.25x)
    picker = ModePicker(AutoPolicy(trials=2, explore_every=2))
    ran = run(picker, dear, 10)
    assert ran[:8] == ["sequential"] * 3 + ["intra"] + ["inter"] * 2 + ["oppo"] * 2  # intra's 2nd trial skipped
    assert ran[8:] == ["oppo"] * 2
    assert picker.losses == {"sequential": 0, "intra": 1, "inter": 0, "oppo": 0}
    explored = explored_rounds(picker, dear, 8)  # intra loses each time: rounds 2, 4, then 8
    assert explored == [False, True, False, True, False, False, False, True]
    assert picker.losses["intra"] == 3  # round 8 has begun; its intra step is still queued
    recovered = {**dear, "intra": 0.5}
    assert explored_rounds(picker, recovered, 16)[-1]  # still explored, every 16th round at most
    assert picker.losses["intra"] == 0 and picker.best() == "intra"


def explored_rounds(picker: ModePicker, cost: dict[str, float], rounds: int) -> list[bool]:
    """Whether intra is in each of the next ``rounds`` re-explorations."""
    out = []
    while len(out) < rounds:
        before = picker.rounds
        mode, measured = picker.choose()
        if picker.rounds != before:
            out.append("intra" in picker.queue)
        picker.record(mode, cost[mode] * 4, 4, measured)
    return out
