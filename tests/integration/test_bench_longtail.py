"""`colocate bench` on the real long tail and the time-to-reward study, on the quick
preset's small models with very few steps (smoke: the pieces fit together)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from colocate.bench.contention import GuardOptions
from colocate.bench.models import eos_prone_actor
from colocate.bench.suite import peer_shape, run_peer
from colocate.bench.workloads import PRESETS
from colocate.cli import main

pytestmark = pytest.mark.slow


def test_reasoning_workload_ends_at_eos_in_every_mode(tmp_path):
    out = tmp_path / "bench"
    # fixed engine threads: both modes on one session (two engine starts instead of four); batch 4
    result = CliRunner().invoke(main, ["bench", "--quick", "--no-peer", "--repeats", "1", "--steps", "1",
                                       "--workloads", "reasoning", "--modes", "sequential,oppo", "--quiet-wait", "0",
                                       "--set", "engines.actor_threads=1", "--set", "engines.reward_threads=1",
                                       "--set", "rollout.batch_size=4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    work = json.loads((out / "results.json").read_text())["workloads"]["reasoning"]
    assert work["models"]["actor"].endswith("small-actor-eos32")  # the EOS-prone small actor
    records = work["records"]
    assert {r["mode"] for r in records} == {"sequential", "oppo"}
    assert all(0 < r["response_len"] < 128 for r in records)  # EOS decided, below the cap on average
    assert all("others_cores" in r and isinstance(r["contended"], bool) for r in records)
    report = (out / "report.md").read_text()
    assert "### workload `reasoning`" in report and "contention guard: other processes used" in report


def test_trl_peer_gets_the_reasoning_prompts_cap_and_eos_rule(tmp_path, tiny_actor_path, tiny_rm_path):
    preset = dataclasses.replace(PRESETS["quick"], batch_size=4, peer_updates=1, reasoning_tokens=32)
    actor = eos_prone_actor(tiny_actor_path, tmp_path, mean_tokens=8)
    tokens, eos = peer_shape(preset, "reasoning")
    peer = run_peer(actor, tiny_rm_path, preset, tmp_path / "trl", print, new_tokens=tokens, stop_at_eos=eos,
                    source=preset.source("reasoning"), guard=GuardOptions(quiet_wait_s=0))
    assert peer is not None, "TRL peer unavailable"
    assert peer["stop_at_eos"] and peer["source"] == "reasoning-gym:gsm_symbolic"
    assert peer["models"]["prompt_source"] == "reasoning-gym:gsm_symbolic"
    assert peer["settings"]["max_new_tokens"] == 32 and "others_cores" in peer["contention"]
    assert 0 < peer["response_tokens"][0] < 4 * 32  # EOS ended some responses before the cap


def test_convergence_plots_held_out_reward_against_training_seconds(tmp_path):
    out = tmp_path / "conv"
    # batch 4, 4 held-out prompts: the curve's points, not their values, are checked
    result = CliRunner().invoke(main, ["bench", "--quick", "--convergence", "--convergence-steps", "2",
                                       "--eval-every", "1", "--quiet-wait", "0", "--set", "rollout.batch_size=4",
                                       "--set", "data.eval_prompts=4", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())["convergence"]
    for mode in ("sequential", "oppo"):
        points = data["curves"][mode]
        assert [p["step"] for p in points] == [0, 1, 2] and points[0]["seconds"] == 0.0
        assert points[2]["seconds"] > points[1]["seconds"] > 0
        assert len(data["runs"][mode]["loads"]) == 2
    summary = data["summary"]
    assert summary["target"] == data["curves"]["sequential"][-1]["reward"]
    assert summary["modes"]["sequential"]["time_to_target_s"] is not None
    report = (out / "report.md").read_text()
    assert "### time to reward" in report and "| oppo | 2 |" in report
    assert (out / "convergence.png").stat().st_size > 5000
