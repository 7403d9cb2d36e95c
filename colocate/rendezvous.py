"""torchrun's rendezvous for ``colocate train --nproc N`` on one node, with nothing that
listens beyond loopback.

Owns: the rendezvous handler ``colocate train --nproc`` names (:data:`BACKEND`): torchrun's
own c10d rendezvous over a file store (no socket), and the store the launcher shares with
its ranks (their process group meets in it, and a failed rank leaves its line there)
listening on 127.0.0.1 only. torchrun's ``--standalone`` puts both on TCP stores, which
torch binds on every interface whatever host they are given; torch has no argument for
the address a store listens on, only for a socket the caller opened itself
(``master_listen_fd``), which is what this handler passes.
Leaves out: the launch itself (``colocate.launch``); multi-node rendezvous (torchrun's
own flags, see README: its stores must listen beyond loopback there).
"""

from __future__ import annotations

import socket

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

BACKEND = "colocate-loopback"  # torchrun's --rdzv-backend
LOOPBACK = "127.0.0.1"


def loopback_store(port: int = 0) -> TCPStore:
    """A TCP store server listening on 127.0.0.1:``port`` (0: a free port) only."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(socket.SOMAXCONN)
    # the store owns the socket from here (detach: Python never closes it)
    return TCPStore(LOOPBACK, sock.getsockname()[1], is_master=True, multi_tenant=True,
                    wait_for_workers=False, master_listen_fd=sock.detach())


class LoopbackRendezvous(DynamicRendezvousHandler):
    """torchrun's dynamic rendezvous whose store shared with the ranks listens on loopback."""

    def get_backend(self) -> str:
        return BACKEND

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return loopback_store(master_port)


def create(params: RendezvousParameters) -> LoopbackRendezvous:
    """The handler for torchrun's ``params`` (``--rdzv-conf store_type=file``: the
    rendezvous state in the file ``--rdzv-endpoint`` names; ``--local-addr 127.0.0.1``: the
    ranks reach the shared store on loopback)."""
    backend, store = create_backend(params)
    return LoopbackRendezvous.from_backend(params.run_id, store, backend, params.min_nodes, params.max_nodes,
                                           local_addr=params.local_addr)


def register() -> None:
    """Make :data:`BACKEND` known to torchrun in this process (again: no effect)."""
    rendezvous_handler_registry.register(BACKEND, create)


def rendezvous_args(state_file: str) -> list[str]:
    """torchrun's arguments that select this rendezvous, its state in ``state_file`` (a
    path that does not exist yet; torch removes it when the last process leaves)."""
    return [f"--rdzv-backend={BACKEND}", f"--rdzv-endpoint={state_file}", "--rdzv-conf=store_type=file",
            f"--local-addr={LOOPBACK}"]

