"""A user sees colocate's lines, not SGLang's start-up noise: `colocate doctor` and a 2-step
`colocate train` print none of SGLang's known-harmless import-time warnings (Triton / AWQ /
GGUF "not supported", from this process and the engines' children), SGLang's error-level
"Using custom SIGQUIT handler" line at each engine start, nor the resource
tracker's leaked-semaphore note at exit — while any other warning still shows.

Issue 40.5: at the default ``engines.log_level`` (error) `colocate train`, `export` and
`generate` draw none of the libraries' progress bars (transformers' "Loading weights" and
"Writing model shards", SGLang's scheduler's "Multi-thread loading shards") but one line per
thing loaded; a run whose ``engines.log_level`` is info keeps them. The three commands share
one 2-step run on the tiny models."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

NOISE = ("Triton is not supported", "Only CUDA", "support AWQ", "GGUF quantization", "resource_tracker",
         "Invalid -W option", "Using custom SIGQUIT handler")


def _colocate(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "colocate.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=900)


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(n in line for n in NOISE)]


# a tqdm bar: transformers' "Loading weights:  50%|█████     |", SGLang's "... 100% Completed | 1/1"
BAR = re.compile(r"\d+%( Completed)? ?\||Loading weights|Writing model shards|Multi-thread loading shards|"
                 r"checkpoint shards")


def _bars(text: str) -> list[str]:
    return [line for line in text.replace("\r", "\n").splitlines() if BAR.search(line)]


@pytest.mark.slow
def test_doctor_prints_no_known_harmless_warnings(tmp_path):
    done = _colocate("doctor", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "smoke test" in done.stdout
    from colocate.trainer.precision import auto_dtype, cpu_flags  # what auto trains in here, and why
    assert "{} ({})".format(*auto_dtype("cpu", cpu_flags())) in done.stdout
    assert _noise(done.stdout + done.stderr) == []
    assert _bars(done.stdout + done.stderr) == []  # the smoke engine's scheduler too


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory, tiny_pair, run_overrides):
    """`colocate train` of 2 steps on the tiny models at the default engines.log_level -> (its
    completed process, its run folder)."""
    root = tmp_path_factory.mktemp("quiet")
    models = tiny_pair("quiet", 7, 8)
    sets = [a for o in run_overrides(models, root / "run", "run.steps=2", "run.eval_every=0",
                                     "rollout.max_new_tokens=6") for a in ("--set", o)]
    return _colocate("train", *sets, cwd=root), root / "run"


@pytest.mark.slow
def test_two_step_train_prints_no_known_harmless_warnings(two_step_run):
    done, _ = two_step_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 steps in" in done.stdout
    assert _noise(done.stdout + done.stderr) == []


@pytest.mark.slow
def test_train_draws_no_loading_bars_but_one_line_each(two_step_run):
    done, _ = two_step_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert _bars(done.stdout + done.stderr) == []  # trainer's from_pretrained x3, both engines' schedulers
    assert "engines up: actor" in done.stdout
    assert re.search(r"trainer loaded: actor \S+, reference \S+, critic \S+ params in [\d.]+ s", done.stdout)


@pytest.mark.slow
def test_export_draws_no_bars_at_the_default_log_level(two_step_run, tmp_path):
    _, run = two_step_run
    done = _colocate("export", str(run), "--out", str(tmp_path / "actor"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(tmp_path / "actor")  # stdout stays the result
    assert _bars(done.stderr) == []
    assert re.search(r"actor of step_\d+ loaded: \S+ params in [\d.]+ s", done.stderr)
    assert re.search(r"actor written: [\d.]+ MB in [\d.]+ s", done.stderr)


@pytest.mark.slow
def test_a_run_at_log_level_info_keeps_the_bars(two_step_run, tmp_path):
    """`colocate generate RUN` (export + engine) under the run's engines.log_level=info: the
    bars of transformers (load, write) and of SGLang's scheduler stay, beside the lines."""
    _, run = two_step_run
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["engines"]["log_level"] = "info"
    (copy / "config.json").write_text(json.dumps(cfg))
    done = _colocate("generate", str(copy), "--prompt", "hi", "--max-new-tokens", "4", "--device", "cpu",
                     "--jsonl", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    bars = "\n".join(_bars(done.stderr))
    for desc in ("Loading weights", "Writing model shards", "% Completed |"):  # the last: SGLang's BAR_FORMAT
        assert desc in bars, (desc, done.stderr[-3000:])
    assert "actor engine up: actor_step_" in done.stderr
    assert [json.loads(line)["prompt"] for line in done.stdout.splitlines()] == ["hi"]


def test_other_warnings_stay_visible(tmp_path):
    code = ("import warnings; from colocate.engine import sglang_api as s; s.prepare('cpu'); "
            "warnings.warn('Only CUDA, HIP and XPU support AWQ currently.'); warnings.warn('a real one')")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "a real one" in done.stderr and "AWQ" not in done.stderr
