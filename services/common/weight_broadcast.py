"""Weights by a collective: one torch.distributed gloo group between the publisher (rank 0) and
every policy replica (ranks 1..n), and the state dict broadcast in bucketed contiguous byte chunks.

Both sides share the plan: the publisher lays the tensors out (name, dtype, shape, byte offset)
in buckets of about ``BUCKET_BYTES`` (a tensor larger than that gets a bucket of its own), sends
the plan with the control call, and broadcasts each bucket as one uint8 tensor. A replica
receives every bucket into a staging buffer first (``Receiver.receive``) and loads the set only
when it is whole (``Receiver.tensors`` then the service's own load), so a broadcast that fails
half-way leaves the served model as it was. The bytes are the publisher's bytes: what arrives is
bit-identical to what the object-store path delivers.

The group is a standalone ``ProcessGroupGloo`` on its own TCPStore (rank 0's, see
services/learner/rendezvous.py): it never touches the process's default group (the learner's FSDP
group, vLLM's own), and every operation is bounded by the group's timeout; a peer that dies makes
the others fail at once ("Connection closed by peer") or at the timeout.

    r = Receiver(); r.join(host, port, world, group_id, timeout_s)   # a replica (rank from the store)
    r.receive(group_id, version, plan, timeout_s); state = r.tensors()  # after the publisher's send()

NCCL (GPU) would use the same plan on CUDA buffers; only gloo on CPU is built and tested here.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 << 20  # 64 MiB: measured ~1.3 GB/s to two local peers on 2 cores at this size
ALIGN = 64  # every tensor starts at a multiple of this many bytes (a view of any dtype is legal)
RANK_KEY = "mempo/weight_rank"


def layout(state: dict[str, torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[list]]:
    """Buckets of ``[name, dtype name, shape, offset, nbytes]``, in the state dict's order."""
    buckets: list[list[list]] = [[]]
    used = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append([name, str(t.dtype).removeprefix("torch."), list(t.shape), used, nbytes])
        used += -(-nbytes // ALIGN) * ALIGN
    return [b for b in buckets if b]


def bucket_size(bucket: list[list]) -> int:
    return max(off + n for _, _, _, off, n in bucket)


def plan_bytes(plan: list[list[list]]) -> int:
    return sum(n for b in plan for *_, n in b)


def _options() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


def local_address(store_host: str) -> str:
    """Where this rank's gloo listener binds: loopback when rank 0's store is on loopback (one
    machine), else this node's Ray address (cluster mode), never every interface."""
    if store_host.startswith("127.") or store_host in ("::1", "localhost"):
        return "127.0.0.1"
    import ray  # Ray on use: cluster mode only

    return ray.util.get_node_ip_address()


def group(store, rank: int, world: int, group_id: str, timeout_s: float, bind: str):
    """The gloo group ``group_id`` on ``store``, its listener on ``bind`` (every rank calls it;
    formation waits for all of them, at most ``timeout_s``)."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    opts._threads = 2
    return dist.ProcessGroupGloo(dist.PrefixStore(group_id, store), rank, world, opts)


def send(pg, state: dict[str, torch.Tensor], plan: list[list[list]], timeout_s: float) -> float:
    """Rank 0: broadcast ``state`` bucket by bucket (packing the next while the last is on the wire);
    returns seconds. Raises if a peer fails or the timeout passes."""
    t0 = time.perf_counter()
    timeout = datetime.timedelta(seconds=timeout_s)
    pending: list = []
    spare = [torch.empty(max(map(bucket_size, plan)), dtype=torch.uint8) for _ in range(min(2, len(plan)))]
    for i, bucket in enumerate(plan):
        buf = spare[i % len(spare)][:bucket_size(bucket)]  # two buffers, in turn: no fresh pages per bucket
        for name, _, _, off, n in bucket:
            if n:
                buf[off:off + n].copy_(state[name].detach().contiguous().reshape(-1).view(torch.uint8))
        pending.append(pg.broadcast([buf], _options()))
        if len(pending) > 1:  # at most two buckets in memory: one on the wire, one being packed
            pending.pop(0).wait(timeout)
    for work in pending:
        work.wait(timeout)
    return time.perf_counter() - t0


def close(pg) -> None:
    """Tear a group down now: its peers' pending operations fail at once instead of at the timeout."""
    if pg is None:
        return
    try:
        pg.abort()
    except Exception:  # already broken
        pass


class Receiver:
    """A replica's end of the group: membership, and the staged buckets of the latest broadcast."""

    def __init__(self):
        self.pg = None
        self.group_id: str | None = None
        self.rank = -1
        self.staged: tuple | None = None  # (version, plan, buffers) of a whole received set
        self.buffers: list[torch.Tensor] = []  # staging, kept between publications (no fresh pages each time)

    def join(self, host: str, port: int, world: int, group_id: str, timeout_s: float) -> int:
        """Join ``group_id`` at rank 0's store; the rank comes from the store (-1: the group is full,
        this replica came up after it was sized, and takes the next one)."""
        self.leave()
        store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=timeout_s))
        rank = int(store.add(f"{group_id}/{RANK_KEY}", 1))
        if rank >= world:
            return -1
        self.pg = group(store, rank, world, group_id, timeout_s, local_address(host))
        self.group_id, self.rank = group_id, rank
        return rank

    def leave(self) -> None:
        close(self.pg)
        self.pg, self.group_id, self.rank, self.staged, self.buffers = None, None, -1, None, []

    def receive(self, group_id: str, version: int, plan: list[list[list]], timeout_s: float) -> dict:
        """Receive every bucket of one broadcast into staging; on any failure leave the group (the
        publisher rebuilds it next time) and raise."""
        if self.pg is None or group_id != self.group_id:
            raise RuntimeError(f"not a member of weight group {group_id} (holding {self.group_id})")
        t0 = time.perf_counter()
        self.staged = None
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            sizes = [bucket_size(b) for b in plan]
            if [len(b) for b in self.buffers] != sizes:
                self.buffers = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            buffers = self.buffers
            for work in [self.pg.broadcast([buf], _options()) for buf in buffers]:
                work.wait(timeout)
        except Exception:
            self.leave()
            raise
        self.staged = (version, plan, buffers)
        return {"version": version, "bytes": plan_bytes(plan), "seconds": time.perf_counter() - t0, "rank": self.rank}

    def tensors(self, version: int) -> dict[str, torch.Tensor]:
        """The staged set of ``version`` as tensors (views of the staging buffers, no copy)."""
        if self.staged is None or self.staged[0] != version:
            have = None if self.staged is None else self.staged[0]
            raise RuntimeError(f"no whole set of version {version} staged (staged: {have})")
        _, plan, buffers = self.staged
        out = {}
        for bucket, buf in zip(plan, buffers):
            for name, dtype, shape, off, n in bucket:
                out[name] = buf[off:off + n].view(getattr(torch, dtype)).reshape(shape)
        return out

    def drop(self) -> None:
        """Forget the staged set (after it was loaded, or when the publication was abandoned)."""
        self.staged = None
