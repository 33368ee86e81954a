"""Calls to a Serve deployment that survive a dying replica: launch all, keep each result once,
relaunch what failed.

    refs = call_all(lambda p: handle.rollout.remote(p)._to_object_ref_sync(), payloads,
                    retries=2, what="rollout", stats=stats)

``launch(payload)`` must return an ObjectRef owned by the caller (a Serve response turned into a
ref with ``_to_object_ref_sync()``), so the result outlives the replica that produced it. Payloads
may be bytes or ObjectRefs (a top-level ref reaches the replica resolved). Results come back in
payload order; nothing is decoded here. ``before_retry()``, if given, runs before each relaunch.
``on_result(i, ref)``, if given, runs once per call as its result lands. Payloads may also arrive
while the calls run (``Arrivals``: handed over one by one from another thread, then closed with their
count); each is launched as it arrives. The pipeline scores each rollout call's result that way, as
it lands, on the one path every call takes:

    arrivals = Arrivals()              # another thread: arrivals.add(i, payload) ... arrivals.close(n)
    refs = call_all(launch, arrivals, retries=2, what="score")

``timeout_s`` (> 0) bounds each attempt once a replica has taken it: a call that has not finished by then
counts as failed, so the step ends in a CallError naming it instead of waiting forever. How long a launch
waits for a replica to take the call is ``launch``'s business (``serve_ref`` with a ReplicaWatch: a
replacement that is starting is waited for, one that cannot be placed fails at once). ``stats["failed_s"]`` sums the seconds failed attempts took to fail.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable

import ray

log = logging.getLogger("mempo.calls")


class CallError(RuntimeError):
    """A call kept failing after its retries."""


class StaleReplica(RuntimeError):
    """Raised by a replica asked for at least policy version v while it holds an older one (Serve's
    replacement of a dead replica starts from ``model.path``). The driver's retry re-syncs it first."""


def require_version(held: int, min_version: int, replica: str) -> None:
    """The replica-side check of a training call's ``min_version`` (-1 = any)."""
    if min_version >= 0 and held < min_version:
        raise StaleReplica(f"replica {replica} holds policy version {held}, the call needs >= {min_version}")


def serve_ref(call: Callable[[], object], timeout_s: float, watch=None, what: str = "the call") -> "ray.ObjectRef":
    """The ObjectRef of the Serve handle call ``call()`` makes, owned by this process (so the result
    outlives the replica). With a ``watch`` (services/common/replicas.py) it waits while a replica is
    worth waiting for: busy ones up to ``timeout_s``, a replacement Serve is starting up to the watch's
    start-up limit, nothing when no replica runs, starts or fits a live node (NoReplica). Without one,
    at most ``timeout_s`` (0 = no limit)."""
    if watch is not None:
        return watch.assign(call, what)
    return call()._to_object_ref_sync(_timeout_s=timeout_s or None)


POLL_S = 0.05  # how often a wait on running calls looks for new arrivals, while they may still come


class Arrivals:
    """Payloads handed to a running ``call_all`` one by one (thread-safe): ``add(i, payload)`` for each
    index, then ``close(n)`` with how many there are in all, or ``abort()`` to stop waiting for them."""

    _CLOSE, _ABORT = object(), object()

    def __init__(self, payloads: list | None = None):
        self._q: queue.Queue = queue.Queue()
        if payloads is not None:  # all there from the start
            for i, payload in enumerate(payloads):
                self.add(i, payload)
            self.close(len(payloads))

    def add(self, i: int, payload) -> None:
        self._q.put((i, payload))

    def close(self, n: int) -> None:
        self._q.put((self._CLOSE, n))

    def abort(self) -> None:
        self._q.put((self._ABORT, None))

    def next(self, block: bool) -> tuple | None:
        """The next (index, payload), (Arrivals._CLOSE, n) or (Arrivals._ABORT, None); None if nothing
        has arrived (``block``: wait for it)."""
        try:
            return self._q.get(block=block)
        except queue.Empty:
            return None


