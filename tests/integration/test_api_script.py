"""The README's Python API example, run as a user runs it: saved as a script, `python script.py`.

SGLang spawns its scheduler processes, which re-import the script: without the
``if __name__ == "__main__":`` guard colocate exits with one line naming the fix before
anything starts; with it the same script trains (tiny models, 2 steps)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(r"## Python API\s+```python\n(.*?)```", text, re.S)
    assert block, "README has no Python API example"
    return block.group(1)


def without_guard(code: str) -> str:
    head, _, body = code.partition('if __name__ == "__main__":')
    assert body, "the README example shows no __main__ guard"
    lines = body.split("\n", 1)[1]
    return head + textwrap.dedent(lines)


def run(script: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_readme_example_without_the_guard_ends_with_one_line_naming_the_fix(tmp_path):
    script = tmp_path / "train_script.py"
    script.write_text(without_guard(readme_example()))
    done = run(script, tmp_path)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in lines[0] and "train_script.py" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started


@pytest.mark.slow
def test_readme_example_with_the_guard_trains(tmp_path, tiny_pair, run_overrides):
    models = tiny_pair("script", 3, 4)
    overrides = run_overrides(models, tmp_path / "run", "run.steps=2", "overlap.mode=oppo", "run.eval_every=0",
                              "rollout.max_new_tokens=8")
    code = readme_example().replace('["run.steps=10", "overlap.mode=oppo"]', repr(overrides))
    assert repr(overrides) in code, "the README example's overrides changed: update this test"
    script = tmp_path / "train_script.py"
    script.write_text(code)
    done = run(script, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps in" in done.stdout
    assert (tmp_path / "run" / "export").is_dir()


def test_readme_example_on_stdin_ends_with_one_line_before_any_engine_starts(tmp_path):
    """`python - < script.py` (or a here-document): spawn would re-run '<stdin>' in every
    scheduler; colocate refuses at once in one line naming the fix."""
    code = readme_example()
    done = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr[-3000:]
    assert "<stdin>" in lines[0] and "python script.py" in lines[0]
    assert not (tmp_path / "runs").exists()  # nothing started
