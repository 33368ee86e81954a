"""Weight publication: after a step, the new policy reaches every rollout and scorer replica.

The transfer path is an interface (``WeightPublisher``). ``ObjectStorePublisher`` (small models'
path under ``learner.publish: auto``, the default) gathers the full state dict once (rank 0),
encodes it as one ``WeightUpdate`` message, puts it in the object store once, and broadcasts the ref to every
replica of every target deployment; each replica loads it (rollout: in-place vLLM reload; scorer:
atomic swap) and from then on reports the new version. ``CollectivePublisher``
(services/learner/collective.py, ``learner.publish: collective|auto``) implements the same
``publish`` by a gloo broadcast and falls back to this one when its group fails.

    publisher = ObjectStorePublisher([rollout_handle, scorer_handle])
    report = publisher.publish(group.full_state_dict(), version=step)
"""

from __future__ import annotations

import time
from typing import Protocol

import ray
import torch
from ray.exceptions import RayActorError

from services.common.codec import encode
from services.common.messages import WeightUpdate


class WeightPublisher(Protocol):
    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> dict: ...


class ObjectStorePublisher:
    def __init__(self, handles: list, dtype: torch.dtype | None = None):
        self.handles = handles
        self.dtype = dtype  # e.g. bfloat16 to halve the transfer; None keeps the training dtype

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> dict:
        t0 = time.perf_counter()
        tensors = {k: (v.to(self.dtype) if self.dtype is not None and v.is_floating_point() else v)
                   for k, v in state_dict.items()}
        payload = encode(WeightUpdate(version=version, tensors=tensors))
        ref = ray.put(payload)
        t_put = time.perf_counter() - t0
        replies, gone = [], 0
        for h in self.handles:
            live, dead = broadcast(h, "update_weights", ref, version)
            replies += live
            gone += dead
        bad = [r for r in replies if r.get("version") != version]
        if bad:
            raise RuntimeError(f"replicas did not take version {version}: {bad}")
        return {"version": version, "bytes": len(payload), "encode_put_s": t_put,
                "total_s": time.perf_counter() - t0, "replicas": len(replies), "replicas_gone": gone}


def broadcast(handle, method: str, *args) -> tuple[list, int]:
    """Call ``method`` on every replica of a deployment: (replies of the live ones, how many had died).
    A replica that died is being replaced by Serve; its successor is brought up to date by the next
    sync (``Pipeline.sync_weights``). Any other failure raises."""
    replies, dead = [], 0
    for r in handle.broadcast(method, *args).results(return_exceptions=True):
        if isinstance(r, RayActorError):
            dead += 1
        elif isinstance(r, BaseException):
            raise r
        else:
            replies.append(r)
    return replies, dead
