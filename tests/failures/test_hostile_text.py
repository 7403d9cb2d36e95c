"""Item 2 of issue 50: text a model or a dataset produced is data on the terminal.

Completions holding escape sequences (screen clear, alternate screen, colours, the window
title, a clipboard write, a hyperlink, a C1 CSI, carriage return and backspace overwrites,
a bidi override, rich markup) are written to a run folder's ``samples.jsonl`` and printed
by ``colocate show``: through click (piped: plain lines), through the rich table, and as a
real process on a pseudo-terminal. None of them reaches the output raw; each is shown in
its visible form (``\\x1b``). The same for a one-line error quoting a dataset's text (a CSV
header), and for ``colocate generate``'s lines and the progress lines."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner

from colocate.cli import main
from colocate.monitor import completions
from colocate.monitor.progress import Progress

# name -> (the raw text a model or dataset wrote, how it must be shown)
HOSTILE = {
    "clear screen": ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),
    "alternate screen": ("\x1b[?1049h", "\\x1b[?1049h"),
    "colour": ("\x1b[38;5;196mred", "\\x1b[38;5;196mred"),
    "window title": ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),
    "clipboard": ("\x1b]52;c;cm0gLXJmIH4K\x07", "\\x1b]52;c;cm0gLXJmIH4K\\x07"),
    "hyperlink": ("\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\",
                  "\\x1b]8;;http://evil.example/\\x1b\\click\\x1b]8;;\\x1b\\"),
    "C1 CSI": ("\x9b2J", "\\x9b2J"),
    "carriage return": ("safe\rEVIL", "safe\\rEVIL"),
    "backspace": ("abc\x08\x08\x08XYZ", "abc\\x08\\x08\\x08XYZ"),
    "DEL and NUL": ("a\x7fb\x00c", "a\\x7fb\\x00c"),
    "bidi override": ("abc\u202edcba", "abc\\u202edcba"),
    "rich markup": ("[link=http://evil.example/]click[/link] [bold]b[/bold]",
                    "[link=http://evil.example/]click[/link] [bold]b[/bold]"),
}
RAW = ("\x1b", "\x9b", "\x07", "\x08", "\x7f", "\x00", "\u202e")  # none may reach the output


def _row(i: int, text: str) -> dict:
    return {"step": 1, "index": i, "group": i, "prompt": f"prompt {i} {text}", "response": f"said {i}: {text}",
            "reward": 0.5, "reward_parts": {"fn": 0.5}, "length": 3, "model_tokens": 3, "turns": 0,
            "finish_reason": "stop", "deferred": False, "resumed": False, "versions": [[0, 3]]}


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    completions.append(tmp_path / completions.TRAIN_FILE, [_row(i, raw) for i, (raw, _) in enumerate(HOSTILE.values())])
    return tmp_path


def _assert_data(out: str) -> None:
    """No control sequence of the hostile texts is in ``out``; each one's visible form is."""
    leaked = [repr(c) for c in RAW if c in out]
    assert not leaked, f"raw {leaked} reached the output: {out!r}"
    missing = [name for name, (_, shown) in HOSTILE.items() if shown not in out]
    assert not missing, f"not shown visibly: {missing}: {out!r}"


def test_visible_escapes_controls_and_keeps_what_the_layout_asks():
    from colocate.monitor.visible import visible

    assert visible("a\x1b[2Jb\tc\nd\r\ne\rf\x08\x7f\x9b\u202e") == "a\\x1b[2Jb\\tc\\nd\\r\\ne\\rf\\x08\\x7f\\x9b\\u202e"
    assert visible("a\tb\nc\r\nd\re", keep="\n\t") == "a\tb\nc\nd\\re"  # CRLF is a line end; a lone CR is not
    plain = "plain, ünïcödé, 漢字, emoji 👍 and a \\ backslash"
    assert visible(plain) == plain


def test_show_through_click_prints_text_as_data(run_dir):
    result = CliRunner().invoke(main, ["show", str(run_dir), "--width", "400"])
    assert result.exit_code == 0, result.output
    _assert_data(result.output)
    assert result.output.count("\n") == 3 * len(HOSTILE)  # three lines per sample: nothing added, nothing lost


def test_show_as_a_rich_table_prints_text_as_data(run_dir, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # one line per cell: the visible forms are not folded
    completions.show(completions.read(run_dir), width=400, rich=True)
    _assert_data(capsys.readouterr().out)


def _on_a_pty(args: list[str], cols: int = 1000, timeout: float = 120) -> str:
    """``args`` run with stdin/stdout/stderr on a pseudo-terminal ``cols`` wide: what it printed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR")} | {"TERM": "xterm-256color"}
    proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            if not ready:
                raise TimeoutError(f"{args} printed nothing for {timeout} s: {out[-2000:]!r}")
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(master)
        proc.wait(timeout=timeout)
    return out.decode("utf-8", "replace")


def test_show_on_a_terminal_prints_text_as_data(run_dir):
    out = _on_a_pty([sys.executable, "-m", "colocate.cli", "show", str(run_dir), "--width", "400"])
    assert "prompt 0" in out, out  # the rich table was printed
    # rich's own styles (bold headers) are escape sequences of its own: the hostile ones must not be there
    for name, (raw, shown) in HOSTILE.items():
        assert raw == shown or raw not in out, f"{name}: {raw!r} reached the terminal"
        assert shown in out, f"{name}: {shown!r} not shown"
    for sequence in ("\x1b]", "\x1b[2J", "\x1b[?1049h", "\x1b[38;5;196m", "\x9b", "\x07", "\x08"):
        assert sequence not in out, f"{sequence!r} reached the terminal"


def test_an_error_quoting_a_dataset_is_one_visible_line(tmp_path, tiny_actor_path):
    """A CSV whose header holds the window-title sequence: the one line naming its columns shows it as text."""
    data = tmp_path / "hostile.csv"
    data.write_text('"\x1b]0;pwned\x07",\x1b[2Jother\n1,2\n', encoding="utf-8")
    result = CliRunner().invoke(main, [
        "train", "--set", f"models.actor={tiny_actor_path}", "--set", "reward.kind=rule", "--set", "reward.rule=vader",
        "--set", f"data.source={data}", "--set", "engines.device=cpu", "--set", f"run.out_dir={tmp_path / 'run'}",
        "--check"])
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: data.prompt_key 'prompt' is not a column of {data}; its columns: "
                             "\\x1b]0;pwned\\x07, \\x1b[2Jother\n")
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr


def test_progress_lines_and_phases_show_text_as_data():
    stream = io.StringIO()
    progress = Progress(2, stream=stream, bar=False)
    progress({"step": 1, "skipped": "reward fn said \x1b]0;pwned\x07\rok"})
    assert stream.getvalue() == "step    1/2  skipped: reward fn said \\x1b]0;pwned\\x07\\rok\n"


def test_generate_lines_show_text_as_data():
    """``colocate generate``'s text lines (no engine: the lines' own function)."""
    from colocate.cli import generation_lines
    from colocate.tools.sample import Generation

    line = generation_lines(Generation("hi \x1b[2J", "one\ntwo \x1b]0;t\x07", [1, 2], "stop"))
    assert line == "### hi \\x1b[2J\none\ntwo \\x1b]0;t\\x07\n[2 tokens, stop]\n"
