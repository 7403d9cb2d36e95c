"""A user sees colocate's lines, not SGLang's start-up noise: `colocate doctor` and a 2-step
`colocate train` print none of SGLang's known-harmless import-time warnings (Triton / AWQ /
GGUF "not supported", from this process and the engines' children) nor the resource
tracker's leaked-semaphore note at exit — while any other warning still shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

NOISE = ("Triton is not supported", "Only CUDA", "support AWQ", "GGUF quantization", "resource_tracker",
         "Invalid -W option")


def _colocate(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colocate.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900)


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


@pytest.mark.slow
def test_doctor_prints_no_known_harmless_warnings(tmp_path):
    done = _colocate("doctor", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "smoke test" in done.stdout
    assert _noise(done.stdout + done.stderr) == []


@pytest.mark.slow
def test_two_step_train_prints_no_known_harmless_warnings(tmp_path, tiny_pair, run_overrides):
    models = tiny_pair("quiet", 7, 8)
    sets = [a for o in run_overrides(models, tmp_path / "run", "run.steps=2", "run.eval_every=0",
                                     "rollout.max_new_tokens=6") for a in ("--set", o)]
    done = _colocate("train", *sets, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps in" in done.stdout
    assert _noise(done.stdout + done.stderr) == []


def test_other_warnings_stay_visible(tmp_path):
    code = ("import warnings; from colocate.engine import sglang_api as s; s.prepare('cpu'); "
            "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.'); warnings.warn('a real one')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a real one" in done.stderr and "AWQ" not in done.stderr
