"""Process group and FSDP2 plumbing for the trainer.

Owns: joining (or creating) the process group (`init_distributed`), FSDP2 sharding of a
decoder-only model (`shard_model`: each decoder layer, then the root), gathering a full
HF-named state dict to rank 0 (`full_state_dict`), to every rank (`full_state_everywhere`)
or lazily on the device (`full_tensors`),
broadcasting objects from rank 0 (`broadcast_object`) and gathering every rank's
(`all_gather_object`), element-wise sums and maxima over ranks (`all_reduce_sum`, `all_reduce_max`), a barrier
(`barrier`), subgroups of ranks with a gather of objects to a group's first rank and a barrier
on the group (`new_groups`, `gather_to_first`, `group_barrier`), telling a
collective that failed because another rank went away (`lost_peer`), and leaving a failed
rank's line for the others in the process group's store (`post_failure`, `posted_failure`).

Leaves out: models, optimizers and PPO (`trainer/ppo_trainer.py`). Backends: gloo on CPU
(tests use 1-2 ranks on loopback), nccl on CUDA with gloo beside it for host tensors
(a checkpoint of a trainer whose shards are offloaded to the host). A world of one needs no launcher
and no socket: a single-process group over an in-memory store, its gloo (and NCCL)
transport on the loopback interface (`loopback_transports`: nothing of the process listens
beyond loopback). Under torchrun the env:// rendezvous that torchrun set up is used
(torchrun's variables are its interface; colocate passes no configuration through the
environment).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .errors import TrainerError

_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """This process's place in the process group."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def mesh(self) -> DeviceMesh:
        """1-D mesh over the whole world (reuses the default group)."""
        return init_device_mesh(self.device.type, (self.world_size,))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_distributed(
    device: str | torch.device = "cpu",
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
) -> DistInfo:
    """Join the default process group, creating it if needed; returns this rank's `DistInfo`.

    Order: an existing group is reused; explicit `rank`/`world_size`/`init_method` (e.g.
    `torch.multiprocessing.spawn` workers) are used as given; torchrun's env:// rendezvous
    when its variables are present; otherwise a one-process group on a free loopback port.
    On CUDA each rank uses `cuda:<local_device_index(LOCAL_RANK or rank, device count)>`.
    ``timeout_s``: how long a collective may wait (None: torch's default, 10 min for
    NCCL); ranks > 0 wait through rank 0's whole rollout at one.
    """
    kind = torch.device(device).type
    needed = "nccl" if kind == "cuda" else "gloo"
    backend = "cpu:gloo,cuda:nccl" if kind == "cuda" else "gloo"
    if not dist.is_initialized():
        kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
        if init_method is not None:
            dist.init_process_group(backend, init_method=init_method, rank=rank or 0, world_size=world_size or 1, **kw)
        elif all(key in os.environ for key in _TORCHRUN_KEYS):
            dist.init_process_group(backend, init_method="env://", **kw)
        else:  # a world of one: nobody to meet, so no TCP store (it would listen on every interface)
            loopback_transports()
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kw)
    if needed not in dist.get_backend():
        raise TrainerError(f"a {dist.get_backend()} process group exists, but device {device} needs {needed}")
    info_rank, info_world = dist.get_rank(), dist.get_world_size()
    torch_device = torch.device("cpu")
    if kind == "cuda":
        index = local_device_index(int(os.environ.get("LOCAL_RANK", info_rank)), torch.cuda.device_count())
        torch_device = torch.device("cuda", index)
        torch.cuda.set_device(torch_device)
    return DistInfo(info_rank, info_world, torch_device, dist.get_backend())


TRANSPORT_INTERFACES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # torch's gloo and NCCL read these
LOOPBACK_INTERFACE = "lo"


