"""The GPU check of the engine path (scripts/gpu_engine_check.sh) keeps working on CPU: its
wiring end to end (every stage invoked, what comes back written, on a spent budget so no
engine starts), and its loop parts on the suite's shared engines (``engine_pool``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colocate.bench import loop_check

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_the_check_script_runs_every_stage_and_writes_what_comes_back(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DEVICE": "cpu", "GPU_CHECK_S": "0", "OUT": str(out)}
    proc = subprocess.run(["bash", "scripts/gpu_engine_check.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (out / "log.txt").read_text()
    assert "== probe" in log and "== loop check, attention torch_native" in log and "loop check rc 0" in log
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


def test_the_kits_xgrammar_stand_in_lets_sglangs_detokenizer_import_its_tool_parsers(tmp_path):
    """Found on an H100 (the image has no xgrammar): SGLang's detokenizer process imports
    every tool-call detector at start, some of which import xgrammar, and died. The kit's
    import-only stand-in (scripts/gpu_kit/overlay/xgrammar) must satisfy those imports,
    pydantic's schema of ``StructuralTag`` included, with the real xgrammar out of reach."""
    (tmp_path / "xgrammar").symlink_to(ROOT / "scripts/gpu_kit/overlay/xgrammar")
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from colocate.engine import sglang_api; sglang_api.prepare('cpu'); "
            "import xgrammar; assert xgrammar.__file__.startswith(sys.argv[1]), xgrammar.__file__; "
            "import sglang.srt.managers.detokenizer_manager; "
            "from sglang.srt.parser.response_template import tool_close_token_ids; "
            "print('closers', sorted(tool_close_token_ids(None, None)))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "closers []" in proc.stdout
