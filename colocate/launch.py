"""Starting ``colocate train`` on several training processes of one node through torchrun.

Owns: the torchrun argument list for ``colocate train --nproc N`` and running torch's own
launcher (``torch.distributed.run``) in this process; a failed rank becomes one line (its
own error is printed above by that rank). Multi-node runs use torchrun directly with its
own flags (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``), see README.
Leaves out: what a rank does (``colocate.api``); the rendezvous (``colocate.rendezvous``:
torchrun's, its stores on loopback).
"""

from __future__ import annotations

import os
import signal
import tempfile
from typing import Sequence

from colocate.errors import ColocateError, ConfigError

TORCHRUN_ENV = ("LOCAL_RANK", "WORLD_SIZE")  # set by torchrun in every rank


def under_torchrun(environ=os.environ) -> bool:
    return all(key in environ for key in TORCHRUN_ENV)


def torchrun_args(nproc: int, train_args: Sequence[str], state_file: str) -> list[str]:
    """The arguments of ``torchrun RENDEZVOUS --nnodes=1 --nproc-per-node N -m colocate.cli
    train ARGS`` (RENDEZVOUS: ``colocate.rendezvous``'s on loopback, its state in ``state_file``)."""
    from colocate import rendezvous  # torch's launcher: heavy, only --nproc needs it

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1 (got {nproc})")
    return [*rendezvous.rendezvous_args(state_file), "--nnodes=1", f"--nproc-per-node={nproc}",
            "-m", "colocate.cli", "train", *train_args]


def run_torchrun(nproc: int, train_args: Sequence[str]) -> None:
    """Start ``nproc`` ranks of ``colocate train ARGS`` on this node and wait for them,
    every socket of the launch on loopback (the rendezvous, the ranks' gloo and NCCL)."""
    # here, not at the top: torch's launcher is heavy and only --nproc needs it
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from colocate import rendezvous
    from colocate.trainer.distributed import loopback_transports

    rendezvous.register()
    loopback_transports()  # the ranks inherit it: one node's ranks meet on loopback
    with tempfile.TemporaryDirectory(prefix="colocate-rdzv-") as state:
        try:
            torchrun(torchrun_args(nproc, train_args, os.path.join(state, "rendezvous")))
        except ChildFailedError as exc:
            rank, first = min(exc.failures.items(), key=lambda kv: kv[1].timestamp, default=(None, None))
            raise ColocateError(failure_line(rank, first.exitcode if first is not None else None, nproc)) from None


def failure_line(rank: int | None, exitcode: int | None, nproc: int) -> str:
    """The one line for the rank that failed first: its own error is printed above it,
    unless a signal killed it (then nothing is, and the signal is named)."""
    if rank is None:
        return f"a rank of {nproc} failed; its error is printed above"
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else f"signal {-exitcode}"
        why = (" (most likely the kernel's out-of-memory killer: see dmesg; fewer processes, a smaller model "
               "or a critic-free ppo.advantage need less memory)") if name == "SIGKILL" else ""
        return f"rank {rank} of {nproc} was killed by {name}{why}; the other ranks stopped after it"
    return f"rank {rank} (exit code {exitcode}) of {nproc} failed first; its error is printed above"
