"""engine/channel.py and engine/wire.py: every message type round-trips over ipc:// and
loopback tcp:// (sync and asyncio), chunks are put back in order, oversized and malformed
frames are refused and counted, back-pressure is a clear error, and only local endpoints
are accepted. Loopback and ipc only."""

import asyncio
import random
import time

import msgspec
import pytest
import zmq

from colocate.engine.errors import EngineError
from colocate.engine.channel import (
    AsyncReceiver,
    AsyncSender,
    ChannelFullError,
    FrameTooLargeError,
    Heartbeat,
    Receiver,
    Reorderer,
    ScoreResult,
    Sender,
    Shutdown,
    TokenChunk,
    validate_endpoint,
)

MESSAGES = [
    TokenChunk(step=3, index=7, seq=0, prompt_ids=[1, 2, 3], tokens=[9, 8], final=False),
    TokenChunk(step=3, index=7, seq=1, prompt_ids=None, tokens=[4], final=True),
    ScoreResult(step=3, index=7, seq=1, score=-0.25, tokens_scored=3, final=True),
    Heartbeat(sender="feeder", sent_at=12.5),
    Shutdown(reason="done"),
]


def _raw_push(ctx, endpoint):
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


@pytest.fixture
def ipc_endpoint(tmp_path):
    return f"ipc://{tmp_path}/ch.sock"


@pytest.mark.parametrize("where", ["ipc", "tcp"])
def test_every_message_type_round_trips(where, ipc_endpoint):
    bind_at = ipc_endpoint if where == "ipc" else "tcp://127.0.0.1:*"
    with Receiver(bind_at) as rx, Sender(rx.endpoint) as tx:
        assert rx.endpoint.startswith(f"{where}://") and not rx.endpoint.endswith("*")
        for msg in MESSAGES:
            tx.send(msg, timeout_s=5)
        got = [rx.recv(timeout_s=5) for _ in MESSAGES]
        assert got == MESSAGES and [type(m) for m in got] == [type(m) for m in MESSAGES]
        assert rx.recv(timeout_s=0.05) is None
        assert rx.stats.received == len(MESSAGES) and rx.stats.malformed == 0
        assert tx.sent == len(MESSAGES)


def test_asyncio_variants_round_trip_over_tcp():
    async def main():
        async with AsyncReceiver("tcp://127.0.0.1:*") as rx:
            async with AsyncSender(rx.endpoint) as tx:
                for msg in MESSAGES:
                    await tx.send(msg, timeout_s=5)
                got = [await rx.recv(timeout_s=5) for _ in MESSAGES]
                assert await rx.recv(timeout_s=0.05) is None
                return got

    assert asyncio.run(main()) == MESSAGES


def test_sender_can_bind_and_receiver_connect(ipc_endpoint):
    with Sender(ipc_endpoint, bind=True) as tx, Receiver(ipc_endpoint, bind=False) as rx:
        tx.send(Shutdown(), timeout_s=5)
        assert rx.recv(timeout_s=5) == Shutdown()


def test_reorderer_releases_shuffled_chunks_in_seq_order():
    rng = random.Random(0)
    chunks = [TokenChunk(1, i, s, [5] if s == 0 else None, [i, s], s == 4)
              for i in range(3) for s in range(5)]
    arrivals = chunks + rng.sample(chunks, 4)  # plus a few repeats
    rng.shuffle(arrivals)
    ro = Reorderer()
    released = [out for c in arrivals for out in ro.push(c)]
    for i in range(3):
        assert [c.seq for c in released if c.index == i] == [0, 1, 2, 3, 4]
    assert len(released) == 15 and ro.discarded == 4 and ro.pending() == {}


def test_reorderer_reports_gaps_and_forgets_other_steps():
    ro = Reorderer()
    assert ro.push(TokenChunk(0, 0, 2, None, [1], False)) == []
    assert ro.push(TokenChunk(0, 1, 0, [1], [1], False)) != []
    assert ro.pending() == {(0, 0): 0}
    done = TokenChunk(1, 5, 0, [1], [1], True)
    assert ro.push(done) == [done] and ro.tracked() == 3
    assert ro.forget_other_steps(1) == 2 and ro.pending() == {} and ro.tracked() == 1
    assert ro.push(done) == [] and ro.discarded == 1  # step 1 kept: its closed request stays closed
    late = TokenChunk(0, 2, 0, [1], [1], True)
    assert ro.push(late) == [late] and ro.push(late) == [] and ro.discarded == 2
    assert ro.forget_other_steps(2) == 0 and ro.tracked() == 0


