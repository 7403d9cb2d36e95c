"""What a failed SGLang start leaves in this process: its ZeroMQ contexts, ended at once.

Owns: :func:`zmq_contexts` (the ZeroMQ contexts alive in this process) and
:func:`end_contexts_since`. SGLang's ``Engine`` makes its tokenizer manager, with a ZeroMQ
context and sockets, before it waits for its scheduler to be ready; when the scheduler
dies (a model it cannot load) or the start is interrupted, the half-made engine becomes
garbage in a reference cycle. Python's collector clears the sockets' weak references
before it runs finalizers, so the context's finalizer (``zmq.Context.__del__``: destroy,
then ``term``) no longer sees the sockets, and ``term`` waits for them to close — forever,
whenever that collection happens (measured 2026-11-28: `colocate generate` on a folder
with cut weights printed its one-line error, then hung in an exit hook that allocated; a
plain ``gc.collect()`` after the failed start hung every time). Ended while the start's
traceback still holds them, a context's sockets are all found and closed first.

Leaves out: the engine's processes (``engine.runtime`` stops them), a running engine's
sockets (SGLang's shutdown closes them).
"""

from __future__ import annotations

import gc
import weakref


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
