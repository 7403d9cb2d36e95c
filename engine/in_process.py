"""What an SGLang engine leaves in this process, and its end: the tokenizer manager's tasks,
ZeroMQ contexts and sockets, and the SIGTERM handler SGLang installs.

Owns: :func:`zmq_contexts` (the ZeroMQ contexts alive in this process),
:func:`end_contexts_since` (a failed start's), :func:`end_tokenizer_side` (a running
engine's, at shutdown) and :func:`give_back_sigterm`.

A failed start: SGLang's ``Engine`` makes its tokenizer manager, with a ZeroMQ context and
sockets, before it waits for its scheduler to be ready; when the scheduler dies (a model it
cannot load) or the start is interrupted, the half-made engine becomes garbage in a
reference cycle. Python's collector clears the sockets' weak references before it runs
finalizers, so the context's finalizer (``zmq.Context.__del__``: destroy, then ``term``) no
longer sees the sockets, and ``term`` waits for them to close — forever, whenever that
collection happens (measured 2026-11-28: `colocate generate` on a folder with cut weights
printed its one-line error, then hung in an exit hook that allocated; a plain
``gc.collect()`` after the failed start hung every time). Ended while the start's traceback
still holds them, a context's sockets are all found and closed first.

A shutdown: the tokenizer manager's receive and SIGTERM-watch tasks stay pending on the
event loop and hold it, so its context (two I/O threads) and sockets lived on after the
engine's processes stopped — measured 2026-11-28: one context and 15 file descriptors more
per engine started and shut down in a process. SGLang's own ``Engine.shutdown`` leaves them
too (it ends the process soon after).

SIGTERM: SGLang's handler on the loop drains the requests, then kills this whole process
tree; colocate stops at a step boundary with a checkpoint instead (``colocate.api``). Left
there, it outlived the engine and SIGTERM did nothing at all afterwards (the handler of a
shut-down engine). It is taken off at the start and the handler from before put back.

Leaves out: the engine's processes (``engine.runtime`` stops them).
"""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import weakref
from typing import Any


def _kinds() -> set[type]:
    import zmq  # SGLang's dependency: present wherever an engine starts

    kinds, todo = set(), [zmq.Context]
    while todo:
        kind = todo.pop()
        kinds.add(kind)
        todo += kind.__subclasses__()
    return kinds


def zmq_contexts() -> weakref.WeakSet:
    """Every ZeroMQ context alive in this process now (~0.15 s with SGLang loaded: one pass
    over the collector's objects, by exact type)."""
    kinds = _kinds()
    return weakref.WeakSet(obj for obj in gc.get_objects() if type(obj) in kinds)


def end_contexts_since(before: weakref.WeakSet) -> int:
    """End, without linger, every open ZeroMQ context made since ``before``
    (:func:`zmq_contexts`) and its sockets; returns how many. Call it while what made them
    is still referenced (in the ``except`` block of the failed start)."""
    made = [ctx for ctx in zmq_contexts() if ctx not in before and not ctx.closed]
    for ctx in made:
        ctx.destroy(linger=0)  # closes the sockets it knows, then ends
    return len(made)


def end_tokenizer_side(engine: Any) -> None:
    """End what SGLang's ``engine`` (``sglang.Engine``, its processes stopped) keeps in this
    process: the tokenizer manager's tasks are cancelled (and awaited, unless the loop is
    running), its sockets and the engine's closed without linger and their context ended."""
    manager = engine.tokenizer_manager
    tasks = [task for task in manager.asyncio_tasks if not task.done()]
    for task in tasks:
        task.cancel()
    loop = manager.event_loop
    if tasks and loop is not None and not loop.is_running() and not loop.is_closed():
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    manager.asyncio_tasks.clear()
    for owner, name in ((manager, "recv_from_detokenizer"), (manager, "send_to_scheduler"), (engine, "send_to_rpc")):
        sock = getattr(owner, name, None)
        if sock is not None and not sock.closed:
            sock.context.destroy(linger=0)  # the socket's context, with every socket it made


def give_back_sigterm(loop: asyncio.AbstractEventLoop, before: Any) -> None:
    """Take SGLang's SIGTERM handler off ``loop`` and put back ``before`` (what
    ``signal.getsignal`` said before the engine started; the default where that was not a
    Python handler); main thread only, as SGLang's."""
    if threading.current_thread() is not threading.main_thread():
        return

    async def remove() -> None:  # uvloop removes a handler only while it runs (else: False, kept)
        loop.remove_signal_handler(signal.SIGTERM)

    if loop.is_running():
        loop.remove_signal_handler(signal.SIGTERM)
    else:
        loop.run_until_complete(remove())
    signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)
