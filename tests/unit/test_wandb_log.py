"""W&B mirror: one-line errors when it cannot run, offline runs that hold the logged steps,
a resumed run that continues the same W&B run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from colocate.config import RunConfig
from colocate.errors import ConfigError
from colocate.monitor.wandb_log import ID_FILE, WandbRun, check_available


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch):
    """A home without a W&B login and no key in the environment."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(var, raising=False)


def offline_runs(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "wandb").glob("offline-run-*/run-*.wandb"))


def test_missing_package_is_a_one_line_error_naming_the_field(monkeypatch):
    check_available(RunConfig())  # W&B off: nothing to check
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for an absent package
    with pytest.raises(ConfigError, match=r"run\.wandb_project='p' needs the wandb package: pip install") as err:
        check_available(RunConfig(wandb_project="p"))
    assert "\n" not in str(err.value)


def test_online_without_a_login_is_a_one_line_error(tmp_path, no_wandb_credentials):
    with pytest.raises(ConfigError, match=r"run\.wandb_project: W&B could not start .*wandb_mode=offline") as err:
        WandbRun(RunConfig(wandb_project="p", wandb_mode="online"), tmp_path / "run", {}, resumed=False)
    assert "\n" not in str(err.value)


def test_offline_run_holds_steps_and_summary_and_resume_continues_it(tmp_path, no_wandb_credentials):
    run_cfg = RunConfig(wandb_project="colocate-test", wandb_mode="offline")
    out = tmp_path / "run"
    first = WandbRun(run_cfg, out, {"ppo": {"actor_lr": 2e-6}}, resumed=False)
    for step in (1, 2):
        first.log({"step": step, "reward_mean": 0.25 * step, "time/generate": 1.5, "mode": "sequential"})
    first.finish({"reward_last": 0.5})
    run_id = (out / ID_FILE).read_text().strip()
    assert first.id == run_id

    [written] = offline_runs(out)
    assert written.name == f"run-{run_id}.wandb"
    data = written.read_bytes()
    for key in (b"reward_mean", b"time/generate", b"reward_last", b"actor_lr"):
        assert key in data, key
    assert b"sequential" not in data  # only scalars are mirrored

    again = WandbRun(run_cfg, out, {}, resumed=True)
    again.log({"step": 3, "reward_mean": 0.9})
    again.finish({})
    assert again.id == run_id
    assert [p.name for p in offline_runs(out)] == [f"run-{run_id}.wandb"] * 2

    fresh = WandbRun(run_cfg, out, {}, resumed=False)  # a new run in the same folder: a new W&B run
    fresh.finish({})
    assert fresh.id != run_id
