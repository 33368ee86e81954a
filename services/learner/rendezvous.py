"""Where the learner's ranks meet: rank 0's torch.distributed store, bound to one address.

``init_process_group`` with ``MASTER_ADDR``/``MASTER_PORT`` makes rank 0 start a TCPStore that
listens on every interface (``::``), whatever ``MASTER_ADDR`` says: the one socket of a mempo
cluster that other machines could reach. Here rank 0 binds the socket itself, to loopback on a
single machine or to its node's cluster address in cluster mode (``store_host="node"``), on a port
the OS picks (no race between choosing a free port and binding it), and hands it to the store.

    sock = listen("127.0.0.1")                              # rank 0
    store = group_store(0, world, *sock.getsockname()[:2], sock)
    store = group_store(r, world, host, port)               # ranks r > 0, with rank 0's (host, port)
    dist.init_process_group(backend, store=store, rank=r, world_size=world)
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

LOOPBACK = "127.0.0.1"
NODE = "node"  # rank 0's node address in the Ray cluster (ranks on several nodes)
RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)  # ranks of a group start together; a slow one may take minutes


def bind_address(store_host: str) -> str:
    """The address ``store_host`` names: an IP as given, ``"node"`` this node's Ray address."""
    if store_host == NODE:
        import ray  # on use: the workers also run where there is no Ray (bench/gpu.py on a bare GPU machine)

        return ray.util.get_node_ip_address()
    return store_host


def listen(store_host: str = LOOPBACK) -> socket.socket:
    """A listening TCP socket on ``store_host`` (an IPv4/IPv6 literal or ``"node"``), port chosen by the OS."""
    host = bind_address(store_host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def group_store(rank: int, world: int, host: str, port: int, listener: socket.socket | None = None):
    """Rank 0 (with its ``listener``) serves the store on that socket; every other rank connects to it."""
    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 serves the store: pass the socket from listen()")
        # the libuv store takes the bound socket over (and closes it); the classic backend would open
        # its own on '::'
        return dist.TCPStore(host, port, world, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False,
                             master_listen_fd=listener.detach(), use_libuv=True)
    return dist.TCPStore(host, port, world, False, timeout=RENDEZVOUS_TIMEOUT)
