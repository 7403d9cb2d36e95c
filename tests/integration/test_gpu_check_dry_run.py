"""The GPU check of the engine path (scripts/gpu_engine_check.sh) keeps working on CPU: its
wiring end to end (every stage invoked, what comes back written, on a spent budget so no
engine starts), and its loop parts on the suite's shared engines (``engine_pool``). The GPU
bench (scripts/gpu_bench.sh, issue 53) too: its CPU dry run on tiny shapes writes the report
with every mode's row and the TRL peer's line, and a spent budget leaves workloads out by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from colocate.bench import loop_check
from colocate.engine.engine_config import default_attention_backend

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)


def test_the_check_script_runs_every_stage_and_writes_what_comes_back(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "GPU_CHECK_S": "0", "OUT": str(out)}
    proc = subprocess.run(["bash", "scripts/gpu_engine_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (out / "log.txt").read_text()
    attn = default_attention_backend("cpu", False)  # colocate's own rule on CPU: colocate_cpu where SGLang runs the plugin
    assert "== probe" in log and f"== loop check, attention {attn}" in log and "loop check rc 0" in log
    probe = json.loads((out / "probe.json").read_text())
    assert [s["step"] for s in probe["steps"]] == ["device", "make_models", "done"]  # no backend: no budget
    assert probe["steps"][1]["ok"] is True
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["parts"]) == {name for name, _ in loop_check.PARTS}
    assert all(p["ok"] is None and "skipped" in p for p in summary["parts"].values())


def test_loop_check_parts_run_on_shared_engines_and_report_each_step(tmp_path, tiny_pair, run_overrides,
                                                                     engine_pool):
    common = [o for o in run_overrides(tiny_pair("ppo", 0, 2), tmp_path)
              if not o.startswith("run.out_dir")] + ["run.steps=1", "run.eval_every=0", "run.save_every=0"]
    report = {"parts": {}}
    loop_check.run_parts(["sequential", "grpo"], common, tmp_path, engine_pool, report,
                         deadline=time.monotonic() + 600, need_s=0)
    assert json.loads((tmp_path / "summary.json").read_text()) == report
    for name in ("sequential", "grpo"):
        part = report["parts"][name]
        assert part["ok"] is True, part.get("traceback")
        (step,) = part["steps"]
        assert step["trained_samples"] == 4 and step["weight_version"] == 1
        assert step["sync/push_s"] > 0 and step["time/generate"] > 0  # the push timed on its own
        assert not any(k.startswith("gpu/") for k in step)  # CPU: no device readings
        assert (tmp_path / name / "metrics.jsonl").is_file()
    assert "time/critic" not in report["parts"]["grpo"]["steps"][0]  # critic-free
    assert (tmp_path / "sequential" / "checkpoints").is_dir()  # the part that checkpoints did
    # a spent budget skips a part and says so; an unknown one is refused by name
    loop_check.run_parts(["oppo"], common, tmp_path, engine_pool, report, deadline=time.monotonic(), need_s=5)
    assert report["parts"]["oppo"]["ok"] is None and report["parts"]["oppo"]["skipped"].endswith("s left")
    with pytest.raises(SystemExit, match="unknown nope"):
        loop_check.run_parts(["nope"], common, tmp_path, engine_pool, report, deadline=0, need_s=0)


def _with_stand_in(tmp_path, name: str, code: str, timeout: int) -> str:
    """Run ``code`` in a fresh interpreter with the kit's stand-in ``name`` first on the path
    (``sys.argv[1]``: the folder holding it); its stdout, after checking it exited cleanly."""
    (tmp_path / name).symlink_to(ROOT / "scripts/gpu_kit/overlay" / name)
    code = (f"import sys; sys.path.insert(0, sys.argv[1]); import {name}; "
            f"assert {name}.__file__.startswith(sys.argv[1]), {name}.__file__; " + code)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_the_kits_xgrammar_stand_in_lets_sglangs_detokenizer_import_its_tool_parsers(tmp_path):
    """Found on an H100 (the image has no xgrammar): SGLang's detokenizer process imports
    every tool-call detector at start, some of which import xgrammar, and died. The kit's
    import-only stand-in (scripts/gpu_kit/overlay/xgrammar) must satisfy those imports,
    pydantic's schema of ``StructuralTag`` included, with the real xgrammar out of reach."""
    out = _with_stand_in(tmp_path, "xgrammar", "from colocate.engine import sglang_api; sglang_api.prepare('cpu'); "
                         "import sglang.srt.managers.detokenizer_manager; "
                         "from sglang.srt.parser.response_template import tool_close_token_ids; "
                         "print('closers', sorted(tool_close_token_ids(None, None)))", timeout=300)
    assert "closers []" in out


def _gpu_bench(tmp_path, **env):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_bench.sh"], cwd=ROOT, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "DEVICE": "cpu", "OUT": str(out), **env})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out, (out / "log.txt").read_text()


