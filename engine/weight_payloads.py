"""What a weight update sends: one serialized payload of a bucket per tensor-parallel rank.

Owns: the one look-ahead over buckets that every weight push walks (:func:`with_last`: a
lazily gathered state's collectives run in the same order on every rank that walks it), a
bucket's form on the wire (a tensor list, or SGLang's ``flattened_bucket``: one byte
tensor + metadata, which crosses as one CUDA-IPC handle) and its serialization
(:func:`serialize_bucket`, also for a training rank that hosts no engine but serves its
own copy to a tensor-parallel engine), and the list indexed by TP rank that SGLang 0.5.23
reads (``UpdateWeightsFromTensorReqInput.serialized_named_tensors``: TP rank i
deserializes entry i, and only it, so every entry is a serialization of its own, each with
its own CUDA-IPC refcount) (:func:`rank_payloads`).

Leaves out: the engine calls (``engine.runtime``); how the payloads of other training
ranks are brought here (an ``Exchange`` the caller passes; ``colocate.run.weight_sync``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, TypeVar

from . import sglang_api

Item = TypeVar("Item")
Bucket = list[tuple[str, Any]]
# The host's own serialized payload of a bucket -> the payloads of every TP rank, in TP
# rank order (its own first): each rank's copy of the bucket, serialized on its own GPU.
Exchange = Callable[[bytes], list[bytes]]


def load_serializer() -> None:
    """Import SGLang's serializer now, from a caller that holds no tensors: SGLang 0.5.23's
    first import keeps the importing call stack's frames, and so their locals, alive for
    the life of the process (measured on CPU: the first bucket serialized by the call that
    imported SGLang was never freed). A rank without engines calls this at build."""
    sglang_api.load()


def with_last(items: Iterable[Item]) -> Iterator[tuple[Item, bool]]:
    """``(item, is_last)`` with one look-ahead: item k is handed out only after item k+1
    was drawn (or the end seen). Every rank pushing one lazily gathered state walks it with
    this, so the gather's collectives and the per-bucket exchange interleave alike."""
    pending = iter(items)
    current = next(pending, None)
    while current is not None:
        following = next(pending, None)
        yield current, following is None
        current = following


def bucket_data(bucket: Bucket, flattened: bool) -> Any:
    """The bucket as SGLang loads it: the tensor list itself, or (``flattened``) one byte
    tensor plus metadata (``load_format="flattened_bucket"``), on the tensors' device."""
    if not flattened:
        return bucket
    flat = sglang_api.load().FlattenedTensorBucket(named_tensors=bucket)
    return {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}


def serialize(data: Any) -> bytes:
    """SGLang's serialization of ``data`` (a CUDA tensor becomes a CUDA-IPC handle of this
    process's memory: ``data`` must stay alive until the engine has loaded it)."""
    return sglang_api.load().MultiprocessingSerializer.serialize(data)


def serialize_bucket(bucket: Bucket, flattened: bool) -> tuple[Any, bytes]:
    """``(data, payload)``: the bucket in its wire form and its serialization; the caller
    keeps ``data`` alive until the engine has loaded the payload."""
    data = bucket_data(bucket, flattened)
    return data, serialize(data)


def rank_payloads(data: Any, tp_size: int, exchange: Exchange | None = None) -> list[bytes]:
    """``serialized_named_tensors``: entry i for TP rank i. Without ``exchange``, ``tp_size``
    serializations of this process's ``data`` (every TP rank opens memory here); with it,
    what it returns for this process's own payload (each rank's copy on its own GPU)."""
    if exchange is None:
        return [serialize(data) for _ in range(tp_size)]
    return list(exchange(serialize(data)))
