"""`colocate train --nproc 2`: two training ranks started by torchrun on one node (gloo on
CPU), each with its own engines, every step trained and checkpointed, rank 0's metrics
covering both ranks' engines; two simulated nodes (two torchrun invocations on loopback)
each generate on their own engines, checkpoint both deferred buffers and resume on one
rank with them; a rank that fails ends the launch with one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from colocate import launch
from tests.failures.listeners import beyond_loopback, run_watched

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "colocate.cli", "train", *args]


def test_two_ranks_train_and_checkpoint(tiny_pair, run_overrides, tmp_path):
    out = tmp_path / "run"
    sets = run_overrides(tiny_pair("launch", 21, 22), out, "run.steps=2", "run.save_every=2", "run.eval_every=0",
                         "rollout.max_new_tokens=8", "ppo.epochs=1", "overlap.mode=intra")
    # the launch's listeners are watched throughout (issue 50, item 3: tests/failures/test_listeners.py)
    done, seen = run_watched(_cli("--nproc", "2", *(f"--set={s}" for s in sets)), cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-3000:]
    assert any("scheduler" in cmd for _, cmd, _, _ in seen), seen
    assert not beyond_loopback(seen), "listening beyond loopback: " + "; ".join(beyond_loopback(seen))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["trained_samples"] == 4 for r in records)
    for rank in (0, 1):  # rank 0 writes both ranks' engine counts (2 samples each, streamed to its own RM)
        assert all(r[f"engines/{rank}/actor_requests"] == 2 and r[f"engines/{rank}/reward_requests"] > 0
                   for r in records), records
    assert (out / "checkpoints" / "step_00000002").is_dir()
    assert json.loads((out / "config.json").read_text())["run"]["steps"] == 2
    assert done.stdout.count("engines up") == 1  # rank 0 speaks for the run
    assert done.stdout.count(" s/step); reward") == 1, done.stdout[-2000:]  # the summary line too


def test_two_nodes_on_loopback_train_checkpoint_and_resume_on_one_rank(tiny_pair, run_overrides, tmp_path):
    """Two torchrun invocations with --nnodes 2 (one process each) meet at a c10d
    rendezvous on loopback, as two machines would; the run then resumes on one rank. Inter
    mode with a rule reward: each node defers on its own actor engine, and no reward engine
    starts on each node (the test above streams to one per rank; test_rank_engines runs
    oppo per rank)."""
    from colocate.trainer.distributed import free_port

    out = tmp_path / "run"
    sets = [f"--set={s}" for s in run_overrides(
        tiny_pair("nodes", 23, 24), out, "run.steps=2", "run.save_every=2", "run.eval_every=0",
        "rollout.max_new_tokens=8", "ppo.epochs=1", "overlap.mode=inter", "reward.kind=rule", "reward.rule=vader")]
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                               "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                               "-m", "colocate.cli", "train", *sets],
                              cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    try:
        logs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert (out / "checkpoints" / "step_00000002").is_dir()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert all(r["engines/0/deferred"] > 0 and r["engines/1/deferred"] > 0 for r in records)  # each node's own
    deferred = records[-1]["overlap/deferred"]

    done = subprocess.run(_cli("--resume", str(out), "--set=run.steps=3"), cwd=str(ROOT),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resume: 2 engine ranks -> 1: {deferred} deferred samples" in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["trained_samples"] == 4


def test_a_failing_rank_ends_the_launch_in_one_line(tmp_path):
    done = subprocess.run(_cli("--nproc", "2", f"--set=models.actor={tmp_path / 'missing'}",
                               f"--set=run.out_dir={tmp_path / 'run'}"),
                          cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank ") and "of 2 failed first; its error is printed above" in last
    assert "models.actor" in done.stderr  # the rank's own one-line error


def test_torchrun_arguments():
    assert launch.torchrun_args(2, ["my.yaml", "--set=run.steps=3"], "/tmp/x/rdzv") == [
        "--rdzv-backend=colocate-loopback", "--rdzv-endpoint=/tmp/x/rdzv", "--rdzv-conf=store_type=file",
        "--local-addr=127.0.0.1", "--nnodes=1", "--nproc-per-node=2", "-m", "colocate.cli", "train", "my.yaml",
        "--set=run.steps=3"]
    assert launch.under_torchrun({"LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert not launch.under_torchrun({})
    with pytest.raises(Exception, match="--nproc must be >= 1"):
        launch.torchrun_args(0, [], "/tmp/x/rdzv")
