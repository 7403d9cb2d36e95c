"""engine.in_process: the ZeroMQ contexts a failed start made are ended with their
sockets, those alive before it are not, and a collection afterwards returns (a context
left open with a socket, both garbage, hangs the collector in the context's end: the
failed start's case, measured in tests/failures/test_unloadable_model.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import zmq
import zmq.asyncio

from colocate.engine.in_process import end_contexts_since, zmq_contexts


def test_the_contexts_made_since_are_ended_with_their_sockets_and_the_others_kept():
    kept = zmq.Context(1)
    kept_socket = kept.socket(zmq.PAIR)
    before = zmq_contexts()
    assert kept in before
    made, made_async = zmq.Context(1), zmq.asyncio.Context(1)
    sockets = [made.socket(zmq.PAIR), made_async.socket(zmq.PAIR)]
    try:
        assert end_contexts_since(before) == 2
        assert made.closed and made_async.closed and all(s.closed for s in sockets)
        assert not kept.closed and not kept_socket.closed
        assert end_contexts_since(before) == 0  # nothing new left open
    finally:
        kept_socket.close(linger=0)
        kept.term()


HALF_MADE = """
import gc, zmq
from colocate.engine.in_process import end_contexts_since, zmq_contexts
before = zmq_contexts()
class Half:  # a half-made engine: it holds a socket, the socket's context, and itself
    pass
half = Half()
half.context = zmq.Context(1)
half.socket = half.context.socket(zmq.PAIR)
half.me = half
ended = end_contexts_since(before) if END else 0
del half
print(ended, gc.collect() >= 1, flush=True)
"""


@pytest.mark.parametrize("end", [True, False], ids=["ended", "left-open"])
def test_after_the_end_a_cycle_holding_a_context_and_its_socket_is_collected(end):
    """In a process of its own, bounded: left open, the collection never returns."""
    try:
        done = subprocess.run([sys.executable, "-c", f"END = {end}\n" + HALF_MADE], capture_output=True, text=True,
                              timeout=10)
    except subprocess.TimeoutExpired:
        assert not end, "the collection hung although the context was ended"
        return
    assert end, f"the collection returned with the context left open: {done.stdout}"
    assert done.returncode == 0 and done.stdout.split() == ["1", "True"], done.stdout + done.stderr[-2000:]
