"""The Python API as a user drives it: config in code, Python reward functions (sync and
async) beside the SGLang reward model, per-step callbacks, the trained checkpoint."""

from __future__ import annotations

import asyncio
import math
import statistics

import pytest

from click.testing import CliRunner

from colocate import api, cli
from colocate.monitor import completions
from colocate.run import checkpoint
from colocate.config import load_config
from tests.conftest import THREADS  # one thread per engine: pooled across modes

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)
OFFSET = 1000.0  # far above what the tiny random reward model scores


def config(tiny_actor_path, tiny_rm_path, out_dir, *extra):
    return load_config(overrides=[
        f"models.actor={tiny_actor_path}", f"models.reward={tiny_rm_path}", f"run.out_dir={out_dir}",
        "rollout.batch_size=4", "rollout.max_new_tokens=12", "ppo.minibatches=2", "run.steps=2",
        "run.save_every=1", "data.max_prompt_tokens=512", "engines.actor_max_total_tokens=8192",
        "engines.reward_max_total_tokens=8192", "engines.device=cpu", "models.dtype=float32", *THREADS, *extra])


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_two_steps_with_sync_and_async_reward_functions(tiny_actor_path, tiny_rm_path, tmp_path, mode,
                                                         monkeypatch, engine_pool):
    texts, steps = [], []

    def offset(record, text):  # sync
        texts.append(text)
        return OFFSET

    async def length_bonus(record, text):  # async
        await asyncio.sleep(0)
        return len(text) / 1000

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = config(tiny_actor_path, tiny_rm_path, tmp_path / mode, f"overlap.mode={mode}",
                 "overlap.chunk_size=4", "overlap.delta_init=1", "overlap.delta_adaptive=false",
                 "run.wandb_project=colocate-test", "run.wandb_mode=offline")
    summary = api.train(cfg, reward_fns=[offset, length_bonus], callbacks=[steps.append], quiet=True,
                        engines=engine_pool)
    assert [rec["step"] for rec in steps] == [1, 2] == [h["step"] for h in summary.history]
    for rec in steps:
        # the reward model's score plus both functions: the offset dominates
        assert OFFSET - 50 < rec["reward_mean"] < OFFSET + 50 and rec["trained_samples"] == 4
    assert len(texts) >= 8  # every trained sample was judged by the function
    step, parts = checkpoint.load(checkpoint.latest(summary.checkpoint_dir))
    assert step == 2 and "trainer" in parts
    assert "2 steps" in summary.describe()
    # every step mirrored to TensorBoard and (offline) W&B, the summary at the end
    [tb_file] = (summary.out_dir / "tb").glob("events.out.tfevents.*")
    assert b"reward_mean" in tb_file.read_bytes()
    [wandb_file] = (summary.out_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = wandb_file.read_bytes()
    assert all(key in data for key in (b"reward_mean", b"time/generate", b"reward_first", b"overlap"))
    # what the model wrote: every trained sample, its reward's parts summing to it
    rows = completions.read(summary.out_dir)
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    for h in summary.history:
        mine = [r for r in rows if r["step"] == h["step"]]
        assert statistics.fmean(r["reward"] for r in mine) == pytest.approx(h["reward_mean"])
        for r in mine:
            assert set(r["reward_parts"]) == {"model", "env", "offset", "length_bonus"}
            assert sum(r["reward_parts"].values()) == pytest.approx(r["reward"])
            assert r["reward_parts"]["offset"] == OFFSET and r["response"] in texts
            assert r["length"] == sum(n for _, n in r["versions"]) and r["prompt"]
            assert r["finish_reason"] in ("stop", "length")
    assert b"samples" in tb_file.read_bytes() and b"samples" in data  # TensorBoard text, W&B table
    shown = CliRunner().invoke(cli.main, ["show", str(summary.out_dir)])
    assert shown.exit_code == 0 and shown.output.count("step 2 sample ") == 4 and "offset +1e+03" in shown.output


def test_inter_mode_with_a_rule_reward_only(tiny_actor_path, tiny_rm_path, tmp_path, engine_pool):
    seen = []

    def rule(record, text):
        seen.append(text)
        return 1.0 if "a" in text else 0.0

    cfg = config(tiny_actor_path, tiny_rm_path, tmp_path / "inter", "overlap.mode=inter",
                 "reward.kind=rule", "reward.rule=vader", "overlap.delta_init=2",
                 "overlap.delta_adaptive=false")
    summary = api.train(cfg, reward_fns=[rule], quiet=True, engines=engine_pool)
    assert [h["trained_samples"] for h in summary.history] == [4, 4]
    for h in summary.history:  # vader in [-1, 1] plus the rule in {0, 1}
        assert -1.0 <= h["reward_mean"] <= 2.0
    assert len(seen) >= 8


def test_a_failing_callback_keeps_the_completed_step_and_the_run_resumes_from_it(tiny_actor_path, tiny_rm_path,
                                                                                 tmp_path, engine_pool):
    """Before: a callback raising after step 1 of a run without periodic checkpoints
    (run.save_every=0) lost that step: nothing was written, the trainer had moved."""
    class Broke(Exception):
        pass

    def broken(rec):
        raise Broke(f"the caller's callback failed after step {rec['step']}")

    cfg = config(tiny_actor_path, tiny_rm_path, tmp_path / "cb", "run.save_every=0")
    with pytest.raises(Broke, match="after step 1"):  # the caller's own error, as it raised it
        api.train(cfg, callbacks=[broken], quiet=True, engines=engine_pool)
    where = checkpoint.latest(tmp_path / "cb")
    assert checkpoint.load(where)[0] == 1 and where.name == "step_00000001"
    steps = []
    summary = api.train(cfg, resume=tmp_path / "cb", quiet=True, engines=engine_pool, callbacks=[steps.append])
    assert [rec["step"] for rec in steps] == [2]  # step 1 is not trained again
    assert [h["step"] for h in summary.history] == [1, 2]  # the run's records: step 1's line written once


def test_held_out_prompts_are_evaluated_and_never_trained_on(tiny_actor_path, tiny_rm_path, tmp_path, engine_pool):
    import collections
    import json

    from colocate.assets.tasks import load_prompt_source

    source = tmp_path / "prompts.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"Tell me about topic {i}.", "id": i}) + "\n" for i in range(12)))
    seen = collections.Counter()
    cfg = config(tiny_actor_path, tiny_rm_path, tmp_path / "eval", f"data.source={source}",
                 "data.eval_prompts=3", "run.eval_every=1")
    held = [p.meta["id"] for p in load_prompt_source(str(source), None, cfg.data.seed)[-3:]]

    # a non-finite score for one held-out prompt: counted, left out of the mean. Each value is
    # finite (a function's NaN or inf is reward.on_error's), their sum is not
    def count(record, text):
        seen[record["id"]] += 1
        return 1e308 if record["id"] == held[0] else 0.0

    def huge(record, text):
        return 1e308 if record["id"] == held[0] else 0.0

    summary = api.train(cfg, reward_fns=[count, huge], quiet=True, engines=engine_pool)
    # evaluated after 0, 1 and 2 steps: each held-out prompt scored 3 times, by greedy decoding
    assert [e["step"] for e in summary.evals] == [0, 1, 2]
    assert all(e["prompts"] == len(e["scores"]) == 3 and e["weight_version"] == e["step"] for e in summary.evals)
    assert all(e["non_finite"] == 1 and math.isfinite(e["reward_mean"]) for e in summary.evals)
    assert not any("skipped" in h for h in summary.history)
    assert {i: seen[i] for i in held} == {i: 3 for i in held}
    # 2 steps x 4 rows drawn from the 9 training prompts: each at most once, none held out
    assert sum(n for i, n in seen.items() if i not in held) == 8
    assert all(n == 1 for i, n in seen.items() if i not in held)
    assert "held-out reward" in summary.describe()
    evaluated = completions.read(summary.out_dir, evaluation=True)  # the evaluations' completions
    assert [r["step"] for r in evaluated] == [0] * 3 + [1] * 3 + [2] * 3
    assert sum(not math.isfinite(r["reward"]) for r in evaluated) == 3 and all(r["prompt"] for r in evaluated)
