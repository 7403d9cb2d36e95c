"""Item 1 of issue 50: a second run on a run folder that holds a run is refused in one line
and changes nothing of it; `run.overwrite_out_dir=true` replaces it; a folder another
process runs in is refused in one line (an OS lock, gone with the process that held it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from colocate import api
from colocate.cli import main
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.run import checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = ("run.steps=1", "run.eval_every=0", "rollout.max_new_tokens=6", "run.save_every=1")
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)


def _records_line(out: Path, names: str) -> str:
    return (f"run.out_dir '{out}' already holds a run ({names}); continue it with --resume {out}, start a new one "
            "elsewhere with --set run.out_dir=<another folder>, or replace it with --set run.overwrite_out_dir=true")


def _busy_line(out: Path, pid: int) -> str:
    return (f"run.out_dir '{out}' is in use by another run (process {pid}); wait for it to end, or start this one "
            "elsewhere with --set run.out_dir=<another folder>")


def _files(out: Path) -> dict[str, bytes]:
    """Every file of a run folder (but its lock) and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.fixture(scope="module")
def models(tiny_pair):
    return tiny_pair("ppo", 0, 2)  # test_engine_pool's pair: the suite's engines for it are kept


@pytest.mark.slow
def test_a_second_run_is_refused_in_one_line_and_the_first_run_is_kept_byte_for_byte(models, run_overrides,
                                                                                     engine_pool, tmp_path):
    out = tmp_path / "run"
    sets = run_overrides(models, out, *TINY)
    api.train(load_config(overrides=sets), quiet=True, engines=engine_pool)
    before = _files(out)
    assert {"config.json", "metrics.jsonl", "checkpoints/step_00000001/manifest.json"} <= set(before)
    names = ", ".join(n for n in ("config.json", "metrics.jsonl", "samples.jsonl", "checkpoints", "tb")
                      if (out / n).exists())
    with pytest.raises(ConfigError) as refused:  # the API: no engine started, nothing written
        api.train(load_config(overrides=sets), quiet=True, engines=engine_pool)
    assert str(refused.value) == _records_line(out, names)
    cli = CliRunner().invoke(main, ["train", *(a for o in sets for a in ("--set", o))])
    assert cli.exit_code == 2 and cli.output == f"error: {_records_line(out, names)}\n"
    check = CliRunner().invoke(main, ["train", *(a for o in sets for a in ("--set", o)), "--check"])
    assert check.exit_code == 2 and check.output == f"error: {_records_line(out, names)}\n"
    assert _files(out) == before  # metrics.jsonl, config.json, checkpoints: unchanged
    checkpoint.load(checkpoint.latest(out))  # still verifies
    from colocate.run import run_folder  # (here: the unchanged code of issue 50 has no such module)

    run_folder.check(load_config(overrides=[*sets, "run.steps=2"]), resume=out)  # --resume of it: allowed


@pytest.mark.slow
def test_overwrite_out_dir_replaces_the_earlier_run_and_keeps_other_files(models, run_overrides, engine_pool,
                                                                          tmp_path):
    out = tmp_path / "run"
    api.train(load_config(overrides=run_overrides(models, out, *TINY, "ppo.epochs=1")), quiet=True, engines=engine_pool)
    (out / "notes.txt").write_text("mine")
    (out / "checkpoints" / "step_00000007").mkdir()  # a later checkpoint of the earlier run: must not survive
    again = run_overrides(models, out, *TINY, "run.overwrite_out_dir=true")
    summary = api.train(load_config(overrides=again), quiet=True, engines=engine_pool)
    assert summary.steps == 1
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((out / "config.json").read_text())["ppo"]["epochs"] == 2  # the new run's
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    assert (out / "notes.txt").read_text() == "mine"


HOLD = """
import sys, time
from colocate.config import load_config
from colocate.run import run_folder
held = run_folder.claim(load_config(overrides=[f"run.out_dir={sys.argv[1]}"]))
print("held", flush=True)
time.sleep(600)
"""


def test_a_folder_held_by_a_run_refuses_another_process_and_is_free_once_it_dies(tmp_path, tiny_actor_path,
                                                                                 tiny_rm_path, run_overrides):
    from colocate.run import run_folder

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        sets = run_overrides((tiny_actor_path, tiny_rm_path), out, *TINY)
        second = subprocess.run([sys.executable, "-m", "colocate.cli", "train", *(a for o in sets for a in ("--set", o))],
                                cwd=str(ROOT), capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert [line for line in second.stderr.splitlines() if line.strip()] == [f"error: {_busy_line(out, holder.pid)}"]
        assert sorted(p.name for p in out.iterdir()) == [".lock"]  # the second wrote nothing
        with pytest.raises(ConfigError) as refused:  # in this process too
            run_folder.claim(load_config(overrides=sets))
        assert str(refused.value) == _busy_line(out, holder.pid)
    finally:
        holder.send_signal(signal.SIGKILL)  # the lock goes with the process: nothing stale to clear
        holder.wait(timeout=30)
    folder = run_folder.claim(load_config(overrides=run_overrides((tiny_actor_path, tiny_rm_path), out, *TINY)))
    try:
        with pytest.raises(ConfigError) as again:  # one run of this process holds it: a second one here is refused
            run_folder.claim(load_config(overrides=run_overrides((tiny_actor_path, tiny_rm_path), out, *TINY)))
        assert str(again.value) == _busy_line(out, os.getpid()).replace(")", ", this one)", 1)
    finally:
        folder.release()


@pytest.mark.parametrize("where, why", [
    ("/proc/colocate-run", "No such file or directory (making it in '/proc')"),
    ("{tmp}/a-file/run", "Not a directory (making it in '{tmp}/a-file')"),
])
def test_check_refuses_a_folder_that_cannot_be_made_as_the_run_would(models, tmp_path, where, why):
    """`colocate train --check` said "check ok" for these, and the run then refused them."""
    (tmp_path / "a-file").write_text("not a folder")
    out = where.format(tmp=tmp_path)
    result = CliRunner().invoke(main, ["train", "--check", "--set", f"models.actor={models[0]}", "--set",
                                       f"models.reward={models[1]}", "--set", f"run.out_dir={out}"])
    assert result.exit_code == 2, result.output[-3000:]
    assert result.output.strip() == f"error: run.out_dir '{out}' cannot be written: {why.format(tmp=tmp_path)}"
    fine = tmp_path / "new" / "run"  # made by the run, not by the check
    result = CliRunner().invoke(main, ["train", "--check", "--set", f"models.actor={models[0]}", "--set",
                                       f"models.reward={models[1]}", "--set", f"run.out_dir={fine}"])
    assert result.exit_code == 0 and not fine.parent.exists() and not list(tmp_path.glob(".colocate-check-*"))
