"""Multi-turn runs end to end on real SGLang (CPU, tiny random models, the scripted
environment): every overlap mode, groups with a critic-free estimator, packing and the
engine's log-probs; and a run killed with SIGKILL mid-run, then ``--resume DIR`` alone,
with deferred trajectories in its checkpoint: none lost, none trained twice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from colocate import api
from colocate.config import load_config
from colocate.rollout.env import Observation
from colocate.rollout.scripted_env import ScriptedEnv
from colocate.rollout.turns import EnvError
from colocate.run import checkpoint
from tests.integration.test_rank_failure import _launch

pytestmark = pytest.mark.slow
SEEDS = (3, 4)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)
TRAJECTORY = ("rollout.max_new_tokens=80", "rollout.turn_tokens=6", "rollout.max_turns=4",
              "rollout.temperature=0")


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("loop", *SEEDS)  # test_ppo_loop's: the pool's engines are shared


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode,extra", [
    ("sequential", ()),
    ("oppo", ("overlap.chunk_size=8",)),  # streamed scoring (chunks cover the environment's tokens) + deferral
    ("inter", ("rollout.group_size=2", "ppo.advantage=grpo", "ppo.old_logp=rollout",
               "rollout.length_dist=lognormal", "rollout.length_median=40")),
    # stragglers parked in the engine across the update: mid-turn with their KV, or between
    # turns waiting (after the environment's answer) for the next step
    ("inter", ("overlap.pause_mode=in_place", "rollout.length_dist=lognormal", "rollout.length_median=40",
               "overlap.delta_adaptive=false", "overlap.delta_init=2")),
    ("oppo", ("overlap.pause_mode=retract", "overlap.chunk_size=8", "rollout.length_dist=lognormal",
              "rollout.length_median=40", "overlap.delta_adaptive=false", "overlap.delta_init=2")),
])
def test_every_mode_trains_on_trajectories(models, run_overrides, tmp_path, engine_pool, mode, extra):
    out = tmp_path / mode
    cfg = load_config(overrides=run_overrides(models, out, "run.steps=3", "run.eval_every=0", "ppo.epochs=1",
                                              f"overlap.mode={mode}", *TRAJECTORY, *extra))
    env = ScriptedEnv(replies=("4", "5"), turn_rewards=(0.5, 0.0), final_reward=1.0)  # byte tokens: keep them short
    summary = api.train(cfg, quiet=True, engines=engine_pool, env=env)
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3] and summary.steps == 3
    for r in records:
        assert r["trained_samples"] == 4
        assert r["rollout/turns"] > 1 and r["rollout/tool_calls"] > 0 and r["rollout/env_tokens"] > 0
        assert 0 < r["rollout/tool_call_rate"] <= 1 and r["env/errors"] == 0
        assert r["rollout/env_reward"] >= 0.5  # the first answer's reward reached the trajectories
        for key in ("actor/policy_loss", "kl", "reward_mean"):
            assert math.isfinite(r[key]), key
    assert sum(r["rollout/cached_turn_tokens"] for r in records) > 0  # later turns hit the radix cache
    if "overlap.pause_mode=in_place" in extra or "overlap.pause_mode=retract" in extra:
        assert sum(r["overlap/parked"] for r in records) > 0, "nothing was parked: the case tests nothing"


class _FailsFromCall:
    """Answers like the scripted environment until its ``n``-th call, then raises: a
    failure in a later step, after checkpoints exist (stateful on purpose)."""

    name, instruction = "flaky-tool", ""

    def __init__(self, n: int):
        self.n, self.calls, self.inner = n, 0, ScriptedEnv(replies=("4", "5"))

    async def step(self, record, history):
        self.calls += 1
        if self.calls >= self.n:
            raise ConnectionError("tool server went away")
        return await self.inner.step(record, history)


def test_a_failing_environment_fails_the_step_in_one_line_and_keeps_the_last_checkpoint(
        models, run_overrides, tmp_path, engine_pool):
    out = tmp_path / "run"
    cfg = load_config(overrides=run_overrides(models, out, "run.steps=3", "run.save_every=1", "run.eval_every=0",
                                              "ppo.epochs=1", *TRAJECTORY))
    with pytest.raises(EnvError) as info:
        api.train(cfg, quiet=True, engines=engine_pool, env=_FailsFromCall(14))  # a step: 4 trajectories x at most 3 calls
    line = str(info.value)
    assert "\n" not in line and line.startswith("rollout.env flaky-tool: turn ")
    assert "raised ConnectionError: tool server went away" in line
    steps = [r["step"] for r in _records(out)]
    assert steps == [1] and (out / "checkpoints" / "step_00000001").is_dir()  # step 1's work is kept


def test_killed_multi_turn_run_resumes_alone_and_loses_no_trajectory(models, run_overrides, tmp_path):
    out = tmp_path / "run"
    sets = run_overrides(models, out, "run.steps=5", "run.save_every=1", "run.eval_every=0", "ppo.epochs=1",
                         "overlap.mode=oppo", "overlap.chunk_size=8", "rollout.env=scripted", *TRAJECTORY,
                         "rollout.length_dist=lognormal", "rollout.length_median=40",
                         "overlap.delta_adaptive=false", "overlap.delta_init=2", "run.fault_at=logprobs:3")
    killed, _ = _launch(*[f"--set={s}" for s in sets])
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL in step 3, after its rollout
    step, parts = checkpoint.load(checkpoint.latest(out))
    assert step == 2
    deferred = parts["data"]["ranks"][0]["deferred"]
    assert any(d["loss_mask"] and 0 in d["loss_mask"] or d["awaiting_env"] for d in deferred), \
        "no trajectory deferred after a turn: the resume tests nothing of multi-turn deferral"

    done, _ = _launch("--resume", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from step 2" in done.stdout
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # every step once
    step, parts = checkpoint.load(checkpoint.latest(out))
    (rank,) = parts["data"]["ranks"]
    scheduler = rank
    trained = sum(r["trained_samples"] for r in records)
    assert trained + len(scheduler["deferred"]) + scheduler["dropped_total"] == rank["data_pos"]
    assert all("rollout/turns" in r for r in records) and max(r["rollout/turns"] for r in records) > 1


class _LeaksTheAnswer:
    """A tool whose first answer holds the prompt's correct ``<answer>``, then ends."""

    name, instruction = "leaky-tool", ""

    async def step(self, record, history):
        if sum(m["role"] == "assistant" for m in history) > 1:
            return Observation(done=True)
        return Observation(f"<answer>{record['answer']}</answer>", role="tool")


