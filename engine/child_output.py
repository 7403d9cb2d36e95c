"""What an engine's processes write to stderr: held while the engine starts, passed on after.

Owns: :class:`ChildOutput`. While an engine starts, this process's stderr (file descriptor
2) points at a file of the engine's own, so every process the start spawns (SGLang's
scheduler, its detokenizer) writes there for its whole life: a spawned process inherits
the descriptor, and SGLang has no argument for where its children write. A start that
succeeds passes what was written so far on to the real stderr at once, then a thread
passes on what follows (a fraction of a second later); a start that fails keeps it all in
the file, whose last line (:func:`last_line`: SGLang's own error) goes into the engine's
one-line error. Leaves out: starting the engine and its errors (``engine.runtime``,
``engine.start_checks``).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from pathlib import Path

POLL_S = 0.2  # how often the thread looks for new output after the start
_STAMP = re.compile(r"^\[[^\]]*\]\s*")  # SGLang's "[2026-01-01 12:00:00] " prefix
_NOT_A_CAUSE = ("Traceback (most recent call last)", "Received sigquit", "SIGQUIT received", "No live scheduler")


def last_line(text: str) -> str:
    """The last line of ``text`` that states a cause (a traceback's closing ``Error: …``,
    a logged error), without SGLang's timestamp; "" when there is none. Frames, source
    lines and carets (indented or ``^``), progress bars and SGLang's own notes about the
    signal it sends are skipped."""
    for raw in reversed(text.replace("\r", "\n").splitlines()):
        if not raw.strip() or raw[0].isspace() or raw.lstrip().startswith("^"):
            continue
        line = _STAMP.sub("", raw).strip()
        if line and not line.startswith(_NOT_A_CAUSE) and "%|" not in line:
            return line
    return ""


class ChildOutput:
    """This process's stderr captured in a file while an engine starts (see the module)."""

    def __init__(self, prefix: str) -> None:
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
        self.path = Path(path)
        sys.stderr.flush()
        self._real = os.dup(2)
        os.dup2(fd, 2)
        os.close(fd)
        self._read = open(self.path, "rb")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._restored = False
        self._closed = False
        self.last = ""  # the last line stating a cause the engine's processes wrote

    def _restore(self) -> None:
        if not self._restored:
            sys.stderr.flush()
            os.dup2(self._real, 2)
            self._restored = True

    def failed(self) -> str:
        """The start failed: this process's stderr back; everything written so far (it stays
        in ``path``)."""
        self._restore()
        return self.path.read_text(errors="replace")

    def started(self) -> None:
        """The start succeeded: this process's stderr back, what the start wrote passed on,
        and a thread passing on what the engine's processes write from now on."""
        self._restore()
        self.pass_on()
        self._thread = threading.Thread(target=self._follow, name="engine-stderr", daemon=True)
        self._thread.start()

    def pass_on(self) -> None:
        """Copy what arrived since the last call to the real stderr (and note its last cause)."""
        with self._lock:
            chunk = b"" if self._closed else self._read.read()
            if chunk:
                _write_all(self._real, chunk)
                self.last = last_line(chunk.decode(errors="replace")) or self.last

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self.pass_on()

    def close(self, keep: bool = False) -> None:
        """Stop passing on (what is left is passed first); the file is removed unless ``keep``."""
        if self._closed:
            return
        self._restore()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.pass_on()
        with self._lock:
            self._closed = True
            self._read.close()
            os.close(self._real)
        if not keep:
            self.path.unlink(missing_ok=True)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]