def test_oversized_frames_are_refused_and_counted(ipc_endpoint):
    with Receiver(ipc_endpoint, max_frame_bytes=256) as rx:
        big = TokenChunk(0, 0, 0, [1] * 300, [], True)
        with Sender(ipc_endpoint, max_frame_bytes=256) as tx:
            with pytest.raises(FrameTooLargeError, match="max_frame_bytes 256"):
                tx.send(big)
        ctx = zmq.Context()
        raw = _raw_push(ctx, ipc_endpoint)
        raw.send(msgspec.msgpack.encode(big))  # a peer without the check: libzmq drops it
        got = None
        for _ in range(50):  # the peer reconnects; later messages get through
            raw.send(msgspec.msgpack.encode(Shutdown("after")))
            got = rx.recv(timeout_s=0.1)
            if got is not None:
                break
        raw.close(0)
        ctx.term()
        assert got == Shutdown("after")
        assert rx.stats.disconnects >= 1 and rx.stats.malformed == 0


def test_malformed_frames_are_counted_never_raised(ipc_endpoint):
    bad = [
        [b"\xc1not msgpack"],
        [msgspec.msgpack.encode({"type": "nope", "x": 1})],
        [msgspec.msgpack.encode({"type": "chunk", "step": 0})],  # missing fields
        [msgspec.msgpack.encode({"type": "chunk", "step": 0, "index": -1, "seq": 0,
                                 "prompt_ids": [1], "tokens": [], "final": True})],
        [msgspec.msgpack.encode({"type": "chunk", "step": 0, "index": 0, "seq": 1,
                                 "prompt_ids": [1], "tokens": [], "final": True})],
        [msgspec.msgpack.encode(Shutdown()), b"extra frame"],
    ]
    with Receiver(ipc_endpoint) as rx:
        ctx = zmq.Context()
        raw = _raw_push(ctx, ipc_endpoint)
        for frames in bad:
            raw.send_multipart(frames)
        raw.send(msgspec.msgpack.encode(Heartbeat("ok", 1.0)))
        assert rx.recv(timeout_s=5) == Heartbeat("ok", 1.0)
        raw.close(0)
        ctx.term()
        assert rx.stats.malformed == len(bad) and rx.stats.received == 1
        assert rx.stats.last_error and "frame" in rx.stats.last_error


def test_full_channel_is_a_clear_error(ipc_endpoint):
    with Sender(ipc_endpoint, bind=True, sndhwm=1) as tx:  # nobody connected: nowhere to queue
        start = time.monotonic()
        with pytest.raises(ChannelFullError, match="sndhwm=1"):
            tx.send(Shutdown(), timeout_s=0.05)
        assert time.monotonic() - start < 2
    with pytest.raises(TypeError, match="cannot send"):
        with Sender("tcp://127.0.0.1:*", bind=True) as tx:
            tx.send({"type": "shutdown"})


def test_a_reader_that_falls_behind_back_pressures_the_sender(ipc_endpoint):
    chunk = TokenChunk(0, 0, 1, None, [2**31] * 12000, False)  # ~60 KB
    with Receiver(ipc_endpoint, rcvhwm=1) as rx, Sender(ipc_endpoint, sndhwm=1) as tx:
        with pytest.raises(ChannelFullError, match="not drained within 0.2 s"):
            for _ in range(2000):
                tx.send(chunk, timeout_s=0.2)
        drained = 0
        while rx.recv(timeout_s=0.2) is not None:
            drained += 1
        assert drained >= 1 and drained == tx.sent
        tx.send(chunk, timeout_s=1)  # flowing again
        assert rx.recv(timeout_s=5) == chunk


def test_async_full_channel_is_a_clear_error(ipc_endpoint):
    async def main():
        async with AsyncSender(ipc_endpoint, bind=True, sndhwm=1) as tx:
            await tx.send(Shutdown(), timeout_s=0)

    with pytest.raises(ChannelFullError, match="not keeping up"):
        asyncio.run(main())


@pytest.mark.parametrize("endpoint", [
    "tcp://0.0.0.0:5555", "tcp://10.0.0.1:1", "tcp://*:5555", "tcp://127.0.0.1:0",
    "tcp://127.0.0.1:70000", "tcp://127.0.0.2:5555", "inproc://x", "ipc://", "udp://127.0.0.1:1",
    "tcp://localhost.evil.com:1", "ipc://" + "x" * 200, None, 5555,
])
def test_non_local_or_malformed_endpoints_are_refused(endpoint):
    with pytest.raises(EngineError, match="channel endpoint") as err:
        validate_endpoint(endpoint)
    assert "\n" not in str(err.value)


def test_local_endpoints_are_accepted_and_star_only_binds():
    for ep in ["ipc:///tmp/x.sock", "tcp://127.0.0.1:5555", "tcp://localhost:1",
               "tcp://[::1]:65535", "tcp://127.0.0.1:*"]:
        assert validate_endpoint(ep) == ep
    with pytest.raises(EngineError, match="only bind"):
        Sender("tcp://127.0.0.1:*")


def test_endpoint_in_use_is_a_one_line_config_error():
    with Receiver("tcp://127.0.0.1:*") as rx:
        with pytest.raises(EngineError, match="channel endpoint: cannot bind") as err:
            Receiver(rx.endpoint)
        assert "\n" not in str(err.value)
