"""A tensor-parallel engine's TP rank i gets training rank i's own copy of every bucket.

Two gloo ranks form one TP group (rank 0 hosts the engine, rank 1 none) and push through
``Session.push_weights`` → ``colocate.run.weight_sync`` (its ``TPExchange``), each from a
lazy "gather" that takes a world collective per tensor (as FSDP's all-gathers do) and yields
tensors whose values name their rank. SGLang's own serializer makes the payloads
(``engine.weight_payloads``, CPU shared memory here, CUDA-IPC handles on a GPU). The host's
engine is the engine's own update loop (``with_last`` + ``rank_payloads``) with SGLang's
request replaced by a recorder: on CPU an engine has one TP rank, so what TP rank 1 would be
sent is read back here. The real CPU engine taking the list in order is
``tests/integration/test_engine_weights.py``.
"""

from __future__ import annotations

import time
import traceback
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp

from colocate.run import weight_sync
from colocate.run.engines import RankEngines
from colocate.run.placement import Placement
from colocate.run.session import RunContext, RunState, Session

UNIT = 1 << 16  # float32 values: 256 KiB
SPEC = [("a", 2), ("b", 2), ("c", 5), ("d", 1), ("e", 1), ("f", 1)]  # name, UNITs: 1 MiB buckets [a b] [c] [d e f]
BUCKETS = [["a", "b"], ["c"], ["d", "e", "f"]]
LOADING_S = 0.3  # how long the host's stand-in "load" of each bucket takes


def _lazy_gather(rank: int):
    """(name, tensor) made one at a time, each after a world collective (like
    ``full_tensors``): every rank must walk it in step. Values: 1000·rank + tensor index."""
    import torch.distributed as dist

    for index, (name, units) in enumerate(SPEC):
        dist.all_gather_object([None, None], index)
        yield name, torch.full((units * UNIT,), float(1000 * rank + index))


def _read(payload: bytes) -> dict[str, float]:
    """A flattened bucket's payload → {name: its one value}."""
    from colocate.engine import sglang_api

    api = sglang_api.load()
    data = api.MultiprocessingSerializer.deserialize(payload)
    flat = api.FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
    out = {}
    for name, tensor in flat.reconstruct_tensors():
        assert torch.all(tensor == tensor[0])
        out[name] = float(tensor[0])
    return out


class _Engine:
    """The host's engine: ``SglangEngine.update_weights``'s loop over buckets, the SGLang
    request replaced by reading back every TP rank's payload (and, during the stand-in
    load, which peer buckets are already dropped). ``fail_at``: raise at that bucket."""

    def __init__(self, marks: Path, fail_at: int | None = None) -> None:
        self.cfg = SimpleNamespace(dtype="float32")
        self.paused = None
        self.marks, self.fail_at = marks, fail_at
        self.loads: list = []

    def update_weights(self, walk, version: int, exchange=None) -> float:
        from colocate.engine.weight_payloads import bucket_data, rank_payloads, with_last

        for index, (bucket, _last) in enumerate(with_last(walk)):
            if index == self.fail_at:
                raise RuntimeError("the engine died")
            payloads = rank_payloads(bucket_data(bucket, True), 2, exchange)
            time.sleep(LOADING_S)  # the peer must hold its copy all this time
            dropped = sorted(p.name for p in self.marks.glob("dropped-*"))
            self.loads.append((version, [_read(p) for p in payloads], dropped))
        return 1.0


def _session(rank: int, actor, tp) -> Session:
    cfg = SimpleNamespace(run=SimpleNamespace(fault_at=None), engines=SimpleNamespace(sync_bucket_mb=1))
    engines = RankEngines(actor, placement=Placement(rank, 2, rank, 2), sharing=SimpleNamespace(device_push=True),
                          tp=tp)
    state = RunState(kl_ctl=None, weight_version=1)  # a step's sync: the loop counts the version up before it
    return Session(cfg, None, None, engines, None, None, state,
                   RunContext(tokenizer=None, out_dir=Path(".")))


def _marking(marks: Path, push: list):
    """SGLang's bucket serializer, leaving a mark when the peer lets go of a bucket's data."""
    from colocate.engine.weight_payloads import serialize_bucket

    served: dict[int, int] = {}  # push -> buckets served

    def serialize(bucket, flattened):
        data, payload = serialize_bucket(bucket, flattened)
        index = served[push[0]] = served.get(push[0], -1) + 1
        weakref.finalize(data["flattened_tensor"], (marks / f"dropped-{push[0]}-{index}").touch)
        return data, payload

    return serialize


def _worker(rank: int, init_method: str, marks: str, queue) -> None:
    try:
        queue.put((rank, _pushes(rank, init_method, Path(marks))))
    except BaseException:  # noqa: BLE001 - the test reads what each rank raised
        queue.put((rank, traceback.format_exc()))


