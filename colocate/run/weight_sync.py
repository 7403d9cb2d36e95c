"""Trainer → actor engine weight sync in size-bounded buckets, and with a tensor-parallel
engine each TP rank loading the bucket from its own GPU.

Owns: cutting a full (HF-named) state dict into buckets of at most ``bucket_bytes`` and
pushing them through the engine's tensor-update API under a new weight version (the
engine flushes its radix cache with the last bucket — or, while requests paused in place
hold KV, leaves the old KV in the old version's namespace of the cache, where no new
request looks — so no new request is served KV computed under the old weights). The
state may be host tensors (CPU) or the trainer's device tensors made one at a time
(CUDA: cut and cast on the device, sent as CUDA-IPC handles).

Tensor parallelism (:class:`TPExchange`): with ``engines.tp_size`` n > 1 the first rank of
every n training ranks hosts one TP engine whose TP rank i runs on GPU ``base_gpu_id`` +
i, the GPU of training rank first + i (``colocate.run.placement``). During a device push
every rank of the group holds the full tensors on its own GPU (the lazy all-gather), so
every rank cuts the same buckets, serializes its own copy (a CUDA-IPC handle of its own
memory) and the host sends TP rank i the payload of training rank i (SGLang's FSDP
helper, ``srt/weight_sync/utils.py``, does the same): no TP scheduler opens memory on
another GPU. The group's gloo subgroup is created once at build by every rank
(:func:`tp_exchange`); the per-bucket protocol runs on both sides (host:
:meth:`TPExchange.push`; a rank without engines: :meth:`TPExchange.serve`) and is finished
after a failure so no rank waits forever. Per bucket j, on every rank of the group, after
the push's lazy walk drew bucket j+1 (``engine.weight_payloads.with_last``): a barrier for
bucket j-1 (the host's update call with it returned: the peers drop their copy), then a
gather of the payloads to the host; a last barrier after the host's update returns.

Leaves out: gathering the state from FSDP (``trainer``), serializing and sending the
buckets (``engine.weight_payloads``, ``engine.runtime``), the subgroups' collectives
(``trainer.distributed``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from colocate.engine.weight_payloads import Bucket, Exchange, load_serializer, serialize_bucket, with_last
from colocate.trainer.distributed import gather_to_first, group_barrier, new_groups

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Serialize = Callable[[Bucket, bool], tuple[Any, bytes]]  # (bucket, flattened) -> (data kept alive, payload)
Update = Callable[[Iterable[Bucket], Exchange], float]  # the engine's update_weights with one exchange


def buckets(state: Weights, bucket_bytes: int,
            dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of named tensors (a state dict, or (name, tensor) pairs made one
    at a time), each at most ``bucket_bytes`` (a single larger tensor gets a bucket of its
    own); floating tensors cast to ``dtype`` (the engine's) as each bucket is cut, so only
    one bucket's copy exists at a time."""
    cur: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in state.items() if isinstance(state, Mapping) else state:
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, tensor.detach().contiguous()))
        size += nbytes
    if cur:
        yield cur


def sync(engine, state: Weights, version: int, bucket_mb: int, tp: TPExchange | None = None) -> float:
    """Load ``state`` into ``engine`` as ``version``, in the engine's dtype; returns seconds
    taken. Requests paused at the last cut (``overlap.pause_mode`` in_place/retract) stay
    paused: the time-sharing lets them go on once the engine's KV cache is back
    (``colocate.run.timesharing``). ``tp``: a tensor-parallel engine's TP rank i gets
    training rank i's copy of each bucket (the other ranks :func:`serve` theirs)."""
    cut = buckets(state, bucket_mb << 20, getattr(torch, engine.cfg.dtype))
    if tp is None:
        return engine.update_weights(cut, version=version)
    return tp.push(lambda walk, exchange: engine.update_weights(walk, version=version, exchange=exchange), cut)


def serve(tp: TPExchange, state: Weights, bucket_mb: int) -> None:
    """A rank without engines in a tensor-parallel group: cut the same buckets as its host
    (``tp.dtype``, the engine's) from its own copy of ``state`` and serve them to the TP
    rank on its GPU. Collective over the group (and ``state``'s lazy gather)."""
    tp.serve(buckets(state, bucket_mb << 20, tp.dtype))


