"""Collective weight publication (``learner.publish: collective | auto``): the publishing process
(rank 0) and every replica of the target deployments form one gloo group, the weights go out in
bucketed contiguous chunks (services/common/weight_broadcast.py), and the version is committed
only once every replica holds the whole set.

One publication, each wait bounded:
  1. membership: every live replica says which group it holds (``weight_group``); the group is
     rebuilt when that is not this publisher's current group for all of them (a replica replaced or
     added, a failed last publication): a fresh rendezvous socket (loopback on one machine, the
     node's address in cluster mode), ``join_weight_group`` on every replica, rank 0 joins here;
  2. transfer: ``receive_weights`` on every replica while rank 0 broadcasts; replicas stage;
  3. commit: ``commit_weights`` on every replica loads the staged set and takes the version.
A failure in 1-2 (a replica dead mid-broadcast, a timeout, a replica that cannot be reached)
abandons the group and this publication goes by the object store instead (``ObjectStorePublisher``,
logged); the next one builds a new group with the replicas then alive.

``auto`` (the default) chooses by the size of the weights: a state dict under ``min_bytes``
(``learner.collective_min_mb``) goes by the object store, whose one call per replica costs less
than the group's three on a few MB (bench/publish.py: the tiny model's 2 MB, 0.086 s by the object
store against 0.108 s by the group on 2 cores; SmolLM2-135M's 269-538 MB, 0.29-0.57x by the group);
a larger one by the collective, and by the object store from then on once ``AUTO_GIVE_UP``
formations in a row fail (a cluster where no group forms), which it says.

    pub = CollectivePublisher([rollout_handle, scorer_handle], mode="collective")
    report = pub.publish(state_dict, version)   # report["path"]: "collective" or "object_store"

Test: tests/learner/test_collective.py.
"""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from services.common import weight_broadcast as wb
from services.learner.publish import ObjectStorePublisher, broadcast
from services.learner.rendezvous import LOOPBACK, NODE, group_store, listen

log = logging.getLogger("mempo.learner")

FORM_TIMEOUT_S = 60.0  # every replica joins within this (a vLLM engine answers between its steps)
MIN_RATE = 20e6  # bytes/s: the transfer's timeout is FORM_TIMEOUT_S + bytes / MIN_RATE
AUTO_GIVE_UP = 3


def store_host(ray_address: str) -> str:
    """Where the group's listeners bind (rank 0's store and every rank's gloo pairs): loopback on one
    machine (no ``ray.address``), this node's cluster address in cluster mode; never every interface."""
    return NODE if ray_address else LOOPBACK


