"""The weight group (services/common/weight_broadcast.py) without Ray: a publisher and a replica in
their own processes; the replica stages exactly the publisher's bytes (every dtype, tensors across
and larger than a bucket), nothing of either listens beyond loopback, and a publisher that dies
mid-broadcast makes the replica fail at once instead of waiting. In cluster mode (``ray.address``
set) every listener of the group is on the node's cluster address, still never every interface.

    .venv/bin/python -m pytest -q -x tests/common/test_weight_broadcast.py
"""

import ipaddress
import multiprocessing as mp
import os
import time

import psutil
import pytest
import torch

from services.common import weight_broadcast as wb
from tests.pipeline.sockets import exposed, listening

BUCKET = 4096


def _state() -> dict:
    gen = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(40, 33, generator=gen),  # 5,280 bytes: a bucket of its own
            "half": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
            "ids": torch.arange(13, dtype=torch.int64),
            "scalar": torch.tensor(3.5),
            "empty": torch.zeros(0, 4),
            "tail": torch.randn(300, generator=gen)}


def _as_cluster_node(node_ip: str | None) -> None:
    """Cluster mode in this process: Ray says this node's address is ``node_ip`` (no Ray started)."""
    if node_ip:
        import ray.util

        ray.util.get_node_ip_address = lambda: node_ip


def _publisher(address, queue, die_after: int, node_ip: str | None = None) -> None:
    from services.learner.rendezvous import LOOPBACK, NODE, group_store, listen

    _as_cluster_node(node_ip)
    state = _state()
    plan = wb.layout(state, BUCKET)
    sock = listen(NODE if node_ip else LOOPBACK)
    host, port = sock.getsockname()[:2]
    address.extend([host, port])
    store = group_store(0, 2, host, port, sock)
    pg = wb.group(store, 0, 2, "g1", 30, wb.local_address(host))
    if die_after:
        buf = torch.zeros(wb.bucket_size(plan[0]), dtype=torch.uint8)
        opts = wb._options()
        pg.broadcast([buf], opts).wait()  # one bucket of several, then the process is gone
        queue.put(("publisher", listening(os.getpid())))
        time.sleep(1)
        os._exit(1)
    wb.send(pg, state, plan, 30)
    queue.put(("publisher", listening(os.getpid())))
    time.sleep(2)


def _replica(address, queue, node_ip: str | None = None) -> None:
    _as_cluster_node(node_ip)
    while len(address) < 2:
        time.sleep(0.05)
    state = _state()
    plan = wb.layout(state, BUCKET)
    r = wb.Receiver()
    rank = r.join(address[0], address[1], 2, "g1", 30)
    t0 = time.monotonic()
    try:
        r.receive("g1", 7, plan, 30)
    except RuntimeError as e:
        queue.put(("replica", ("failed", time.monotonic() - t0, str(e)[:80], r.group_id)))
        return
    got = r.tensors(7)
    same = all(got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(_bytes(got[k]), _bytes(v))
               for k, v in state.items())
    queue.put(("replica", ("ok", rank, same, list(got) == list(state), listening(os.getpid()))))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _run(die_after: int, node_ip: str | None = None) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        address, queue = manager.list(), manager.Queue()
        procs = [ctx.Process(target=_publisher, args=(address, queue, die_after, node_ip)),
                 ctx.Process(target=_replica, args=(address, queue, node_ip))]
        for p in procs:
            p.start()
        try:
            return dict(queue.get(timeout=90) for _ in procs)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()


def test_a_replica_stages_the_publishers_bytes_and_nothing_listens_beyond_loopback():
    plan = wb.layout(_state(), BUCKET)
    assert len(plan) >= 2 and all(off % wb.ALIGN == 0 for b in plan for *_, off, _ in b)
    out = _run(die_after=0)
    status, rank, same, order, replica_listeners = out["replica"]
    assert status == "ok" and rank == 1 and same and order
    everything = replica_listeners + out["publisher"]
    assert everything and exposed(everything) == [], exposed(everything)


def test_a_publisher_dying_mid_broadcast_fails_the_replica_at_once():
    out = _run(die_after=1)
    status, seconds, message, group = out["replica"]
    assert status == "failed" and seconds < 15, out  # not the 30 s timeout: the closed connection ends it
    assert group is None  # it left the group: the publisher builds a new one next time


def _node_ip() -> str | None:
    """A non-loopback IPv4 address of this machine (what Ray would call the node's address)."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


def test_the_listener_address_is_loopback_on_one_machine_and_the_node_address_in_cluster_mode(monkeypatch):
    import ray.util

    from services.learner.collective import store_host
    from services.learner.rendezvous import LOOPBACK, NODE, bind_address

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert store_host("") == LOOPBACK and bind_address(store_host("")) == "127.0.0.1"  # no ray.address
    assert store_host("10.1.2.3:6379") == NODE and bind_address(NODE) == "10.1.2.3"
    assert wb.local_address("127.0.0.1") == "127.0.0.1"  # a replica joins a loopback store: loopback
    assert wb.local_address("10.1.2.3") == "10.1.2.3"  # a cluster store: the node's address, not 0.0.0.0


def test_in_cluster_mode_every_listener_of_the_group_is_on_the_node_address():
    node_ip = _node_ip()
    if node_ip is None:
        pytest.skip("no non-loopback IPv4 address on this machine")
    out = _run(die_after=0, node_ip=node_ip)
    status, rank, same, order, replica_listeners = out["replica"]
    assert status == "ok" and rank == 1 and same and order
    everything = replica_listeners + out["publisher"]
    assert everything and {ip for ip, _, _ in everything} == {node_ip}, everything