def _pushes(rank: int, init_method: str, marks: Path):
    """Three pushes: a good one, one whose engine fails at bucket 1, a good one."""
    import dataclasses

    from colocate.trainer.distributed import init_distributed

    info = init_distributed("cpu", rank=rank, world_size=2, init_method=init_method, timeout_s=120)
    tp = weight_sync.tp_exchange(Placement(rank, 2, rank, 2, tp_size=2), "float32", flattened=True)
    push = [0]
    tp = dataclasses.replace(tp, serialize=_marking(marks, push))
    out = []
    for push[0], fail_at in enumerate((None, 1, None)):
        engine = _Engine(marks, fail_at) if rank == 0 else None
        session = _session(info.rank, engine, tp)
        try:
            out.append(("ok", session.push_weights(_lazy_gather(rank)), engine.loads if engine else None))
        except RuntimeError as exc:
            out.append(("raised", str(exc), engine.loads if engine else None))
        time.sleep(0.2)  # the peer's last marks land
        out[-1] += (sorted(p.name for p in marks.glob(f"dropped-{push[0]}-*")),)
    return out


def _spawn_two(tmp_path: Path, timeout_s: float = 300) -> dict:
    from colocate.trainer.distributed import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_worker, args=(f"tcp://127.0.0.1:{free_port()}", str(tmp_path), queue),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the two ranks did not finish in {timeout_s} s (a collective out of step?)")
    return dict(queue.get() for _ in range(2))


@pytest.mark.slow
def test_each_tp_rank_gets_its_own_ranks_copy_and_peers_hold_it_until_loaded(tmp_path):
    got = _spawn_two(tmp_path)
    assert isinstance(got[0], list) and isinstance(got[1], list), got
    index = {name: i for i, (name, _) in enumerate(SPEC)}
    good, failed, again = got[0]
    for push, (status, seconds, loads, dropped) in zip((0, 2), (good, again)):
        assert status == "ok" and seconds == 1.0
        assert len(loads) == len(BUCKETS)
        for bucket, (version, payloads, dropped_then) in enumerate(loads):
            # payload i is TP rank i's: its names, rank i's own values
            assert [set(p) for p in payloads] == [set(BUCKETS[bucket])] * 2
            for tp_rank, payload in enumerate(payloads):
                assert payload == {n: float(1000 * tp_rank + index[n]) for n in BUCKETS[bucket]}
            # while bucket j loads, the peer still holds it (and has let go of j-1)
            assert f"dropped-{push}-{bucket}" not in dropped_then
            if bucket:
                assert f"dropped-{push}-{bucket - 1}" in dropped_then
    status, message, loads, _ = failed
    assert status == "raised" and message == "the engine died" and len(loads) == 1  # bucket 0 only
    # the peer went through every push in step (no hang) and let go of every bucket it served
    assert [entry[0] for entry in got[1]] == ["ok"] * 3
    assert [entry[1] for entry in got[1]] == [0.0] * 3
    for push, entry in enumerate(got[1]):
        assert entry[3] == [f"dropped-{push}-{b}" for b in range(len(BUCKETS))]


def test_with_tp_size_1_there_is_no_collective_and_no_exchange(monkeypatch):
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective with engines.tp_size 1")

    for name in ("new_group", "gather_object", "barrier", "all_gather_object", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, refuse)
    assert weight_sync.tp_exchange(Placement(0, 2, 0, 2, tp_size=1), "float32", flattened=True) is None
    calls = []

    class Engine:
        cfg = SimpleNamespace(dtype="float32")
        paused = None

        def update_weights(self, buckets, version, **kw):
            calls.append(([[n for n, _ in b] for b in buckets], version, kw))
            return 0.5

    state = {"w": torch.ones(4), "v": torch.zeros(2)}
    assert _session(0, Engine(), None).push_weights(state) == 0.5
    assert calls == [([["w", "v"]], 1, {})]  # today's call: no exchange
    assert _session(1, None, None).push_weights(iter([("w", torch.ones(1))])) == 0.0  # drained only


def test_tp_groups_are_consecutive_ranks_in_tp_rank_order_on_consecutive_gpus():
    ranks = [Placement(r, 4, r, 4, tp_size=2, visible_gpus=4) for r in range(4)]
    assert ranks[0].tp_groups == [[0, 1], [2, 3]]
    assert [p.tp_rank for p in ranks] == [0, 1, 0, 1]
    # TP rank i of the engine on GPU base_gpu_id + i (SGLang) is the GPU of the group's i-th rank
    for host in (ranks[0], ranks[2]):
        group = ranks[host.rank:host.rank + 2]
        assert [p.gpu_id for p in group] == [host.gpu_id + p.tp_rank for p in group]
