"""A rank that fails in the weight sync or in training ends every rank within seconds, each
in one line naming the failed rank and phase, with the last checkpoint intact
(`colocate train --nproc 2`, gloo on CPU, a tiny actor and a rule reward; the failures are
raised on rank 1 only by the ``run.fault_at`` test hook).

One chain, two launches: the first fails in step 2's push into rank 1's engine (agreed at
the phase's end: every rank checkpoints step 2 together, then stops); ``--resume`` alone
goes on and fails in step 3's training on rank 1 (inside the trainer's collectives: rank 1
leaves its line in the store and exits, rank 0's broken collective reads it back; no
checkpoint: step 2's stays)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from colocate.run import checkpoint

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _launch(*args: str, timeout_s: float = 600) -> tuple[subprocess.CompletedProcess, float]:
    """``colocate train ARGS`` in its own session; past ``timeout_s`` the test fails saying
    whether the run itself was stuck (its stacks: SIGUSR1) or processes it started held its
    output open after it ended, and the whole session is killed."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "colocate.cli", "train", *args], cwd=str(ROOT), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(_stuck(proc, timeout_s), pytrace=False)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - started


def _stuck(proc: subprocess.Popen, timeout_s: float) -> str:
    """What a launch still doing something after ``timeout_s`` was doing; kills its session."""
    alive = proc.poll() is None
    if alive:
        os.kill(proc.pid, signal.SIGUSR1)  # colocate.monitor.stack_dump: threads and pending tasks to stderr
        time.sleep(5)
    left = []
    for p in psutil.process_iter(["pid", "ppid", "status", "cmdline"]):
        try:
            if os.getsid(p.pid) == proc.pid:
                left.append(f"{p.info['pid']} (parent {p.info['ppid']}, {p.info['status']}): "
                            f"{' '.join(p.info['cmdline'] or [])[:160]}")
        except (ProcessLookupError, PermissionError):
            continue
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=60)
    what = "still running" if alive else f"ended ({proc.returncode}), its output still held open"
    return (f"colocate train {what} after {timeout_s:g} s; its session's processes:\n  " + "\n  ".join(left)
            + f"\n--- stdout tail:\n{out[-3000:]}\n--- stderr tail:\n{err[-12000:]}")


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def _ended_after_fault_s(out: Path) -> float:
    """Seconds from the fault (its record's write) to now (the launch just ended)."""
    return time.time() - (out / "faults_fired").stat().st_mtime


def test_a_rank_failing_in_sync_then_in_training_ends_every_rank_in_one_line(tiny_pair, run_overrides, tmp_path):
    out = tmp_path / "run"
    sets = run_overrides(tiny_pair("rankfail", 41, 42), out, "run.steps=4", "run.save_every=100", "run.eval_every=0",
                         "rollout.max_new_tokens=8", "ppo.epochs=1", "run.fault_action=raise",
                         "reward.kind=rule", "reward.rule=vader",  # no reward engines: faster launches
                         "run.fault_at=sync:2:1,update:3:1")
    done, _ = _launch("--nproc", "2", *(f"--set={s}" for s in sets))
    ended_s = _ended_after_fault_s(out)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = _errors(done.stderr)
    own = "error: fault injected at sync of step 2 on rank 1"
    assert any(e.startswith(own) for e in errors), done.stderr[-3000:]
    assert "error: rank 1 failed in sync (FaultInjected: fault injected at sync of step 2" in done.stderr
    assert errors[-1].startswith("error: rank ") and "of 2 failed first" in errors[-1]  # the launcher's (both
    # ranks exit with the agreed failure, so either may be first)
    assert len(errors) == 3, errors  # one line per rank, one from the launcher
    assert ended_s < 30, ended_s
    print(f"sync failure on rank 1: every rank ended {ended_s:.1f} s after it")
    step, parts = checkpoint.load(checkpoint.latest(out))  # written by the failure path (save_every=100)
    assert step == 2 and parts["run"]["weight_version"] == 2

    done, _ = _launch("--nproc", "2", "--resume", str(out))
    ended_s = _ended_after_fault_s(out)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = _errors(done.stderr)
    assert any(e.startswith("error: fault injected at update of step 3 on rank 1") for e in errors), done.stderr[-3000:]
    assert "error: rank 1 failed in train (FaultInjected: fault injected at update of step 3" in done.stderr
    assert len(errors) == 3, errors
    assert ended_s < 30, ended_s
    print(f"training failure on rank 1: every rank ended {ended_s:.1f} s after it")
    assert checkpoint.latest(out).name == "step_00000002"  # intact: no checkpoint of a half-trained step
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1]  # step 2 failed in its sync, before its metrics line
