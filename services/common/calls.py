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
"""

from __future__ import annotations

import logging
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


def call_all(launch: Callable[[object], "ray.ObjectRef"], payloads: list, retries: int, what: str,
             stats: dict | None = None, before_retry: Callable[[], object] | None = None,
             on_result: Callable[[int, "ray.ObjectRef"], object] | None = None,
             started: dict[int, "ray.ObjectRef"] | None = None) -> list["ray.ObjectRef"]:
    stats = stats if stats is not None else {}
    stats.setdefault("calls", 0)
    stats.setdefault("retries", 0)

    def start(i: int) -> "ray.ObjectRef":
        stats["calls"] += 1
        return launch(payloads[i])

    started = started or {}
    pending = {(started[i] if i in started else start(i)): (i, 0) for i in range(len(payloads))}
    results: list = [None] * len(payloads)
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        ref = ready[0]
        i, attempt = pending.pop(ref)
        try:
            ray.get(ref)  # surfaces a failure; the bytes stay in the store for the consumer
        except Exception as e:
            if attempt >= retries:
                raise CallError(f"{what} call {i} failed {attempt + 1} times; last error: {e}") from e
            stats["retries"] += 1
            log.warning("%s call %d failed (%s); retrying (%d/%d)", what, i, type(e).__name__, attempt + 1, retries)
            if before_retry is not None:  # e.g. bring a replacement replica to the current policy
                before_retry()
            pending[start(i)] = (i, attempt + 1)
            continue
        results[i] = ref
        if on_result is not None:
            on_result(i, ref)
    return results
