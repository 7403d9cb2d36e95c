"""Who generates where: the one owner of the engines' placement over the training ranks.

Owns: :class:`Placement`, which says, for this rank, whether it hosts SGLang engines (every
rank with ``engines.tp_size`` 1, the first rank of each tensor-parallel group otherwise),
which share of the rollout it runs (``rollout.batch_size`` split over the engine ranks in
whole groups), its engine rank r of R (by which its data source draws positions
``base + k·R + r`` and names its samples in the step's union, ``sample.union_id``),
and where its engines
run (GPU ``base_gpu_id``: the trainer's own device, by the one rule
``trainer.distributed.local_device_index``, so under a launcher that shows each process
one GPU both pick 0; on CPU the rank's share of the cores; NCCL ports
from disjoint per-rank ranges, so ranks starting engines side by side never race for one),
and its tensor-parallel group (``tp_size`` consecutive ranks; TP rank i on the GPU of the
group's i-th rank, ``gpu_id`` + i).

Leaves out: joining the ranks' rollouts (``colocate.rollout.rollouts.join``), the streams
themselves (``colocate.rollout.data_source``); starting the engines (``colocate.run.builder``).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from typing import Mapping

from colocate.errors import ConfigError
from colocate.trainer.distributed import local_device_index

PORT_BASE = 31000  # NCCL ports of the engines' schedulers: PORT_BASE + PORT_SPAN * (2 * local rank + role)
PORT_SPAN = 40
ROLES = ("actor", "reward")


@dataclasses.dataclass(frozen=True)
class Placement:
    """This rank's place in the run: ``rank``/``world`` of the process group,
    ``local_rank``/``local_world`` on its node, ``tp_size`` ranks per engine,
    ``visible_gpus`` CUDA devices this process sees (0: none, or not known)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    tp_size: int = 1
    visible_gpus: int = 0

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.local_world % self.tp_size:
            raise ConfigError(f"engines.tp_size: {self.tp_size} must be >= 1 and divide the {self.local_world} "
                              "training processes of each node (an engine's ranks share one node)")
        if self.visible_gpus and self.hosts_engines and self.gpu_id + self.tp_size > self.visible_gpus:
            raise ConfigError(
                f"engines.tp_size: {self.tp_size} GPUs from GPU {self.gpu_id} on, but this process sees "
                f"{self.visible_gpus}; let every process of the node see all its GPUs (CUDA_VISIBLE_DEVICES) "
                "or use engines.tp_size=1")

    @property
    def hosts_engines(self) -> bool:
        return self.local_rank % self.tp_size == 0

    @property
    def tp_rank(self) -> int:
        """This rank's place in its tensor-parallel group: the engine's TP rank whose GPU is
        this rank's (``gpu_id`` of the group's first rank + ``tp_rank``, SGLang's order)."""
        return self.local_rank % self.tp_size

    @property
    def tp_groups(self) -> list[list[int]]:
        """The global ranks of every tensor-parallel group, in TP rank order: consecutive
        ranks (torchrun numbers a node's processes consecutively, and ``tp_size`` divides
        them), the first hosting the engine."""
        return [list(range(start, start + self.tp_size)) for start in range(0, self.world, self.tp_size)]

    @property
    def engine_rank(self) -> int:
        """This rank's index among the engine ranks (its TP group's, for a rank without engines)."""
        return self.rank // self.tp_size

    @property
    def engine_ranks(self) -> int:
        return self.world // self.tp_size

    @property
    def gpu_id(self) -> int:
        """First GPU of this rank's engines (SGLang ``base_gpu_id``): the trainer's own
        device (``local_device_index``: the local rank, or 0 when the process sees one GPU)."""
        return local_device_index(self.local_rank, self.visible_gpus)

    def share(self, batch_size: int, group_size: int = 1) -> int:
        """Samples this rank's engines run per step (B/R; whole groups)."""
        ranks = self.engine_ranks
        if batch_size % (ranks * group_size):
            raise ConfigError(
                f"rollout.batch_size: {batch_size} does not split over {ranks} engine ranks in whole groups of "
                f"rollout.group_size {group_size}; make it a multiple of {ranks * group_size}")
        return batch_size // ranks

    def engine_cores(self, cores: int) -> int:
        """CPU cores of this rank's engines: the node's cores over its engine ranks."""
        return max(1, cores // max(1, self.local_world // self.tp_size))

    def nccl_port(self, role: str) -> int:
        """A free port for the ``role`` engine's scheduler, from a range no other rank of this
        node draws from (two ranks starting engines at the same moment cannot pick one port)."""
        start = PORT_BASE + PORT_SPAN * (2 * self.local_rank + ROLES.index(role))
        for port in range(start, start + PORT_SPAN):
            if _free(port):
                return port
        raise ConfigError(f"no free port in {start}-{start + PORT_SPAN - 1} for the {role} engine of local rank "
                          f"{self.local_rank}; free one (another run on this node?)")


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def placement_of(dist, tp_size: int = 1, environ: Mapping[str, str] = os.environ,
                 visible_gpus: int = 0) -> Placement:
    """This process's placement (``dist``: its `DistInfo`); torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` say where it sits on its node (one node when they are unset);
    ``visible_gpus``: ``torch.cuda.device_count()`` on a CUDA run (0 on CPU)."""
    local_rank = int(environ.get("LOCAL_RANK", dist.rank))
    local_world = int(environ.get("LOCAL_WORLD_SIZE", dist.world_size))
    return Placement(dist.rank, dist.world_size, local_rank, local_world, tp_size, visible_gpus)
