"""The fault matrix: kill -9 of the training process in each phase of a step, and of the
actor engine's processes, each followed by `colocate train --resume DIR` alone (tiny
models, CPU, oppo mode: streamed scoring and a deferred buffer; the stragglers stay paused
in the engine across training and the weight sync, `overlap.pause_mode=in_place`, so the
kills after the rollout hit a run with requests paused in place).

One chain shares the cost, one launch per fault: the run is killed in phase A of step k,
the `--resume` goes on and is killed in phase B of step k+1, and so on (``run.fault_at``
lists every fault; each fires once per run folder). Every case resumes from the last
checkpoint (step k-1), the final metrics hold every step exactly once, and at the end
every sample ever drawn was trained once, is still deferred, or was dropped as too stale:
none trained twice, no deferred one lost. The measured table is in docs/architecture.md
("Fault matrix")."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from colocate.run import checkpoint
from tests.integration.test_rank_failure import _launch as _train  # colocate train, timed

pytestmark = pytest.mark.slow
CHAIN = [("generate", 2), ("score", 3), ("logprobs", 4), ("update", 5), ("sync", 6), ("checkpoint", 7),
         ("engine", 8)]
STEPS = 9


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_kill_in_every_phase_then_resume_alone(tiny_pair, run_overrides, tmp_path):
    out = tmp_path / "run"
    spec = ",".join(f"{phase}:{step}" for phase, step in CHAIN)
    sets = run_overrides(tiny_pair("faults", 51, 52), out, f"run.steps={STEPS}", "run.save_every=1",
                         "run.eval_every=0", "ppo.epochs=1", "overlap.mode=oppo", "overlap.pause_mode=in_place",
                         "rollout.max_new_tokens=32", "rollout.length_dist=lognormal", "rollout.length_median=6",
                         "rollout.ignore_eos=true",  # a long tail: stragglers at every cut
                         "overlap.delta_adaptive=false", "overlap.delta_init=2", f"run.fault_at={spec}")
    table = []
    args = [f"--set={s}" for s in sets]
    for i, (phase, step) in enumerate(CHAIN):
        done, wall = _train(*args)
        ended_s = time.time() - (out / "faults_fired").stat().st_mtime
        fired = (out / "faults_fired").read_text().split()
        assert fired[-1] == f"{phase}:{step}:0", (fired, done.stderr[-3000:])
        if i:
            assert f"resumed from step {CHAIN[i - 1][1] - 1}" in done.stdout, done.stdout[-2000:]
        if phase == "engine":  # the run finds its engine dead: one line, the last completed step kept
            errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
            assert done.returncode == 2 and len(errors) == 1 and "died" in errors[0], done.stderr[-3000:]
        else:
            assert done.returncode == -9, done.stderr[-3000:]  # SIGKILL: nothing ran after it
        assert checkpoint.latest(out).name == f"step_{step - 1:08d}"  # intact, and the newest
        table.append((phase, step, done.returncode, round(ended_s, 1), round(wall, 1)))
        args = ["--resume", str(out)]  # alone: the run's own config.json
    done, wall = _train("--resume", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from step {CHAIN[-1][1] - 1}" in done.stdout
    table.append(("none", STEPS, 0, 0.0, round(wall, 1)))
    print("\nphase step exit seconds_after_fault launch_wall_s\n" + "\n".join(" ".join(map(str, r)) for r in table))

    assert _steps(out) == list(range(1, STEPS + 1))  # every step once
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    step, parts = checkpoint.load(checkpoint.latest(out))
    assert step == STEPS
    n = json.loads((out / "config.json").read_text())["rollout"]["group_size"]
    (rank,) = parts["data"]["ranks"]
    scheduler = rank
    drawn = rank["data_pos"] * n
    trained = sum(r["trained_samples"] for r in records)
    assert scheduler["deferred"], "no deferred sample to lose: the chain tests nothing of the buffer"
    parked = [r["step"] for r in records if r.get("overlap/parked", 0) > 0]
    assert len(parked) >= 3, f"requests were paused in place after steps {parked} only"
    assert trained + len(scheduler["deferred"]) + scheduler["dropped_total"] == drawn, (
        trained, len(scheduler["deferred"]), scheduler["dropped_total"], drawn)
