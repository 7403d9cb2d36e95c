"""Who may write a run folder: one run at a time, and never over another run's records.

Owns: :data:`RECORDS` (what a run writes into ``run.out_dir``); :func:`check` (the
refusals, one line each, before any engine starts; ``colocate train --check`` runs it
alone): the folder holds no earlier run's records unless this run continues it
(``--resume`` of that folder) or ``run.overwrite_out_dir`` replaces them, and no other
process holds the folder; :func:`claim` (the same, then the folder held for the run's
life by an OS lock, ``fcntl.flock`` on ``<out_dir>/.lock``, which the kernel drops with
the process that holds it, so a killed run leaves no stale lock; with
``run.overwrite_out_dir`` the earlier run's records removed, and nothing else of the
folder). Rank 0 claims the folder: it alone writes it.

Leaves out: what the records hold (``colocate.monitor``, ``colocate.run.checkpoint``),
what a killed run left elsewhere (``colocate.run.leftovers``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from colocate.config import Config
from colocate.errors import ConfigError
from colocate.run.resume import run_folder

# what a run writes into its folder (config.json first: the run's own settings)
RECORDS = ("config.json", "metrics.jsonl", "eval.jsonl", "samples.jsonl", "eval_samples.jsonl", "timeline.jsonl",
           "checkpoints", "tb", "wandb", "wandb_run_id", "faults_fired", "export")
LOCK = ".lock"


class RunFolder:
    """A run folder this process holds (:func:`claim`) until :meth:`release` or its end."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the lock goes with the descriptor
            self._fd = -1


def records(out_dir: Path) -> list[str]:
    """Which of :data:`RECORDS` ``out_dir`` holds (an empty folder among them is none)."""
    found = []
    for name in RECORDS:
        path = Path(out_dir) / name
        if path.is_dir() and not any(path.iterdir()):
            continue
        if path.exists() or path.is_symlink():
            found.append(name)
    return found


def check(cfg: Config, resume: str | Path | None = None) -> None:
    """The folder of ``cfg.run.out_dir`` may take this run (``resume``: the folder or
    checkpoint it continues); else one line. Holds nothing."""
    out = Path(cfg.run.out_dir)
    if (out / LOCK).is_file():
        os.close(_hold(out / LOCK, os.O_RDONLY))  # free now: let go at once
    _refuse_records(cfg, resume)
    _check_writable(out)


def _check_writable(out: Path) -> None:
    """A folder can be made where ``out`` is, or in it: one made and removed in its nearest
    existing folder (permissions alone do not say: root may write anywhere, and /proc or a
    read-only mount still refuses)."""
    near = out
    while not near.exists() and near != near.parent:
        near = near.parent
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".colocate-check-", dir=near))
    except OSError as exc:
        why = exc.strerror or str(exc)
        if near != out:
            why += f" (making it in '{near}')"
        raise ConfigError(f"run.out_dir '{out}' cannot be written: {why}") from None


def claim(cfg: Config, resume: str | Path | None = None,
          log: Callable[[str], None] = lambda message: None) -> RunFolder:
    """:func:`check`, then hold the folder for this run (until ``release()`` or this process
    ends); with ``run.overwrite_out_dir`` (and not continuing it) the earlier run's records
    are removed, named in one ``log`` line."""
    out = Path(cfg.run.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = _hold(out / LOCK, os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        raise ConfigError(f"run.out_dir '{out}' cannot be written: {exc.strerror or exc}") from None
    folder = RunFolder(out, fd)
    try:
        os.ftruncate(folder._fd, 0)
        os.pwrite(folder._fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the refusal line
        _refuse_records(cfg, resume)
        old = [] if _continues(cfg, resume) else records(out)
        for name in old:  # run.overwrite_out_dir (else refused above)
            path = out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        if old:
            log(f"run.overwrite_out_dir: removed the earlier run's {', '.join(old)} from {out}")
    except BaseException:
        folder.release()
        raise
    return folder


def _hold(lock: Path, flags: int) -> int:
    """A descriptor of ``lock`` holding its exclusive lock; refused in one line while
    another process (or another run of this one) holds it."""
    fd = os.open(lock, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"run.out_dir '{lock.parent}' is in use by another run{_holder(lock)}; wait for it to "
                          "end, or start this one elsewhere with --set run.out_dir=<another folder>") from None
    return fd


def _holder(lock: Path) -> str:
    with contextlib.suppress(OSError, ValueError):
        pid = int(lock.read_text().split()[0])
        return f" (process {pid}{'' if pid != os.getpid() else ', this one'})"
    return ""


def _continues(cfg: Config, resume: str | Path | None) -> bool:
    """Whether this run continues the run of its own ``run.out_dir`` (``--resume`` of it)."""
    return resume is not None and run_folder(resume).resolve() == Path(cfg.run.out_dir).resolve()


def _refuse_records(cfg: Config, resume: str | Path | None) -> None:
    out = Path(cfg.run.out_dir)
    found = [] if _continues(cfg, resume) or cfg.run.overwrite_out_dir else records(out)
    if found:
        raise ConfigError(
            f"run.out_dir '{out}' already holds a run ({', '.join(found)}); continue it with --resume {out}, "
            f"start a new one elsewhere with --set run.out_dir=<another folder>, or replace it with "
            "--set run.overwrite_out_dir=true")