def call_all(launch: Callable[[object], "ray.ObjectRef"], payloads: "list | Arrivals", retries: int, what: str,
             stats: dict | None = None, before_retry: Callable[[], object] | None = None,
             on_result: Callable[[int, "ray.ObjectRef"], object] | None = None,
             timeout_s: float = 0.0) -> list["ray.ObjectRef"]:
    stats = stats if stats is not None else {}
    stats.setdefault("calls", 0)
    stats.setdefault("retries", 0)
    stats.setdefault("failed_s", 0.0)
    limit = timeout_s if timeout_s > 0 else float("inf")
    arrivals = payloads if isinstance(payloads, Arrivals) else Arrivals(payloads)
    given: dict[int, object] = {}  # the payloads arrived so far, by index

    def start(i: int) -> "ray.ObjectRef":
        stats["calls"] += 1
        try:
            return launch(given[i])
        except Exception as e:  # no replica can take it (NoReplica), or none did within its limit
            raise CallError(f"{what} call {i} could not be sent to a replica: {type(e).__name__}: {e} "
                            f"(were its replicas' nodes lost with no room left for a replacement? `mempo plan "
                            f"CONFIG ray.address=...` checks the live cluster)") from e

    n: int | None = None  # how many calls in all, once the arrivals are closed
    pending: dict = {}  # ref -> (index, attempt, launched at)
    results: dict[int, "ray.ObjectRef"] = {}
    while n is None or pending:
        while n is None:  # launch what has arrived; with nothing running, wait for the next arrival
            item = arrivals.next(block=not pending)
            if item is None:
                break
            i, payload = item
            if i is Arrivals._ABORT:
                raise CallError(f"{what} calls stopped before every payload arrived ({len(given)} had)")
            if i is Arrivals._CLOSE:
                n = payload
                break
            assert i not in given, f"{what} payload {i} arrived twice"
            given[i] = payload
            pending[start(i)] = (i, 0, time.monotonic())
        if not pending:
            continue
        deadline = min(t0 for _, _, t0 in pending.values()) + limit
        wait_s = None if limit == float("inf") else max(0.0, deadline - time.monotonic())
        if n is None:  # more may arrive meanwhile
            wait_s = POLL_S if wait_s is None else min(wait_s, POLL_S)
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        if ready:
            ref = ready[0]
        else:
            ref = min(pending, key=lambda r: pending[r][2])
            if time.monotonic() < pending[ref][2] + limit:  # only a look for arrivals: nothing timed out
                continue
        i, attempt, t0 = pending.pop(ref)
        try:
            if not ready:  # the oldest attempt ran out of time
                raise TimeoutError(f"no result within {timeout_s:g}s (ray.call_timeout_s)")
            # surfaces a failure, and copies the bytes to this node: they outlive the node that made them
            ray.get(ref, timeout=None if limit == float("inf") else max(1.0, t0 + limit - time.monotonic()))
        except Exception as e:
            stats["failed_s"] += time.monotonic() - t0
            if attempt >= retries:
                raise CallError(f"{what} call {i} failed {attempt + 1} times; last error: {e}") from e
            stats["retries"] += 1
            log.warning("%s call %d failed after %.1fs (%s); retrying (%d/%d)", what, i, time.monotonic() - t0,
                        type(e).__name__, attempt + 1, retries)
            if not ready:
                try:
                    ray.cancel(ref)
                except Exception:  # nothing left to cancel on a lost node
                    pass
            if before_retry is not None:  # e.g. bring a replacement replica to the current policy
                try:
                    before_retry()
                except Exception as e2:
                    raise CallError(f"{what} call {i} failed ({type(e).__name__}) and no replica came up to retry "
                                    f"it on: {type(e2).__name__}: {e2}") from e2
            pending[start(i)] = (i, attempt + 1, time.monotonic())
            continue
        results[i] = ref
        if on_result is not None:
            on_result(i, ref)
    missing = sorted(set(range(n)) - set(results))
    if missing:
        raise CallError(f"{what}: {n} calls announced, none arrived for {missing[:5]}")
    return [results[i] for i in range(n)]
