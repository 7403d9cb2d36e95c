"""Time to reward (`colocate bench --convergence`): the curve of held-out reward against
training seconds, the time to the sequential run's final reward, the report section; over
several seeds (``--seeds``) the runs per seed, the median and range against a hand count, and
the evaluations below the base beyond the seeds' spread."""

from __future__ import annotations

import dataclasses
import math

import pytest

from colocate.bench.convergence import (ConvergenceOptions, curve, markdown, markdown_seeds, summarize, summarize_seeds,
                                        time_to_reward)


def _metrics(step_s: list[float]) -> list[dict]:
    return [{"step": i + 1, "step_s": s} for i, s in enumerate(step_s)]


def test_curve_puts_each_evaluation_at_the_training_seconds_of_its_step():
    metrics = _metrics([2.0, 3.0, 4.0, 5.0])
    evals = [{"step": 0, "reward_mean": 0.1}, {"step": 2, "reward_mean": 0.3},
             {"step": 4, "reward_mean": float("nan")}, {"step": 4, "reward_mean": 0.5}]
    points = curve(metrics, evals)
    assert [(p["step"], p["seconds"], p["reward"]) for p in points] == [(0, 0.0, 0.1), (2, 5.0, 0.3), (4, 14.0, 0.5)]
    assert curve([{"step": 1, "skipped": "nan"}], [{"step": 1, "reward_mean": 0.2}]) == []  # no time for it


def test_time_to_reward_is_the_first_evaluation_at_or_above_the_target():
    points = [{"seconds": 0.0, "reward": 0.1}, {"seconds": 5.0, "reward": 0.4},
              {"seconds": 9.0, "reward": 0.3}, {"seconds": 14.0, "reward": 0.6}]
    assert time_to_reward(points, 0.4) == 5.0
    assert time_to_reward(points, 0.5) == 14.0
    assert time_to_reward(points, 0.05) == 0.0
    assert time_to_reward(points, 0.7) is None


def test_summary_targets_sequentials_final_reward_and_gives_speedups():
    curves = {"sequential": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 3, "seconds": 30.0, "reward": 0.5},
                             {"step": 6, "seconds": 60.0, "reward": 0.4}],
              "oppo": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 3, "seconds": 20.0, "reward": 0.45},
                       {"step": 6, "seconds": 40.0, "reward": 0.6}],
              "inter": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 6, "seconds": 50.0, "reward": 0.1}]}
    s = summarize(curves, {"oppo": 2})
    assert s["target"] == 0.4 and s["base"] == "sequential"
    seq, oppo, inter = (s["modes"][m] for m in ("sequential", "oppo", "inter"))
    assert seq["time_to_target_s"] == 30.0 and seq["speedup_vs_base"] == pytest.approx(1.0)
    assert oppo["time_to_target_s"] == 20.0 and oppo["speedup_vs_base"] == pytest.approx(1.5)
    assert oppo["final_reward"] == 0.6 and oppo["train_seconds"] == 40.0 and oppo["steps"] == 6
    assert oppo["contended_steps"] == 2 and seq["contended_steps"] == 0
    assert inter["time_to_target_s"] is None and inter["speedup_vs_base"] is None
    assert math.isnan(summarize({"oppo": curves["oppo"]})["target"])  # no sequential run: no target


def test_markdown_names_the_target_and_says_not_reached():
    curves = {"sequential": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 30, "seconds": 300.0, "reward": 0.5}],
              "oppo": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 30, "seconds": 200.0, "reward": 0.2}]}
    text = markdown(summarize(curves), "convergence.png")
    assert "final held-out reward, +0.500" in text
    assert "| sequential | 30 | +0.500 | 300.0 | 300.0 | 1.00x | 0 |" in text
    assert "| oppo | 30 | +0.200 | 200.0 | not reached | – | 0 |" in text
    assert "![convergence](convergence.png)" in text


def test_defaults_run_at_least_30_steps_of_sequential_and_oppo():
    opts = ConvergenceOptions()
    assert opts.steps >= 30 and opts.modes == ("sequential", "oppo") and 1 <= opts.eval_every < opts.steps


