"""The learner's rendezvous (services/learner/rendezvous.py): two gloo ranks in their own processes
meet at rank 0's store, and no process of the group listens on anything but loopback."""

import multiprocessing as mp

import pytest

from services.learner.rendezvous import LOOPBACK, group_store, listen
from tests.pipeline.sockets import exposed, listening


def _rank(rank: int, world: int, address, queue, barrier) -> None:
    import os

    import torch
    import torch.distributed as dist

    sock = listen(LOOPBACK) if rank == 0 else None
    if rank == 0:
        address.extend(sock.getsockname()[:2])
    barrier.wait()
    host, port = address[0], address[1]
    store = group_store(rank, world, host, port, sock)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    dist.barrier()  # every rank's gloo pairs are up: what a process listens on now is what it keeps
    queue.put((rank, t.tolist(), listening(os.getpid())))
    barrier.wait()
    dist.destroy_process_group()


def test_two_ranks_meet_at_rank_zero_and_listen_on_loopback_only():
    ctx = mp.get_context("spawn")
    world = 2
    with ctx.Manager() as manager:
        address, queue, barrier = manager.list(), manager.Queue(), manager.Barrier(world)
        procs = [ctx.Process(target=_rank, args=(r, world, address, queue, barrier)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            results = sorted(queue.get(timeout=120) for _ in procs)
            store = (address[0], address[1])
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    assert [r[1] for r in results] == [[3.0, 3.0], [3.0, 3.0]]  # the all-reduce went through the group
    listeners = [entry for _, _, found in results for entry in found]
    assert store in {(host, port) for host, port, _ in results[0][2]}  # rank 0 serves the store where it bound
    assert exposed(listeners) == [], exposed(listeners)  # the store too, not only gloo's pairs


def test_rank_zero_needs_its_socket():
    with pytest.raises(ValueError, match="rank 0 serves the store"):
        group_store(0, 1, LOOPBACK, 1)
