"""Calls to a Serve deployment that survive a dying replica: launch all, keep each result once,
relaunch what failed.

    refs = call_all(lambda p: handle.rollout.remote(p)._to_object_ref_sync(), payloads,
                    retries=2, what="rollout", stats=stats)

``launch(payload)`` must return an ObjectRef owned by the caller (a Serve response turned into a
ref with ``_to_object_ref_sync()``), so the result outlives the replica that produced it. Payloads
may be bytes or ObjectRefs (a top-level ref reaches the replica resolved). Results come back in
payload order; nothing is decoded here. ``before_retry()``, if given, runs before each relaunch.
``on_result(i, ref)``, if given, runs once per call as its result lands (the pipeline starts scoring a
rollout call's result there, before the other calls finish). ``started`` maps payload indices to refs
already launched elsewhere; those are awaited (and relaunched on failure) instead of launched again.
``timeout_s`` (> 0) bounds each attempt once a replica has taken it: a call that has not finished by then
counts as failed, so the step ends in a CallError naming it instead of waiting forever. How long a launch
waits for a replica to take the call is ``launch``'s business (``serve_ref`` with a ReplicaWatch: a
replacement that is starting is waited for, one that cannot be placed fails at once). ``stats["failed_s"]`` sums the seconds failed attempts took to fail.
"""

from __future__ import annotations

import logging
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


def call_all(launch: Callable[[object], "ray.ObjectRef"], payloads: list, retries: int, what: str,
             stats: dict | None = None, before_retry: Callable[[], object] | None = None,
             on_result: Callable[[int, "ray.ObjectRef"], object] | None = None,
             started: dict[int, "ray.ObjectRef"] | None = None, timeout_s: float = 0.0) -> list["ray.ObjectRef"]:
    stats = stats if stats is not None else {}
    stats.setdefault("calls", 0)
    stats.setdefault("retries", 0)
    stats.setdefault("failed_s", 0.0)
    limit = timeout_s if timeout_s > 0 else float("inf")

    def start(i: int) -> "ray.ObjectRef":
        stats["calls"] += 1
        try:
            return launch(payloads[i])
        except Exception as e:  # no replica can take it (NoReplica), or none did within its limit
            raise CallError(f"{what} call {i} could not be sent to a replica: {type(e).__name__}: {e} "
                            f"(were its replicas' nodes lost with no room left for a replacement? `mempo plan "
                            f"CONFIG ray.address=...` checks the live cluster)") from e

    started = started or {}
    now = time.monotonic()
    pending = {(started[i] if i in started else start(i)): (i, 0, now) for i in range(len(payloads))}
    results: list = [None] * len(payloads)
    while pending:
        first_deadline = min(t0 for _, _, t0 in pending.values()) + limit
        wait_s = None if limit == float("inf") else max(0.0, first_deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
        if ready:
            ref = ready[0]
        else:  # the oldest attempt ran out of time
            ref = min(pending, key=lambda r: pending[r][2])
        i, attempt, t0 = pending.pop(ref)
        try:
            if not ready:
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
    return results
