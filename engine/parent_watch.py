"""A child process that ends with its parent: the reward feeder's process watches the
process that started it and, once that one is gone (killed with SIGKILL included),
kills its own children (its reward engine's SGLang scheduler and detokenizer) and exits.

Owns: :func:`watch_parent` (a daemon thread polling ``os.getppid()``: the kernel
reparents an orphan, to PID 1 or a subreaper, the moment its parent dies; a parent that
was already gone when the child started is caught by the first look) and
:func:`end_family` (SIGKILL to every descendant, then exit).

Why a watch and not ``prctl(PR_SET_PDEATHSIG)`` alone: the kernel sends that signal when
the *thread* that started the child ends, not the process, and a feeder is started by
whichever thread builds a run (an API user's worker thread, say); a thread that ends
while its process trains on must not take the feeder with it. SGLang's own scheduler and
detokenizer set PDEATHSIG themselves (``kill_itself_when_parent_died``), bound to the
thread that started their engine: the main thread of the feeder's process, so they die
with it.

Leaves out: starting the child (``colocate.rollout.rollouts``), what the child does.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that calls :func:`end_family` once this process's parent is
    no longer ``parent_pid`` (checked at once, then every ``interval_s``)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        end_family()

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def end_family(code: int = 1) -> None:
    """SIGKILL every descendant of this process, then exit at once with ``code`` (no
    cleanup: the parent that would have read the results is gone)."""
    for child in psutil.Process().children(recursive=True):
        try:
            child.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass  # gone already
    os._exit(code)
