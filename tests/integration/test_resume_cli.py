"""`colocate train --resume DIR` continues that run: a run with non-default settings (oppo,
LoRA with activation checkpointing, rollout log-probs) killed with SIGKILL resumes from its
last checkpoint with its own config.json and exports merged and as a PEFT adapter; another actor is
refused in one line; a checkpoint of another model is refused in one line, not torch's traceback."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as torch_dist

from colocate.run import builder, checkpoint, resume
from colocate.run.checkpoint import CheckpointError
from colocate.config import load_config
from colocate.trainer.distributed import init_distributed

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("overlap.mode=oppo", "run.save_every=2", "rollout.temperature=0", "run.steps=4", "run.eval_every=0",
            "rollout.max_new_tokens=16", "overlap.chunk_size=8", "ppo.epochs=1",
            "lora.rank=4", "ppo.actor_lr=1e-3", "ppo.gradient_checkpointing=true", "ppo.old_logp=rollout")


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("resume", 11, 12)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "colocate.cli", "train", *args]


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _kill_after_first_checkpoint(proc: subprocess.Popen, out: Path, log: Path) -> None:
    """SIGKILL the training process once a checkpoint exists (its engines' processes after it)."""
    deadline = time.monotonic() + 400
    while not list((out / "checkpoints").glob("step_*/manifest.json")):
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint after 400 s"
        time.sleep(0.1)
    children = psutil.Process(proc.pid).children(recursive=True)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=15)  # orphaned engine schedulers exit on their own
    for child in alive:
        child.kill()


@pytest.mark.slow
def test_killed_run_resumes_with_its_own_settings(models, run_overrides, tmp_path):
    out = tmp_path / "run"
    sets = [arg for o in run_overrides(models, out, *SETTINGS) for arg in ("--set", o)]
    log = tmp_path / "first.log"
    with log.open("w") as f:
        proc = subprocess.Popen(_cli(*sets), cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT)
        _kill_after_first_checkpoint(proc, out, log)
    saved = json.loads((out / "config.json").read_text())
    killed_at, _ = checkpoint.load(checkpoint.latest(out))
    assert 2 <= killed_at < 4

    done = subprocess.run(_cli("--resume", str(out)), cwd=str(ROOT), capture_output=True, text=True, timeout=500)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    assert f"resumed from step {killed_at}" in text and "resume: changed" not in text
    assert json.loads((out / "config.json").read_text()) == saved  # the run's own settings, oppo included
    assert _steps(out) == [1, 2, 3, 4]  # records after the checkpoint were replaced, none lost
    final, parts = checkpoint.load(checkpoint.latest(out))
    assert final == 4 and parts["rollout"]["ranks"][0] is not None  # still the oppo run: its deferred buffer is checkpointed
    assert checkpoint.manifest(checkpoint.latest(out))["meta"]["models"]["actor"] == models[0]
    actor_state = parts["trainer"]["actor"]["model"]
    assert actor_state and all(".lora_" in name for name in actor_state)  # adapters only, not the frozen base
    pushed = [json.loads(line)["sync/pushed_mb"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 0 < pushed[0] == pushed[-1]

    exported = subprocess.run([sys.executable, "-m", "colocate.cli", "export", str(out), "--adapter",
                               str(tmp_path / "adapter")], cwd=str(ROOT), capture_output=True, text=True, timeout=300)
    assert exported.returncode == 0, exported.stderr[-3000:]
    merged_dir = Path(exported.stdout.splitlines()[0])
    assert (merged_dir / "model.safetensors").is_file() and (tmp_path / "adapter" / "adapter_config.json").is_file()

    other = subprocess.run(_cli("--resume", str(out), "--set", "run.steps=8", "--set", f"models.actor={models[1]}"),
                           cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert other.returncode == 2, other.stdout + other.stderr
    err = other.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: models.actor cannot change"), other.stderr
    assert models[0] in err[0] and models[1] in err[0]


@pytest.fixture
def world1():
    created = not torch_dist.is_initialized()
    yield init_distributed("cpu")
    if created and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def test_checkpoint_of_another_architecture_is_one_line(world1, tiny_actor_path, tiny_qwen_path, tmp_path):
    def trainer(path):
        cfg = load_config(overrides=[f"models.actor={path}"])
        return cfg, builder.make_trainer(cfg, path, path, world1)

    def live(t):  # as Session.restore measures them: FSDP's DTensors, global shapes
        return {part: resume.shapes(getattr(t, part).state_dict()) for part in ("actor", "critic")}

    llama_cfg, llama = trainer(tiny_actor_path)
    where = checkpoint.save(tmp_path / "checkpoints", 3, {"trainer": llama.state_dict()},
                            meta={"models": dataclasses.asdict(llama_cfg.models)})
    _, parts = checkpoint.load(where)
    resume.check_checkpoint(where, parts, live(llama), llama_cfg)  # its own checkpoint fits
    qwen_cfg, qwen = trainer(tiny_qwen_path)
    with pytest.raises(CheckpointError) as e:
        resume.check_checkpoint(where, parts, live(qwen), qwen_cfg)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"holds the actor '{tiny_actor_path}'" in msg and f"models.actor is '{tiny_qwen_path}'" in msg
