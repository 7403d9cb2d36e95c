"""Faults on real engines: a dead scheduler, SIGTERM, non-finite rewards — nothing lost."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from colocate import api
from colocate.run import builder, checkpoint
from colocate.run import loop as ppo_loop
from colocate.config import load_config
from colocate.engine.runtime import EngineDiedError

pytestmark = pytest.mark.slow
SEEDS = (7, 8)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("rel", *SEEDS)


@pytest.fixture(scope="module")
def overrides(run_overrides):
    return lambda models, out_dir, *extra: run_overrides(models, out_dir, "rollout.max_new_tokens=48", "run.save_every=1", *extra)


def _scheduler_pid(engine) -> int:
    for pid in engine.child_pids:
        if "scheduler" in " ".join(psutil.Process(pid).cmdline()) + psutil.Process(pid).name():
            return pid
    return engine.child_pids[0]


def test_dead_scheduler_stops_cleanly_and_resume_loses_nothing(models, overrides, tmp_path, engine_pool):
    out = tmp_path / "run"
    cfg = load_config(overrides=overrides(models, out, "run.steps=4", "overlap.mode=oppo",
                                          "overlap.delta_init=2", "overlap.delta_adaptive=false",
                                          "rollout.ignore_eos=true", "rollout.max_new_tokens=400",
                                          "rollout.length_dist=lognormal", "rollout.length_median=60"))
    session = builder.build(cfg, log=lambda m: None, engines=engine_pool)
    victim = _scheduler_pid(session.actor)

    def kill_during_step_3(rec):
        if rec["step"] != 2:
            return

        def killer():  # once step 3's tokens are streaming: mid-rollout for sure
            while session.state.phase != "rollout":
                time.sleep(0.005)
            sent = session.rollouts.client.chunks_sent
            while session.rollouts.client.chunks_sent < sent + 3:
                time.sleep(0.005)
            os.kill(victim, signal.SIGKILL)

        threading.Thread(target=killer, daemon=True).start()

    try:
        with pytest.raises(EngineDiedError, match=r"the actor engine .* died") as e:
            ppo_loop.train(session, callbacks=[kill_during_step_3])
        assert "\n" not in str(e.value)
        assert session.state.phase == "rollout"  # it died mid-rollout, as intended
    finally:
        session.close()
    latest = checkpoint.latest(out)
    step, parts = checkpoint.load(latest)
    assert step == 2
    deferred_before = parts["data"]["ranks"][0]
    resumed = api.train(load_config(overrides=overrides(
        models, out, "run.steps=4", "overlap.mode=oppo", "overlap.delta_init=2", "overlap.delta_adaptive=false",
        "rollout.ignore_eos=true", "rollout.max_new_tokens=400", "rollout.length_dist=lognormal",
        "rollout.length_median=60")), resume=str(out), quiet=True, engines=engine_pool)
    assert [h["step"] for h in resumed.history] == [1, 2, 3, 4]
    assert all(h["trained_samples"] == 4 for h in resumed.history)
    # the deferred samples of step 2 came back (resumed) instead of being lost or duplicated
    step3 = resumed.history[2]
    assert step3["overlap/resumed"] + (1 if deferred_before else 0) >= 1
    _, final = checkpoint.load(checkpoint.latest(out))
    assert final["data"]["ranks"][0]["named"] > deferred_before["named"]


def test_sigterm_stops_at_a_step_boundary_with_a_checkpoint(models, overrides, tmp_path):
    out = tmp_path / "sig"
    args = [sys.executable, "-m", "colocate.cli", "train"]
    for o in overrides(models, out, "run.steps=50", "run.save_every=100"):
        args += ["--set", o]
    proc = subprocess.Popen(args, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if re.search(r"step\s+\d+/50", line):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=300)
    text = "".join(seen) + rest
    assert proc.returncode == 0, text[-2000:]
    step, _ = checkpoint.load(checkpoint.latest(out))
    assert 1 <= step < 50
    assert f"stopped by SIGTERM at step {step} (checkpointed; continue it with --resume {out})" in text


def test_sigterm_while_starting_ends_in_one_line_and_leaves_no_process(models, overrides, tmp_path):
    """Before, a SIGTERM during the engines' start killed the process at once (exit 143, no
    line) and SGLang's processes still importing outlived it, orphaned."""
    args = [sys.executable, "-m", "colocate.cli", "train"]
    for o in overrides(models, tmp_path / "start", "run.steps=50"):
        args += ["--set", o]
    proc = subprocess.Popen(args, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline, family = time.monotonic() + 120, set()
    while proc.poll() is None and time.monotonic() < deadline and not family:  # an engine's processes started
        family = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        time.sleep(0.2)
    assert family, "the run ended or started no process within 120 s"
    family |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        "error: stopped by SIGTERM while the run started, before its first step: nothing trained, nothing to "
        "checkpoint (its engines shut down)"], err[-3000:]
    time.sleep(1)  # a process SIGKILLed as the run ended is reaped by now
    assert not [p for p in family if _running(p)], [p for p in family if _running(p)]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_non_finite_reward_skips_the_update(models, overrides, tmp_path, engine_pool):
    # no held-out evaluation: the first reward calls must be the first training batch's
    # each function's value is finite (a NaN or inf from a function is reward.on_error's:
    # test_reward_fn_errors), but their sum overflows: the loop's own guard must hold
    cfg = load_config(overrides=overrides(models, tmp_path / "nan", "run.steps=2", "run.eval_every=0"))
    calls = []

    def sometimes_huge(record, text):
        calls.append(1)
        return 1e308 if len(calls) <= 8 else 0.0  # the whole first batch is poisoned: 2 x 1e308 = inf

    summary = api.train(cfg, reward_fns=[sometimes_huge, sometimes_huge], quiet=True, engines=engine_pool)
    first, second = summary.history
    assert first["skipped"].startswith("non-finite reward") and first["trained_samples"] == 0
    assert first["weight_version"] == 0  # nothing was trained or synced
    assert second["trained_samples"] == 4 and second["weight_version"] == 1


def test_scheduler_dead_during_weight_sync_is_an_error_not_a_hang(models, overrides, tmp_path, engine_pool):
    session = builder.build(load_config(overrides=overrides(models, tmp_path / "sync", "run.steps=1")),
                            log=lambda m: None, engines=engine_pool)
    try:
        os.kill(_scheduler_pid(session.actor), signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(EngineDiedError, match="the actor engine .* died"):
            session.sync_weights()
        assert time.monotonic() - started < 30
    finally:
        session.close()