class CollectivePublisher:
    def __init__(self, handles: list, mode: str = "collective", store_host: str = LOOPBACK,
                 bucket_bytes: int = wb.BUCKET_BYTES, form_timeout_s: float = FORM_TIMEOUT_S, hook=None,
                 min_bytes: int = 0):
        self.handles = handles
        self.mode = mode
        self.min_bytes = min_bytes  # auto: a smaller state dict goes by the object store
        self.store_host = store_host
        self.bucket_bytes = bucket_bytes
        self.form_timeout_s = form_timeout_s
        self.fallback = ObjectStorePublisher(handles)
        self.pg, self.group_id, self.world = None, None, 0
        self.formation_failures = 0
        self._small_said = False
        self.hook = hook  # tests: hook(stage) at "formed", "sending"
        self.stats = {"collective": 0, "object_store": 0, "groups_built": 0}

    def publish(self, state: dict[str, torch.Tensor], version: int) -> dict:
        t0 = time.perf_counter()
        if self.path(state) == "object_store":
            return self._by_object_store(state, version, t0, None)
        try:
            report = self._collective(state, version, t0)
            self.stats["collective"] += 1
            return report
        except Exception as e:  # noqa: BLE001 - every failure of the collective has the same answer
            self.close()
            return self._by_object_store(state, version, t0, e)

    def path(self, state: dict[str, torch.Tensor]) -> str:
        """The path this publication tries: ``collective`` mode always the group; ``auto`` the object
        store for a state dict under ``min_bytes`` or after ``AUTO_GIVE_UP`` failed formations."""
        if self.mode != "auto":
            return "collective"
        if self.formation_failures >= AUTO_GIVE_UP:
            return "object_store"
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        if nbytes < self.min_bytes:
            if not self._small_said:
                log.info("learner.publish=auto: %.1f MB of weights, under learner.collective_min_mb (%.1f MB): "
                         "published by the object store", nbytes / 1e6, self.min_bytes / 1e6)
                self._small_said = True
            return "object_store"
        return "collective"

    def _by_object_store(self, state, version, t0, error) -> dict:
        if error is not None:
            log.warning("collective publication of version %d failed (%s: %s); it goes by the object store, "
                        "the weight group is rebuilt at the next publication", version, type(error).__name__,
                        str(error)[:300])
            if self.mode == "auto" and self.formation_failures >= AUTO_GIVE_UP:
                log.warning("learner.publish=auto: no weight group formed %d times in a row; publishing by the "
                            "object store from now on", self.formation_failures)
        report = self.fallback.publish(state, version)
        self.stats["object_store"] += 1
        report.update(path="object_store", fallback=error is not None, total_s=time.perf_counter() - t0)
        return report

    # -- the three phases ---------------------------------------------------------------------------

    def _collective(self, state: dict[str, torch.Tensor], version: int, t0: float) -> dict:
        plan = wb.layout(state, self.bucket_bytes)
        nbytes = wb.plan_bytes(plan)
        timeout = self.form_timeout_s + nbytes / MIN_RATE
        rebuilt = self._ensure_group()
        t_send = time.perf_counter()
        pending = _start([h.broadcast("receive_weights", self.group_id, version, plan, timeout)
                          for h in self.handles], timeout)
        if self.hook:
            self.hook("sending")
        wb.send(self.pg, state, plan, timeout)
        received = _collect(pending, timeout, "receive_weights")
        send_s = time.perf_counter() - t_send
        t_commit = time.perf_counter()
        committed, gone = [], 0
        for h in self.handles:
            live, dead = broadcast(h, "commit_weights", self.group_id, version)
            committed += live
            gone += dead
        bad = [r for r in committed if r.get("version") != version]
        if bad:
            raise RuntimeError(f"replicas did not commit version {version}: {bad}")
        return {"version": version, "bytes": nbytes, "path": "collective", "fallback": False,
                "group_rebuilt": rebuilt, "send_s": send_s, "commit_s": time.perf_counter() - t_commit,
                "receive_s_max": max((r["seconds"] for r in received), default=0.0),
                "total_s": time.perf_counter() - t0, "replicas": len(committed), "replicas_gone": gone}

    def _ensure_group(self) -> bool:
        """Keep the current group when every live replica is in it; else build a new one. True if built."""
        held = [r for h in self.handles for r in _live(h, "weight_group")]
        if self.pg is not None and len(held) == self.world - 1 and all(g == self.group_id for g in held):
            return False
        self.close()
        if not held:
            raise RuntimeError("no live replica to publish to")
        world, group_id = len(held) + 1, f"mempo-weights-{uuid.uuid4().hex[:12]}"
        sock = listen(self.store_host)
        host, port = sock.getsockname()[:2]
        store = group_store(0, world, host, port, sock)
        pending = _start([h.broadcast("join_weight_group", host, port, world, group_id, self.form_timeout_s)
                          for h in self.handles], self.form_timeout_s)
        try:
            pg = wb.group(store, 0, world, group_id, self.form_timeout_s, wb.local_address(host))
            ranks = [r for r in _collect(pending, self.form_timeout_s, "join_weight_group")]
        except Exception:
            self.formation_failures += 1
            raise
        if sorted(ranks) != list(range(1, world)):
            wb.close(pg)
            self.formation_failures += 1
            raise RuntimeError(f"weight group {group_id}: replicas took ranks {sorted(ranks)} of {world}")
        self.pg, self.group_id, self.world, self._store = pg, group_id, world, store
        self.formation_failures = 0
        self.stats["groups_built"] += 1
        log.info("weight group %s formed: rank 0 and %d replica(s) at %s:%d", group_id, world - 1, host, port)
        if self.hook:
            self.hook("formed")
        return True

    def close(self) -> None:
        wb.close(self.pg)
        self.pg, self.group_id, self.world, self._store = None, None, 0, None


def _live(handle, method: str, *args) -> list:
    return broadcast(handle, method, *args)[0]


def _start(responses: list, timeout_s: float) -> list:
    """Send broadcast calls now (a Serve broadcast is sent when its results are asked for) and wait
    for their replies on threads, at most ``timeout_s``, while this thread takes part in the group."""
    pool = ThreadPoolExecutor(max_workers=len(responses) or 1)
    futures = [pool.submit(r.results, timeout_s=timeout_s, return_exceptions=True) for r in responses]
    pool.shutdown(wait=False)  # a reply that never comes must not hold the publisher
    return futures


def _collect(futures: list, timeout_s: float, what: str) -> list:
    """Every reply of the calls ``_start`` sent; any failure (a replica dead: RayActorError; a gloo
    error on its side; no reply within ``timeout_s``) raises."""
    deadline = time.monotonic() + timeout_s
    out = []
    for future in futures:
        try:
            replies = future.result(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
        except Exception as e:  # TimeoutError of the thread or of Serve's own wait
            raise RuntimeError(f"{what}: no reply from every replica within {timeout_s:.0f}s ({type(e).__name__})") from e
        for r in replies:
            if isinstance(r, BaseException):
                raise RuntimeError(f"{what} failed on a replica: {type(r).__name__}: {str(r)[:300]}") from r
            out.append(r)
    return out
