"""Appending a run's records (``metrics.jsonl``, ``eval.jsonl``, ``samples.jsonl``, ...) so
that a failed write costs one line of output and leaves no torn record.

Owns: :func:`append_jsonl` and :class:`RecordsNotWrittenError`: a write that fails (a full
disk, a quota, a file size limit: any ``OSError``) is cut back to the file's size before it
and becomes one line naming the file, the reason and how to go on (the run's checkpoints are
untouched: the step is trained again after ``--resume``, and its records written then).

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


def append_jsonl(path: str | Path, records: Iterable[dict[str, Any]]) -> None:
    """Append ``records`` to ``path``, one JSON line each, all or none of them."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    if not text:
        return
    path = Path(path)
    before = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a") as f:
            f.write(text)
            f.flush()
    except OSError as exc:
        _cut_back(path, before)
        why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        raise RecordsNotWrittenError(
            f"records not written to '{path}': {why} (the file is as it was before); the checkpoints "
            f"are intact: free space there, then continue with --resume {path.parent}") from None


def _cut_back(path: Path, size: int) -> None:
    """Truncate ``path`` back to ``size`` bytes (best effort: the disk may refuse that too)."""
    try:
        os.truncate(path, size)
    except OSError:
        pass