def test_variants_run_sequential_unless_they_set_a_mode(tmp_path):
    from colocate.bench.convergence import configs

    conv = ConvergenceOptions(steps=4, eval_every=2, variants=(
        ("grpo", ("ppo.advantage=grpo", "rollout.group_size=4")), ("rloo-oppo", ("ppo.advantage=rloo",
                                                                                  "rollout.group_size=2",
                                                                                  "overlap.mode=oppo"))))
    cfgs = configs(conv, [], tmp_path)
    assert list(cfgs) == ["sequential", "oppo", "grpo", "rloo-oppo"]
    assert cfgs["grpo"].overlap.mode == "sequential" and cfgs["grpo"].ppo.advantage == "grpo"
    assert cfgs["grpo"].rollout.group_size == 4 and cfgs["grpo"].run.steps == 4
    assert cfgs["rloo-oppo"].overlap.mode == "oppo" and str(cfgs["rloo-oppo"].run.out_dir).endswith("convergence-rloo-oppo")
    assert cfgs["sequential"].ppo.advantage == "gae"


def test_summary_gives_median_step_time_training_state_and_peak_rss_per_run():
    curves = {"sequential": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 2, "seconds": 9.0, "reward": 0.5}],
              "grpo": [{"step": 0, "seconds": 0.0, "reward": 0.0}, {"step": 2, "seconds": 5.0, "reward": 0.6}]}
    metrics = {"sequential": [{"step": 1, "step_s": 4.0, "mem/rss_mb": 900.0, "mem/train_state_mb": 300.0},
                              {"step": 2, "step_s": 5.0, "mem/rss_mb": 950.0, "mem/train_state_mb": 320.0}],
               "grpo": [{"step": 1, "step_s": 2.0, "mem/rss_mb": 600.0, "mem/train_state_mb": 150.0},
                        {"step": 2, "step_s": 3.0, "mem/rss_mb": 610.0, "mem/train_state_mb": 160.0},
                        {"step": 3, "skipped": "nan", "step_s": 0.1}]}
    s = summarize(curves, metrics=metrics)
    seq, grpo = s["modes"]["sequential"], s["modes"]["grpo"]
    assert (seq["step_s_median"], seq["rss_mb_peak"], seq["train_state_mb"]) == (4.5, 950.0, 320.0)
    assert (grpo["step_s_median"], grpo["rss_mb_peak"], grpo["train_state_mb"]) == (2.5, 610.0, 160.0)
    text = markdown(s)
    assert "| grpo | 2.5 | 160 | 610 |" in text and "| sequential | 4.5 | 320 | 950 |" in text


def _pts(*pairs):
    """Curve points (step, seconds, reward)."""
    return [{"step": k, "seconds": s, "reward": r} for k, s, r in pairs]


def test_seeds_run_each_mode_and_variant_under_consecutive_seeds_seed_after_seed(tmp_path):
    from colocate.bench.convergence import configs

    conv = ConvergenceOptions(steps=4, eval_every=2, modes=("sequential",), seeds=3,
                              variants=(("bf16", ("models.dtype=bfloat16",)),))
    cfgs = configs(conv, ["run.seed=7"], tmp_path)
    assert list(cfgs) == ["sequential-seed0", "bf16-seed0", "sequential-seed1", "bf16-seed1",
                          "sequential-seed2", "bf16-seed2"]
    assert [c.run.seed for c in cfgs.values()] == [7, 7, 8, 8, 9, 9]
    assert cfgs["bf16-seed2"].models.dtype == "bfloat16" and cfgs["sequential-seed1"].models.dtype == "auto"
    assert str(cfgs["bf16-seed1"].run.out_dir).endswith("convergence-bf16-seed1")
    one = configs(dataclasses.replace(conv, seeds=1), ["run.seed=7"], tmp_path)
    assert list(one) == ["sequential", "bf16"] and one["bf16"].run.seed == 7  # one seed: the names and seed as before


