"""What killed runs leave behind, swept when the next run starts.

Owns: :func:`sweep`: folders whose owner process is gone. ``colocate-zmq-PID-*`` in the
temporary folder (a streamed run's ZeroMQ sockets, ``colocate.rollout.rollouts``),
``pymp-*`` there (Python multiprocessing's, made by SGLang's and torch's processes) and
a run's ``checkpoints/.tmp_step_*_PID`` (a checkpoint write cut short,
``colocate.run.checkpoint``). Only this user's folders. A folder whose name carries a
pid is its owner's while that pid names a live process that started before the folder
last changed (a pid used again by a later process does not count). A folder without
one (``pymp-*``, which Python names at random, and ``colocate-zmq-*`` of older
versions) is left while any live Python process of this user started before it last
changed, since that one could own it: on a machine where such a process runs for days
(a notebook, an IDE), those folders stay until it ends.

Leaves out: what a live run cleans up itself (its own temporary folders on close), the
run folder's lock (``colocate.run.run_folder``: the kernel drops it with the process).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path

import psutil

from colocate.run import checkpoint

_ZMQ = re.compile(r"colocate-zmq-(\d+)-.*")
_SLACK_S = 1.0  # file times and process start times are not taken from the same clock tick


def sweep(checkpoints: Path | None = None, tmp: Path | None = None) -> list[Path]:
    """Remove the folders named above whose owner is gone (``checkpoints``: a run's
    checkpoint folder, its partial writes too; ``tmp``: default the system's temporary
    folder); returns those removed."""
    root = Path(tmp) if tmp is not None else Path(tempfile.gettempdir())
    candidates = [(p, _pid_in(p.name)) for p in root.glob("colocate-zmq-*")] + [(p, None) for p in root.glob("pymp-*")]
    if checkpoints is not None and Path(checkpoints).is_dir():
        candidates += checkpoint.partial_writes(Path(checkpoints))
    own = multiprocessing.current_process()._config.get("tempdir")  # this process's own pymp-* (if made yet)
    starts: list[float] | None = None  # this user's live Python processes' start times, read once if needed
    removed = []
    for path, pid in candidates:
        try:
            info = path.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or str(path) == own:
            continue
        if pid is not None:
            alive = _alive(pid, info.st_mtime)
        else:
            starts = _python_starts() if starts is None else starts
            alive = any(t <= info.st_mtime + _SLACK_S for t in starts)
        if not alive:
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
    return removed


def _pid_in(name: str) -> int | None:
    found = _ZMQ.fullmatch(name)
    return int(found.group(1)) if found else None


def _alive(pid: int, changed: float) -> bool:
    """Whether ``pid`` is a live process that started before ``changed`` (a folder's mtime)."""
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and proc.create_time() <= changed + _SLACK_S
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # cannot tell: keep it


def _python_starts() -> list[float]:
    """Start times of this user's live Python processes but this one (which makes no
    folder it has not named: ``own`` above)."""
    uid, me, starts = os.getuid(), os.getpid(), []
    for proc in psutil.process_iter(["pid", "uids", "exe", "name", "create_time"]):
        info = proc.info
        if info["pid"] == me or info["uids"] is None or info["uids"].real != uid:
            continue
        names = f"{os.path.basename(info['exe'] or '')} {info['name'] or ''}"
        if "python" in names and info["create_time"] is not None:
            starts.append(info["create_time"])
    return starts
