"""The TRL peers of the bench (`bench.peers.trl_ppo`, `bench.peers.trl_grpo`), run as the bench runs them:
their CLI in a subprocess."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODULE = "colocate.bench.peers.trl_ppo"
GRPO = "colocate.bench.peers.trl_grpo"


def _cli(*args: str, prelude: str = "", module: str = MODULE) -> list[str]:
    """The peer's CLI; `prelude` runs first in the child (e.g. to hide trl)."""
    run = (f"{prelude}import runpy, sys; sys.argv = ['{module}', *sys.argv[1:]]; "
           f"runpy.run_module('{module}', run_name='__main__')")
    return [sys.executable, "-c", run, *args]


@pytest.mark.slow
def test_two_updates_on_tiny_models(tmp_path, tiny_actor_path, tiny_rm_path):
    # scripts/install.sh installs the bench extra (trl==1.12.0): a missing peer is a failure
    assert importlib.util.find_spec("trl.experimental.ppo") is not None, "pip install 'colocate[bench]'"
    out = tmp_path / "trl"
    cmd = [sys.executable, "-m", MODULE, "--actor", tiny_actor_path, "--reward", tiny_rm_path, "--batch", "4",
           "--new-tokens", "8", "--updates", "2", "--threads", "2", "--out", str(out), "--bf16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "trl_result.json").read_text())
    assert result["updates"] == 2
    assert len(result["update_seconds"]) == 2 and all(s > 0 for s in result["update_seconds"])
    assert result["trained_samples_per_s"] > 0 and result["response_tokens_per_s"] > 0
    assert len(result["reward_mean_per_update"]) == 2
    assert all(isinstance(r, float) for r in result["reward_mean_per_update"])
    assert all(0 < n <= 4 * 8 for n in result["response_tokens"])
    for i, seconds in enumerate(result["update_seconds"]):  # the phases of an update add up to it
        assert sum(p[i] for p in result["phase_seconds"].values()) == pytest.approx(seconds, rel=1e-6)
    assert result["trl_version"] == "1.12.0" and result["settings"]["pad_token"] != "<|im_end|>"
    # --bf16: TRL's PPO builds its own Accelerator; its forwards autocast in bf16 all the same
    assert result["settings"]["dtype"] == "bfloat16" and result["settings"]["mixed_precision"] == "bf16"


def test_missing_trl_is_one_line_with_the_install_hint(tmp_path, tiny_actor_path, tiny_rm_path):
    cmd = _cli("--actor", tiny_actor_path, "--reward", tiny_rm_path, "--batch", "4", "--updates", "1",
               "--out", str(tmp_path), prelude="import sys; sys.modules['trl'] = None; ")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'colocate[bench]'" in lines[0], proc.stderr
    assert not (tmp_path / "trl_result.json").exists()


@pytest.mark.slow
def test_grpo_peer_two_updates_of_groups_on_tiny_models(tmp_path, tiny_actor_path, tiny_rm_path):
    assert importlib.util.find_spec("trl") is not None, "pip install 'colocate[bench]'"
    out = tmp_path / "grpo"
    cmd = [sys.executable, "-m", GRPO, "--actor", tiny_actor_path, "--reward", tiny_rm_path, "--batch", "4",
           "--group-size", "2", "--new-tokens", "8", "--updates", "2", "--threads", "2", "--out", str(out), "--bf16"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "trl_result.json").read_text())
    assert result["trainer"] == "grpo" and result["group_size"] == 2 and result["trl_version"] == "1.12.0"
    assert result["updates"] == 2 and len(result["warmup_update_seconds"]) == 1
    assert len(result["update_seconds"]) == 2 and all(s > 0 for s in result["update_seconds"])
    assert result["trained_samples_per_s"] > 0 and result["response_tokens_per_s"] > 0
    # trained samples per update == batch: 2 prompts x 2 completions, every one run to the cap (no --stop-at-eos)
    assert result["response_tokens"] == [4 * 8, 4 * 8]
    assert result["trained_samples_per_s"] == pytest.approx(statistics.median(4 / s for s in result["update_seconds"]))
    assert len(result["reward_mean_per_update"]) == 2
    assert all(isinstance(r, float) for r in result["reward_mean_per_update"])
    assert set(result["phase_seconds"]) == {"generate", "old_logp", "ref", "reward", "other", "train"}
    for i, seconds in enumerate(result["update_seconds"]):  # the phases of an update add up to it
        assert sum(p[i] for p in result["phase_seconds"].values()) == pytest.approx(seconds, rel=1e-6)
        assert all(result["phase_seconds"][p][i] > 0 for p in ("generate", "old_logp", "ref", "reward", "train"))
    settings = result["settings"]
    assert settings["pad_token"] != "<|im_end|>" and settings["beta"] == 0.05  # colocate's default ppo.kl_coef
    assert (settings["batch_size"], settings["group_size"], settings["minibatches"]) == (4, 2, 2)
    assert settings["bf16"] and settings["dtype"] == "bfloat16"  # --bf16: TRL's bf16=True, as colocate's bf16 trainer
    assert settings["mixed_precision"] == "bf16"  # what accelerate autocasts the forwards in


def test_grpo_peer_micro_batches_keep_the_batch_and_one_optimizer_step_per_minibatch(tmp_path, tiny_actor_path,
                                                                                    tiny_rm_path):
    """The GPU bench's peer passes forward passes of what fits colocate's micro-batch tokens
    (TRL's GRPO ran out of memory on whole minibatches on an H100): 2-sample passes accumulate
    into each 4-sample minibatch's one optimizer step, and an update still trains the batch."""
    out = tmp_path / "grpo-micro"
    cmd = [sys.executable, "-m", GRPO, "--actor", tiny_actor_path, "--reward", tiny_rm_path, "--batch", "8",
           "--group-size", "2", "--new-tokens", "4", "--updates", "2", "--threads", "2", "--micro-batch", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "trl_result.json").read_text())
    assert result["updates"] == 2 and result["response_tokens"] == [8 * 4, 8 * 4]
    assert (result["settings"]["micro_batch"], result["settings"]["minibatches"]) == (2, 2)
    from colocate.bench.peers.trl_grpo import GrpoSettings

    s = GrpoSettings(batch_size=8, group_size=2, minibatches=2, micro_batch=2)
    assert (s.micro, s.accumulation) == (2, 2)
    with pytest.raises(ValueError, match=r"micro_batch \(3\) >= 0 dividing a minibatch \(4 samples\)"):
        GrpoSettings(batch_size=8, group_size=2, minibatches=2, micro_batch=3).check()


def test_grpo_peer_without_trl_is_one_line_with_the_install_hint(tmp_path, tiny_actor_path, tiny_rm_path):
    cmd = _cli("--actor", tiny_actor_path, "--reward", tiny_rm_path, "--batch", "4", "--group-size", "2",
               "--updates", "1", "--out", str(tmp_path), prelude="import sys; sys.modules['trl'] = None; ",
               module=GRPO)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'colocate[bench]'" in lines[0] and "GRPOTrainer" in lines[0], proc.stderr
    assert not (tmp_path / "trl_result.json").exists()
