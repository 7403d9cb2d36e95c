"""Installing colocate claims no global module names: engine/, trainer/ and bench/ land
under the colocate namespace (a real, non-editable `pip install` of the project's files)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_pip_install_adds_only_the_colocate_package(tmp_path):
    src = tmp_path / "src"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    top = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", ".egg-info")))
    assert top == ["bin", "colocate"] or top == ["colocate"], top
    for sub in ("engine/runtime.py", "trainer/ppo_trainer.py", "bench/suite.py", "bench/peers/trl_ppo.py",
                "engine/cpu_kernel/sgl_kernel/__init__.py", "run/builder.py", "rollout/rollouts.py",
                "monitor/metrics.py", "assets/tasks.py", "tools/export.py",  # colocate/'s rooms too
                "data/sentiment_prompts.json"):  # the default task's prompts
        assert (target / "colocate" / sub).is_file(), sub
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import colocate.engine.runtime, colocate.trainer.batch; "
            "import importlib.util as u; print([n for n in ('engine', 'trainer', 'bench') if u.find_spec(n)])")
    probe = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == "[]"