def test_seeds_summary_against_a_hand_computed_one():
    conv = ConvergenceOptions(modes=("sequential",), seeds=3, variants=(("bf16", ("models.dtype=bfloat16",)),))
    curves = {  # per seed: base final rewards 0.5, 0.4, 0.6 are the targets
        "sequential-seed0": _pts((0, 0, 0.0), (3, 30, 0.5), (6, 60, 0.5)),
        "bf16-seed0": _pts((0, 0, 0.0), (3, 20, 0.55), (6, 40, 0.6)),
        "sequential-seed1": _pts((0, 0, 0.1), (3, 30, 0.4), (6, 60, 0.4)),
        "bf16-seed1": _pts((0, 0, 0.1), (3, 20, 0.3), (6, 40, 0.45)),
        "sequential-seed2": _pts((0, 0, 0.0), (3, 30, 0.3), (6, 60, 0.6)),
        "bf16-seed2": _pts((0, 0, 0.0), (3, 20, 0.2), (6, 40, 0.5)),
    }
    s = summarize_seeds(curves, conv, {"bf16-seed1": 2})
    assert s["targets"] == [0.5, 0.4, 0.6] and s["base"] == "sequential" and s["seeds"] == 3
    # naive: per seed, time to that seed's target and the speed-up over that seed's sequential run
    want_times, want_speed = [], []
    for k, target in enumerate(s["targets"]):
        seq_t = next(p["seconds"] for p in curves[f"sequential-seed{k}"] if p["reward"] >= target)
        t = next((p["seconds"] for p in curves[f"bf16-seed{k}"] if p["reward"] >= target), None)
        if t is not None:
            want_times.append(t)
            want_speed.append(seq_t / t)
    assert want_times == [20, 40] and want_speed == [pytest.approx(1.5), pytest.approx(0.75)]
    bf16 = s["modes"]["bf16"]
    assert bf16["reached"] == 2 and bf16["time_to_target_s"] == {"median": 30.0, "min": 20, "max": 40, "n": 2}
    assert bf16["speedup_vs_base"]["median"] == pytest.approx(1.125)
    assert bf16["final_reward"] == {"median": 0.5, "min": 0.45, "max": 0.6, "n": 3}
    assert bf16["contended_steps"] == 2 and s["modes"]["sequential"]["reached"] == 3
    # step 3: bf16's best seed 0.55 is not below sequential's worst 0.3; nowhere below beyond the spread
    assert bf16["below_base_at"] == [] and s["modes"]["sequential"]["below_base_at"] == []


def test_below_base_is_below_every_seed_of_the_base_at_an_evaluation_all_seeds_hold():
    from colocate.bench.convergence import below_base

    base = [_pts((0, 0, 0.0), (3, 9, 0.5), (6, 18, 0.6)), _pts((0, 0, 0.1), (3, 9, 0.4), (6, 18, 0.7))]
    low = [_pts((0, 0, 0.05), (3, 9, 0.35), (6, 18, 0.65)), _pts((0, 0, 0.0), (3, 9, 0.3), (9, 27, 0.9))]
    assert below_base(low, base) == [3]  # step 0 inside the spread, step 6 not held by every seed
    assert below_base(base, base) == [] and below_base([], base) == []


def test_seeds_markdown_gives_median_and_range_and_the_steps_below():
    conv = ConvergenceOptions(modes=("sequential",), seeds=2, variants=(("bf16", ("models.dtype=bfloat16",)),))
    curves = {"sequential-seed0": _pts((0, 0, 0.0), (2, 10, 0.5)), "bf16-seed0": _pts((0, 0, 0.0), (2, 6, 0.2)),
              "sequential-seed1": _pts((0, 0, 0.0), (2, 12, 0.4)), "bf16-seed1": _pts((0, 0, 0.0), (2, 8, 0.3))}
    text = markdown_seeds(summarize_seeds(curves, conv), "convergence.png")
    assert "2 seeds; each seed's target is its `sequential` run's final held-out reward (+0.500, +0.400)" in text
    assert "| sequential | +0.450 [+0.400–+0.500] | 11.0 [10.0–12.0] | 2/2 | 1.00x [1.00x–1.00x] | – | none | 0 |" in text
    assert "| bf16 | +0.250 [+0.200–+0.300] | – | 0/2 | – | – | 2 | 0 |" in text
