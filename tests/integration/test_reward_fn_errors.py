"""A raising reward function on a real run: it fails the step by default (one line, the
checkpoint of the last completed step kept); with reward.on_error=zero the run goes on and
the failures are counted in metrics.jsonl."""

from __future__ import annotations

import asyncio
import json
import math
import time

import pytest

from colocate import api
from colocate.config import load_config
from colocate.rollout.reward_fns import RewardFnError

SEEDS = (5, 6)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)


class FailsFromCall:
    """Raises from its ``n``-th call on (the first step's calls succeed)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, record, text):
        self.calls += 1
        if self.calls >= self.n:
            raise ValueError("no <answer> tag")
        return 0.1


@pytest.mark.slow
# step 1 scores B=4 samples (inter: at most B+Δ=6), so the n-th call falls in step 2
@pytest.mark.parametrize("mode,n", [("sequential", 5), ("inter", 7)])
def test_raising_reward_fn_fails_the_step_and_keeps_the_last_checkpoint(tmp_path, tiny_pair, run_overrides, mode, n, engine_pool):
    models = tiny_pair(f"fnerr-{mode}", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=3", "run.save_every=1",
                                              "run.eval_every=0", "rollout.max_new_tokens=6",
                                              f"overlap.mode={mode}"))
    with pytest.raises(RewardFnError, match="FailsFromCall raised ValueError: no <answer> tag"):
        api.train(cfg, reward_fns=[FailsFromCall(n)], quiet=True, engines=engine_pool)
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps and steps == list(range(1, len(steps) + 1))
    assert (tmp_path / "run" / "checkpoints" / f"step_{steps[-1]:08d}").is_dir()


@pytest.mark.slow
def test_on_error_zero_continues_and_counts(tmp_path, tiny_pair, run_overrides, engine_pool):
    models = tiny_pair("fnerr-zero", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=2", "run.eval_every=0",
                                              "rollout.max_new_tokens=6", "reward.on_error=zero"))
    summary = api.train(cfg, reward_fns=[FailsFromCall(3)], quiet=True, engines=engine_pool)
    assert summary.steps == 2
    counts = [h["reward/fn_errors"] for h in summary.history]
    assert counts == [2, 4]  # calls 3 and 4 of step 1, all 4 of step 2


class ReturnsNoNumber:
    """Finite values for its first ``n - 1`` calls, then NaN, inf, a string, None in turn."""

    BAD = (float("nan"), float("inf"), "0.5", None)

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, record, text):
        self.calls += 1
        return 0.1 if self.calls < self.n else self.BAD[(self.calls - self.n) % len(self.BAD)]


@pytest.mark.slow
def test_a_nan_from_a_function_fails_the_step_in_one_line_naming_the_sample(tmp_path, tiny_pair, run_overrides,
                                                                           engine_pool):
    models = tiny_pair("fnerr-sequential", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=2", "run.save_every=1",
                                              "run.eval_every=0", "rollout.max_new_tokens=6"))
    with pytest.raises(RewardFnError) as info:
        api.train(cfg, reward_fns=[ReturnsNoNumber(5)], quiet=True, engines=engine_pool)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("reward function ReturnsNoNumber returned nan (not finite) (sample ")
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1] and (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()


@pytest.mark.slow
def test_on_error_zero_scores_non_numbers_zero_and_trains_on_finite_advantages(tmp_path, tiny_pair, run_overrides,
                                                                              engine_pool):
    models = tiny_pair("fnerr-zero", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=1", "run.eval_every=0",
                                              "rollout.max_new_tokens=6", "reward.on_error=zero"))
    summary = api.train(cfg, reward_fns=[ReturnsNoNumber(1)], quiet=True, engines=engine_pool)
    [h] = summary.history
    assert h["trained_samples"] == 4 and h["reward/fn_errors"] == 4  # nan, inf, '0.5', None: each counted
    for key in ("reward_mean", "actor/policy_loss", "critic/value_loss", "kl"):
        assert math.isfinite(h[key]), key


@pytest.mark.slow
def test_reward_fns_by_name_score_a_run_without_a_reward_model(tmp_path, tiny_pair, run_overrides, engine_pool):
    from tests.unit.reward_fns_for_tests import CONSTANT

    models = tiny_pair("fnerr-sequential", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=1", "run.eval_every=0",
                                              "rollout.max_new_tokens=6", "reward.kind=rule",
                                              "reward.fns=tests.unit.reward_fns_for_tests:constant"))
    assert cfg.reward.rules == ()
    summary = api.train(cfg, quiet=True, engines=engine_pool)
    [h] = summary.history
    assert h["trained_samples"] == 4 and h["reward_mean"] == pytest.approx(CONSTANT)


class HangsFromCall:
    """An async function that never returns from its ``n``-th call on (a verifier server that
    stopped answering)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    async def __call__(self, record, text):
        self.calls += 1
        if self.calls >= self.n:
            await asyncio.Event().wait()
        return 0.1


@pytest.mark.slow
def test_an_async_function_that_never_returns_fails_the_step_at_its_deadline(tmp_path, tiny_pair, run_overrides,
                                                                             engine_pool):
    """reward.fn_timeout_s: the step ends in one line instead of waiting forever; the
    checkpoint of the last completed step is kept, and the engines serve the next run."""
    models = tiny_pair("fnerr-sequential", *SEEDS)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=3", "run.save_every=1",
                                              "run.eval_every=0", "rollout.max_new_tokens=6",
                                              "reward.fn_timeout_s=1"))
    started = time.monotonic()
    with pytest.raises(RewardFnError) as info:
        api.train(cfg, reward_fns=[HangsFromCall(5)], quiet=True, engines=engine_pool)
    line = str(info.value)
    assert "\n" not in line and line.startswith("reward function HangsFromCall did not return within 1 s "
                                                "(reward.fn_timeout_s) (sample ")
    assert time.monotonic() - started < 120  # bounded: the deadline, not the test's timeout
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1] and (tmp_path / "run" / "checkpoints" / "step_00000001").is_dir()
