"""Where a run that seems stuck is waiting: ``kill -USR1 <pid>`` prints, to standard error,
every thread's Python stack and the stack of every pending task of the asyncio loop running
then (the rollout's awaits: which sample waits on which engine call), and the run goes on.

Owns: :func:`install` (the SIGUSR1 handler; main thread only, a no-op elsewhere, once per
process, chained after another handler already there) and :func:`dump` (the text it prints).

A thread's stack alone shows the rollout as the loop's ``run_until_complete``; the tasks'
stacks say what each coroutine awaits. The handler is a plain Python one, run by the main
thread between bytecodes (while the engines' uvloop runs too: it checks signals as it
polls). SGLang's own processes are not covered (their stacks: ``py-spy dump --pid``).

Leaves out: stopping a run (SIGINT/SIGTERM: ``colocate.api``), hangs inside C code (a
thread stuck there shows its last Python frame).
"""

from __future__ import annotations

import asyncio
import faulthandler
import io
import signal
import sys
import threading
import traceback
from typing import Any, TextIO


def dump(file: TextIO | None = None) -> str:
    """Every thread's stack and the pending tasks of the running loop (if any), as text;
    also written to ``file`` when given."""
    out = io.StringIO()
    frames = sys._current_frames()
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is None:
            continue
        out.write(f"-- thread {thread.name} ({'daemon' if thread.daemon else 'main' if thread is threading.main_thread() else 'thread'})\n")
        out.write("".join(traceback.format_stack(frame)))
    loop = asyncio._get_running_loop()
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()] if loop is not None else []
    out.write(f"-- asyncio: {len(tasks)} pending task(s)" + ("" if loop is not None else " (no loop running)") + "\n")
    for task in tasks:
        out.write(f"task {task.get_name()}:\n")
        out.writelines(f"  {line}\n" for line in awaiting(task.get_coro()))
    text = out.getvalue()
    if file is not None:
        file.write(f"[colocate] stacks (SIGUSR1):\n{text}-- end of stacks\n")
        file.flush()
    return text


def awaiting(coro: Any) -> list[str]:
    """Where ``coro`` is suspended, outermost first: each coroutine (or async generator) it
    awaits, file:line and function, down to what the innermost awaits (a future, say)."""
    lines = []
    while coro is not None:
        frame = next((getattr(coro, a) for a in ("cr_frame", "ag_frame", "gi_frame") if getattr(coro, a, None)), None)
        if frame is None and not hasattr(coro, "cr_await") and not hasattr(coro, "ag_await"):
            lines.append(f"awaits {coro!r}"[:300])  # a future, a task, a C-level awaitable
            break
        if frame is not None:
            lines.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = next((getattr(coro, a) for a in ("cr_await", "ag_await", "gi_yieldfrom") if getattr(coro, a, None)), None)
    return lines


def install(signum: int = signal.SIGUSR1) -> bool:
    """Print :func:`dump` to standard error on ``signum``; whether it was installed (only the
    main thread can). A handler already there still runs, after it."""
    if threading.current_thread() is not threading.main_thread():
        return False
    before = signal.getsignal(signum)
    if getattr(before, "prints_stacks", False):
        return True  # already there (a command invoked again in one process): one dump per signal

    def handler(sig: int, frame: Any) -> None:
        try:
            dump(sys.stderr)
        except Exception:  # noqa: BLE001 - a diagnostic must not end the run it looks at
            faulthandler.dump_traceback(all_threads=True)
        if callable(before):
            before(sig, frame)

    handler.prints_stacks = True
    signal.signal(signum, handler)
    return True
