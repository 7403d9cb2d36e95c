"""Issue 40.5, the switches: which ``engines.log_level`` keeps the libraries' progress bars, the
one line that replaces them, the CLI's turning off of transformers' bars (in a process of its
own), and the spawn-time variable that keeps a bar SGLang draws with an explicit
``disable=False`` from ever showing in a child process (the integration test,
tests/integration/test_quiet_start.py, runs the real commands)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from colocate.engine import sglang_api
from colocate.monitor.quiet import count, loaded
from colocate.tools.export import log_level_of


@pytest.mark.parametrize("level,shown", [("debug", True), ("info", True), ("INFO", True), ("warning", False),
                                         ("error", False), ("critical", False), ("nonsense", False)])
def test_only_info_and_debug_show_the_bars(level, shown):
    assert sglang_api.shows_progress(level) is shown


def test_the_line_names_what_loaded_its_size_and_time():
    assert count(134_515_008) == "135M" and count(30_212) == "30.2K" and count(7) == "7"
    assert count(1_544_000_000) == "1.54B"
    assert loaded("actor", 134_515_008, 1.23) == "actor loaded: 135M params in 1.2 s"
    assert (loaded("trainer", {"actor": 134_515_008, "critic": 134_515_009}, 5.06)
            == "trainer loaded: actor 135M, critic 135M params in 5.1 s")


def test_the_spawn_variable_is_set_for_the_block_only(monkeypatch):
    monkeypatch.delenv("TQDM_DELAY", raising=False)
    with sglang_api.child_progress_bars(shown=False):
        assert os.environ["TQDM_DELAY"] == "inf"
    assert "TQDM_DELAY" not in os.environ
    with sglang_api.child_progress_bars(shown=True):
        assert "TQDM_DELAY" not in os.environ
    monkeypatch.setenv("TQDM_DELAY", "2")
    with sglang_api.child_progress_bars(shown=False):
        assert os.environ["TQDM_DELAY"] == "inf"
    assert os.environ["TQDM_DELAY"] == "2"


# as SGLang's weight_utils draws it in its scheduler: tqdm.auto, disable= passed explicitly, a bar_format
SGLANG_LIKE_BAR = ("from tqdm.auto import tqdm\n"
                   "with tqdm(total=2, desc='Multi-thread loading shards', disable=False,"
                   " bar_format='{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt}') as bar:\n"
                   "    bar.update(1); bar.update(1)\n")


def _child_stderr(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", SGLANG_LIKE_BAR], env=dict(os.environ) | env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_a_child_started_with_bars_off_draws_none_even_with_disable_false(monkeypatch):
    for name in [k for k in os.environ if k.startswith("TQDM_")]:
        monkeypatch.delenv(name)
    assert "Multi-thread loading shards" in _child_stderr()
    assert "Multi-thread loading shards" in _child_stderr(TQDM_DISABLE="1")  # why not TQDM_DISABLE: disable= wins
    with sglang_api.child_progress_bars(shown=False):
        assert _child_stderr() == ""


@pytest.mark.parametrize("level,shown", [("error", False), ("info", True)])
def test_the_cli_switch_turns_transformers_bars_off_below_info(level, shown):
    code = ("from colocate.monitor.quiet import hide_library_bars\n"
            f"hidden = hide_library_bars({level!r})\n"
            "from transformers.utils import logging\n"
            "from huggingface_hub.utils import are_progress_bars_disabled\n"
            "print(hidden, logging.is_progress_bar_enabled(), are_progress_bars_disabled())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(not shown), str(shown), str(not shown)]


def test_a_runs_log_level_comes_from_its_config(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    (run / "config.json").write_text('{"engines": {"log_level": "info"}}')
    assert log_level_of(run) == "info"
    assert log_level_of(run / "checkpoints" / "step_00000002") == "info"
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')  # an HF folder's config
    assert log_level_of(model) == "error"
    assert log_level_of(tmp_path / "missing") == "error"
    assert log_level_of("smollm2") == "error"


def test_the_sigquit_handler_line_is_dropped_inside_the_block_only(caplog):
    """SGLang logs "Using custom SIGQUIT handler: <function ...>" at error level at every
    engine start colocate makes; the start drops it, and that logger's other records stay."""
    name, prefix = sglang_api.SIGQUIT_LINE
    logger = logging.getLogger(name)
    with caplog.at_level(logging.ERROR, logger=name):
        with sglang_api.start_lines_dropped():
            logger.error(f"{prefix}: <function child_quit at 0x7f00>")
            logger.error("Received sigquit from a child process.")
        logger.error(f"{prefix}: after the block")
    assert [r.getMessage() for r in caplog.records] == ["Received sigquit from a child process.",
                                                       f"{prefix}: after the block"]
    assert logger.filters == []