@dataclasses.dataclass(frozen=True)
class TPExchange:
    """This rank's tensor-parallel group: ``group`` (gloo subgroup, TP rank order),
    ``dtype`` and ``flattened`` of the engine's buckets (every rank cuts the same ones),
    ``serialize`` (SGLang's serializer; a test may pass another)."""

    group: Any
    dtype: torch.dtype
    flattened: bool
    serialize: Serialize = serialize_bucket

    def push(self, update: Update, cut: Iterable[Bucket]) -> float:
        """Host: ``update(buckets, exchange)`` with an exchange that hands the engine every
        TP rank's payload of each bucket; returns its seconds. On failure the rest of the
        protocol is still taken (no peer waits forever), then the error is raised."""
        walk = _Counted(cut)
        steps = _Steps(self.group)
        try:
            seconds = update(walk, steps.exchange)
        except BaseException:
            with contextlib.suppress(Exception):
                steps.finish(walk)
            raise
        steps.barrier()  # the last bucket is loaded
        return seconds

    def serve(self, cut: Iterable[Bucket]) -> None:
        """A rank without engines: serialize its own copy of each bucket for the host and
        keep it until the host's update call with it has returned. A failure to serialize
        sends empty payloads from then on (the host stops with an error) and is raised at
        the end, after the protocol."""
        held, failure = None, None
        for index, (bucket, _last) in enumerate(with_last(cut)):
            if index:
                group_barrier(self.group)  # the host loaded the bucket before
            held, payload = None, b""
            if failure is None:
                try:
                    held, payload = self.serialize(bucket, self.flattened)
                except Exception as exc:  # noqa: BLE001 - raised after the protocol, below
                    failure = exc
            gather_to_first(payload, self.group)
        group_barrier(self.group)  # the host loaded the last bucket
        del held
        if failure is not None:
            raise failure


def tp_exchange(placement, dtype: str, flattened: bool) -> TPExchange | None:
    """This rank's :class:`TPExchange` (``placement.tp_size`` > 1; None otherwise, with no
    collective). Collective when it is not None: every rank creates every TP group's
    subgroup, in the same order."""
    if placement.tp_size == 1:
        return None
    group = new_groups(placement.tp_groups, placement.rank)
    load_serializer()  # here, not under the first push: SGLang's import would keep that push's bucket alive
    return TPExchange(group, getattr(torch, dtype), flattened)


class _Counted:
    """The buckets of one push, counting those drawn (a failed push goes on from there)."""

    def __init__(self, cut: Iterable[Bucket]) -> None:
        self._items: Iterator[Bucket] = iter(cut)
        self.drawn = 0
        self.done = False

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Bucket:
        try:
            item = next(self._items)
        except StopIteration:
            self.done = True
            raise
        self.drawn += 1
        return item


@dataclasses.dataclass
class _Steps:
    """The host's side of one push: the collectives taken so far."""

    group: Any
    gathers: int = 0
    barriers: int = 0

    def barrier(self) -> None:
        group_barrier(self.group)
        self.barriers += 1

    def exchange(self, own: bytes) -> list[bytes]:
        """Every TP rank's payload of the next bucket (the host's own first), after the
        barrier that lets the peers drop the bucket before."""
        if self.gathers:
            self.barrier()
        payloads = gather_to_first(own, self.group)
        self.gathers += 1
        missing = [rank for rank, payload in enumerate(payloads) if not payload]
        if missing:
            raise RuntimeError(f"tensor-parallel rank(s) {missing} could not serialize their copy of the weights "
                               "(see that rank's error)")
        return payloads

    def finish(self, walk: _Counted) -> None:
        """After a failure: the rest of the protocol in the peers' order (bucket j+1 drawn
        before bucket j's barrier and gather), empty payloads, then the last barrier."""
        while True:
            while not walk.done and walk.drawn < self.gathers + 2:
                next(walk, None)
            if self.gathers >= walk.drawn:
                break
            if self.gathers and self.barriers < self.gathers:
                self.barrier()
            gather_to_first(b"", self.group)
            self.gathers += 1
        self.barrier()