def loopback_transports(environ=os.environ) -> None:
    """Put gloo's and NCCL's sockets on the loopback interface for a world of one (and for
    the processes it starts: SGLang's schedulers), unless the user named an interface.

    Gloo listens on the address the machine's hostname resolves to (often the external
    one) and NCCL on its first non-loopback interface, even with one rank; both read the
    interface from these variables when their first group is made, and torch has no
    argument for it. Process set-up, set once: a world of one never meets another host."""
    for name in TRANSPORT_INTERFACES:
        environ.setdefault(name, LOOPBACK_INTERFACE)


def local_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device index of the process with ``local_rank`` on its node when it sees
    ``visible`` devices: the one rule of the trainer's device and its engines' first GPU
    (``colocate.run.placement``). Every device visible: its own (``local_rank``); one device
    per process (``CUDA_VISIBLE_DEVICES`` set per rank by a launcher): 0, the only one."""
    return local_rank % visible if visible > 0 else local_rank


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers model, in order: the modules of the classes it
    declares unsplittable (``_no_split_modules``, the blocks accelerate and FSDP auto-wrap
    shard), which is `model.model.layers` of a Llama/Qwen2-style model and e.g.
    `model.decoder.layers` of OPT's or `transformer.h` of GPT-2's (a critic's: its
    backbone's); under a PEFT wrapper, those of the model it wraps."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    blocks = {name for m in model.modules() for name in (getattr(m, "_no_split_modules", None) or ())}
    layers: dict[str, nn.Module] = {}
    for name, module in model.named_modules():  # the outermost: FSDP shards a block once, before its owner
        declared = any(cls.__name__ in blocks for cls in type(module).__mro__)  # sharded: FSDP's subclass of it
        if declared and not any(name.startswith(f"{outer}.") for outer in layers):
            layers[name] = module
    if not layers:
        raise TypeError(f"{type(model).__name__} declares no decoder layer classes (_no_split_modules) to shard")
    return list(layers.values())


def shard_model(model: nn.Module, info: DistInfo, param_dtype: torch.dtype | None = None) -> nn.Module:
    """FSDP2 in place: `fully_shard` each decoder layer, then the root; returns `model`.

    Parameters stay in their load dtype (fp32 master weights); `param_dtype` (e.g.
    bfloat16) makes forward/backward compute in that dtype with fp32 gradient reduction.
    """
    mesh = info.mesh()
    policy = precision_policy(param_dtype)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for compute in ``param_dtype``: the all-gathered parameters cast to it
    for forward/backward, gradients reduced in float32 into the float32 master shards (the
    optimizer steps those); None or float32: no casting."""
    if param_dtype is None or param_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def first_pass(model: nn.Module, device: torch.device) -> None:
    """One no-grad forward of a token through a sharded model, then reshard it.

    FSDP2 fixes each group's gradient dtypes at the model's first forward, from the
    parameters that require grad at that moment. A LoRA actor's first pass in a step is the
    reference, under PEFT's ``disable_adapter``, which turns the adapters' ``requires_grad``
    off: under bf16 compute, torch 2.11's FSDP2 then found no trainable parameter, reduced
    bf16 gradients and refused to store them in the fp32 shards (found on an H200; torch
    2.14 falls back to the floating parameters' dtypes). A first pass while the parameters
    to train require grad fixes the dtypes from them on every torch. The root's parameters
    stay unsharded after a forward, so it reshards (a checkpoint loads into shards).
    """
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device))
    model.reshard()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict with the model's own names on rank 0; {} on other ranks.

    Collective: every rank must call it. The tensors are never the live parameters.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return unaliased(get_model_state_dict(model, options=options), model.parameters())


def full_tensors(model: nn.Module, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the model's state (the names ``keep`` accepts; None: all), one
    at a time, on the model's device: lazy and collective (every rank must iterate it to the
    end, in step); the device holds one full tensor beyond the shards while the consumer
    keeps none."""
    for name, tensor in model.state_dict().items():
        if keep is not None and not keep(name):
            continue
        yield name, (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def full_state_everywhere(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict with the model's own names on every rank: each rank
    pushes it into its own engine. Collective; gathered one tensor at a time."""
    return {name: full.to("cpu", copy=True) for name, full in full_tensors(model)}