def test_the_gpu_bench_dry_run_reports_every_mode_and_the_trl_grpo_peer(tmp_path):
    out, log = _gpu_bench(tmp_path, WORKLOADS="longtail-grpo", STEPS="1", BATCH="8", TOKENS="16")
    assert f"attention {default_attention_backend('cpu', False)} (colocate's rule)" in log and "bench rc 0" in log
    report = (out / "report.md").read_text()
    assert "# colocate bench — preset `gpu`" in report and "no vLLM" in report and "response tokens/s" in report
    for mode in ("sequential", "oppo", "intra", "inter", "auto"):
        assert f"\n| {mode} | " in report, mode
    assert "TRL GRPO (trl " in report and "groups of 4" in report and "oppo / TRL = " in report
    results = json.loads((out / "results.json").read_text())
    summary = results["workloads"]["longtail-grpo"]["summary"]
    assert set(summary) == {"sequential", "oppo", "intra", "inter", "auto"}
    assert results["preset"]["models"] == "tiny" and results["preset"]["batch_size"] == 8
    assert results["workloads"]["longtail-grpo"]["left_out"] == []
    # a device call returns at most 8 files: the journals, request logs, plots and peers travel in bench.tgz
    assert len(list(out.iterdir())) <= 8, sorted(p.name for p in out.iterdir())
    with tarfile.open(out / "bench.tgz") as tar:
        names = set(tar.getnames())
        steps = [json.loads(line) for line in tar.extractfile("longtail-grpo_steps.jsonl").read().splitlines()]
    assert sorted(r["mode"] for r in steps) == sorted(summary) and all(r["trained_samples"] == 8 for r in steps)
    assert "trl-grpo4-16.json" in names and (out / "gpu_steps.tsv").read_text().count("\n") == 5


def test_a_spent_gpu_bench_budget_leaves_the_workloads_out_by_name_and_still_writes_the_report(tmp_path):
    out, log = _gpu_bench(tmp_path, GPU_BENCH_S="40", BATCH="8", TOKENS="16")  # the bench gets 30 s: none fits
    report = (out / "report.md").read_text()
    for workload in ("longtail-grpo", "longtail"):
        assert f"workload {workload}: left out" in log
        assert f"### workload `{workload}`\n\nLeft out: the 30 s budget was spent." in report


def test_under_a_deadline_the_first_two_modes_run_and_later_ones_keep_the_peers_reserve(tmp_path, tiny_pair,
                                                                                       run_overrides, engine_pool):
    """The GPU bench's order of worth (bench.runner.run_workload): sequential and oppo start
    while the deadline allows; from the third (mode, repeat) on, the workload's TRL peer's
    reserve is kept free, so a mode that would eat into it is left out and listed (the tiny
    models' sessions: one for all four modes, their engine threads fixed)."""
    from colocate.bench import runner
    from colocate.config import load_config

    cfg = load_config(overrides=run_overrides(tiny_pair("ppo", 0, 2), tmp_path, "rollout.max_new_tokens=8",
                                              "run.eval_every=0", "engines.actor_threads=1",
                                              "engines.reward_threads=1"))
    data = runner.run_workload(cfg, ["sequential", "oppo", "intra", "inter"], 1, 2, lambda m: None,
                               deadline=time.monotonic() + 3600, reserve_s=1e6)
    assert [r["mode"] for r in data["records"]] == ["sequential", "sequential", "oppo", "oppo"]
    assert data["left_out"] == [{"mode": "intra", "repeat": 0}, {"mode": "inter", "repeat": 0}]


def test_the_kits_ipython_stand_in_lets_the_bench_draw_its_plots(tmp_path):
    """Found on an H100: SGLang imports the kit's import-only IPython, and matplotlib, finding
    it imported, read ``IPython.version_info`` as a figure was made and called
    ``get_ipython()`` in pyplot: the GPU bench died drawing its first plot, before its report
    was written. With the stand-in first on the path the bench's three plots are drawn."""
    _with_stand_in(tmp_path, "IPython", "from pathlib import Path; "
                   "from colocate.bench import plots, requests; out = Path(sys.argv[1]); "
                   "rec = [{'mode': 'sequential', 'repeat': 0, 'step_s': 2.0, 'wall_s': 2.0, 'reward_mean': 0.5, "
                   "'time/generate': 1.5, 'time/actor': 0.5}]; "
                   "plots.gantt(rec, ['sequential'], out / 'g.png', 't'); "
                   "plots.reward_curve(rec, ['sequential'], out / 'r.png', 't'); "
                   "ev = [dict(t=0.0, event='rollout', index=-1), dict(t=0.1, event='launch', index=0, prior=0), "
                   "dict(t=0.2, event='first_token', index=0), dict(t=1.0, event='end', index=0), "
                   "dict(t=1.2, event='trained', index=0), dict(t=1.2, event='rollout_end', index=-1)]; "
                   "ev = [dict(e, step=1, mode='sequential', repeat=0) for e in ev]; "
                   "print(requests.plot(ev, ['sequential'], out / 'q.png', 't'))", timeout=120)
    for name in ("g.png", "r.png", "q.png"):
        assert (tmp_path / name).stat().st_size > 1000, name
