"""Appending a run's records (``metrics.jsonl``, ``eval.jsonl``, ``samples.jsonl``, ...) so
that a failed write costs one line of output and leaves no torn record.

Owns: :func:`append_jsonl` (which first cuts off a last line a kill left torn) and
:class:`RecordsNotWrittenError`: a write that fails (a full
disk, a quota, a file size limit: any ``OSError``) is cut back to the file's size before it
and becomes one line naming the file, the reason and how to go on (the run's checkpoints are
untouched: the step is trained again after ``--resume``, and its records written then).
:func:`read_jsonl` reads them back: a last line a kill cut short is left out, any other
line that is not a record is one line (:class:`RecordsDamagedError`).

Leaves out: what is recorded (``colocate.monitor.metrics``, ``colocate.monitor.completions``),
checkpoints (``colocate.run.checkpoint``: their own one-line disk errors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from colocate.errors import ColocateError


class RecordsNotWrittenError(ColocateError):
    """A run's records could not be appended (the file is as it was before the write)."""


class RecordsDamagedError(ColocateError):
    """A line of a run's records, other than a last one cut short, is not a JSON object."""


def append_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` to ``path``, one JSON line each, all or none of them."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if not text:
        return
    path = Path(path)
    before = path.stat().st_size if path.exists() else 0
    try:
        if before:
            before = _end_torn(path, before)
        with path.open("a") as f:
            f.write(text)
            f.flush()
    except OSError as exc:
        _cut_back(path, before)
        why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise RecordsNotWrittenError(
            f"records not written to '{path}': {why} (the file is as it was before); the checkpoints "
            f"are intact: free space there, then continue with --resume {path.parent}") from None


def _end_torn(path: Path, size: int) -> int:
    """End a last line a kill left without its newline, so the next record starts a line of
    its own: a record cut short is cut off, a whole one (only its newline lost) kept; returns
    the file's size after."""
    with path.open("rb+") as f:
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return size
        cut, end = 0, size
        while end > 0:
            start = max(0, end - 65536)
            f.seek(start)
            newline = f.read(end - start).rfind(b"\n")
            if newline >= 0:
                cut = start + newline + 1
                break
            end = start
        f.seek(cut)
        try:
            whole = isinstance(json.loads(f.read(size - cut)), dict)
        except ValueError:
            whole = False
        if whole:
            f.seek(size)
            f.write(b"\n")
            return size + 1
        f.truncate(cut)
        return cut


def _cut_back(path: Path, size: int) -> None:
    """Truncate ``path`` back to ``size`` bytes (best effort: the disk may refuse that too)."""
    try:
        os.truncate(path, size)
    except OSError:
        pass


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of ``path`` (none when it does not exist). A last line without its
    newline that is not a record is a write cut short (the process killed while it wrote,
    a crash): left out, as if it had not been written. Any other line that is not a JSON
    object: one line naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            if n == len(lines):  # after the last newline: a write cut short
                break
            raise RecordsDamagedError(f"{path}: line {n} is not a JSON record ({exc}); remove that line (the "
                                      "checkpoints do not depend on it) and run again") from None
        if not isinstance(record, dict):
            raise RecordsDamagedError(f"{path}: line {n} is a JSON {type(record).__name__}, not a record; remove "
                                      "that line (the checkpoints do not depend on it) and run again")
        out.append(record)
    return out