def local_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (its local shard for a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def unaliased(state: Any, live: Iterable[torch.Tensor]) -> Any:
    """`state` (nested dicts/lists) with every tensor that shares storage with a `live` tensor cloned.

    torch's "full, CPU" state dict of a one-rank CPU group hands back the parameters
    (and optimizer moments) themselves: the next optimizer step would rewrite it.
    """
    live_storages = {_storage(t) for t in live if isinstance(t, torch.Tensor)}

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        if isinstance(obj, torch.Tensor) and _storage(obj) in live_storages:
            return obj.clone()
        return obj

    return walk(state)


def broadcast_object(obj: object, info: DistInfo) -> object:
    """Rank 0's `obj` on every rank (pickled; fine for rollout lists, not for big tensors)."""
    if info.world_size == 1:
        return obj
    box = [obj if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj: object, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order, on every rank (pickled; fine for rollouts)."""
    if info.world_size == 1:
        return [obj]
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")  # gloo's words


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away (NCCL's
    `DistBackendError`, or gloo's transport error on a closed connection)."""
    backend_error = getattr(dist, "DistBackendError", ())
    return isinstance(exc, backend_error) or (isinstance(exc, RuntimeError) and any(m in str(exc) for m in PEER_LOST))


FAILURE_KEY = "colocate/first_failure"


def post_failure(text: str, info: DistInfo) -> None:
    """Leave ``text`` in the process group's store for the other ranks, unless another
    rank's is there already (the first failure wins). Store calls are not collectives: they
    never wait on a rank stuck in one. A store that is gone (its host rank died) takes
    nothing: this never raises."""
    if info.world_size == 1:
        return
    try:
        dist.distributed_c10d._get_default_store().compare_set(FAILURE_KEY, "", text)
    except Exception:  # noqa: BLE001 - best effort on a failure path: the caller raises its own error
        pass


def posted_failure(info: DistInfo) -> str | None:
    """The line ``post_failure`` left in the store, if any (None when the store is gone).
    Under torchrun the store lives in the launcher, so it outlives every rank."""
    if info.world_size == 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        return store.get(FAILURE_KEY).decode() if store.check([FAILURE_KEY]) else None
    except Exception:  # noqa: BLE001 - nothing to read back: the caller says what it knows
        return None


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Element-wise sum over ranks (a new tensor; `values` is left alone)."""
    total = values.detach().clone()
    if info.world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def all_reduce_max(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Element-wise maximum over ranks (a new tensor; `values` is left alone)."""
    total = values.detach().clone()
    if info.world_size > 1:
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return total


def new_groups(groups: Sequence[Sequence[int]], rank: int) -> Any:
    """Create a gloo subgroup for each of ``groups`` (lists of global ranks), in order, and
    return the one ``rank`` belongs to (None if none). Collective: every rank of the world
    must call it with the same ``groups``. Gloo: the groups carry small pickled objects and
    barriers, never tensors of the model."""
    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks), backend="gloo")
        if rank in ranks:
            mine = group
    return mine


def gather_to_first(obj: object, group: Any) -> list | None:
    """Every member's ``obj``, in ``group``'s rank order, on the group's first rank; None
    on the others (pickled; for small objects). Collective over ``group``: a member returns
    only once every member, the first included, has called it."""
    first = dist.get_rank(group) == 0
    out: list | None = [None] * dist.get_world_size(group) if first else None
    dist.gather_object(obj, out, group=group, group_dst=0)
    return out


def group_barrier(group: Any) -> None:
    """Wait until every member of ``group`` (a gloo subgroup of ``new_groups``) is here."""
    dist.barrier(group=group)


def barrier(info: DistInfo) -> None:
    """Wait until every rank reaches this point (nothing with a world of one)."""
    if info.world_size == 1:
        return
    if info.device.type == "cuda":
        dist.barrier(device_ids=[info.device.index])
    else:
        dist.barrier()