def test_a_tool_output_holding_the_answer_earns_the_model_nothing(models, run_overrides, tmp_path, engine_pool):
    from colocate.assets import tasks

    seen = []

    def sees(record, text, messages):  # asks for the trajectory: gets it beside the model's text
        seen.append((record, text, messages))
        return 0.0

    cfg = load_config(overrides=run_overrides(models, tmp_path / "leak", "run.steps=1", "run.eval_every=0",
                                              "ppo.epochs=1", "data.source=reasoning-gym:basic_arithmetic",
                                              "reward.kind=rule", "reward.rule=reasoning-gym", *TRAJECTORY))
    summary = api.train(cfg, quiet=True, engines=engine_pool, env=_LeaksTheAnswer(), reward_fns=[sees])
    [h] = summary.history
    assert h["trained_samples"] == 4 and h["rollout/tool_calls"] > 0
    rule = tasks.reasoning_gym_reward("basic_arithmetic")
    leaked = 0
    for record, text, messages in seen:
        answer = f"<answer>{record['answer']}</answer>"
        assert answer not in text and text == "\n".join(m["content"] for m in messages if m["role"] == "assistant")
        if any(m == {"role": "tool", "content": answer} for m in messages):
            leaked += 1
            whole = "".join(m["content"] for m in messages)
            assert rule(record, whole) == 1.0  # scored over the trajectory, the tool's answer would count
    assert leaked == 4 and h["reward_mean"] == 0.0  # the random model's own text answers nothing
