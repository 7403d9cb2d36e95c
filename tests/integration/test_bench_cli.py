"""`colocate bench` end to end (tiny preset run) and the CLI through click's runner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from colocate.cli import main

pytestmark = pytest.mark.slow


def test_bench_quick_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "bench"
    # fixed engine threads: sequential and oppo run on one session (one engine start each for the
    # actor and the reward model instead of one per thread budget), as the bench does for modes
    # of equal budgets; no waiting for a quiet machine (nothing here reads the wait)
    result = CliRunner().invoke(main, ["bench", "--quick", "--no-peer", "--repeats", "1", "--steps", "1",
                                       "--workloads", "short", "--modes", "sequential,oppo", "--quiet-wait", "0",
                                       "--set", "engines.actor_threads=1", "--set", "engines.reward_threads=1",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = (out / "report.md").read_text()
    assert "| sequential |" in report and "| oppo |" in report and "vs sequential" in report
    data = json.loads((out / "results.json").read_text())
    env = data["environment"]
    assert env["commit"] and env["sglang"] and env["device"].startswith("cpu")
    assert f"commit `{env['commit']}`" in report
    summary = data["workloads"]["short"]["summary"]
    assert summary["oppo"]["vs_sequential"]["n"] == 1 and summary["oppo"]["trained_samples_per_s"]["median"] > 0
    # every measured step was journaled as it ended (what a run killed halfway keeps)
    journal = [json.loads(line) for line in (out / "short_steps.jsonl").read_text().splitlines()]
    assert journal == json.loads(json.dumps(data["workloads"]["short"]["records"], default=str))
    assert sorted(r["mode"] for r in journal) == ["oppo", "sequential"]
    for png in ("short_timeline.png", "short_reward.png"):
        assert (out / png).stat().st_size > 5000
