"""Driver side of rollout: spread prompt groups over the replicas, retry what a dead replica lost.

    driver = RolloutDriver(serve.get_deployment_handle("rollout", "rollout"), cfg)
    refs = driver.rollout(prompt_batch)      # list of ObjectRefs to TrajectoryBatch bytes
    with driver.paused(True, max_s=600): ... # no replica starts a new turn inside (train.pause_rollout)

The batch is cut into calls of ``rollout.groups_per_call`` prompt groups; Serve routes each call
to a replica, so adding replicas needs no code change. A call whose replica dies (or fails in any
other way) is sent again, up to ``rollout.call_retries`` times; each call's result is kept once,
so nothing is lost or duplicated. Results are ObjectRefs owned by the driver (they outlive the
replica that made them); the driver never decodes them.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace

import ray

from services.common.calls import call_all, serve_ref
from services.common.codec import encode
from services.config import MempoConfig
from services.common.messages import PromptBatch

log = logging.getLogger("mempo.rollout")


class RolloutDriver:
    def __init__(self, handle, cfg: MempoConfig, watch=None, before_retry=None):
        """``watch``: a ReplicaWatch, so a call waits for a starting replacement replica; ``before_retry``:
        run before a retried call (the Pipeline's re-sync of replaced replicas to the current policy)."""
        self.handle = handle
        self.cfg = cfg
        self.stats = {"calls": 0, "retries": 0, "failed_s": 0.0}
        self.watch, self.before_retry = watch, before_retry

    def split(self, batch: PromptBatch) -> list[PromptBatch]:
        k = self.cfg.rollout.groups_per_call
        return [replace(batch, prompts=batch.prompts[i:i + k]) for i in range(0, len(batch.prompts), k)]

    def rollout(self, batch: PromptBatch, on_result=None) -> list["ray.ObjectRef"]:
        """One TrajectoryBatch ref per call, in prompt order. ``on_result(i, ref)`` runs as each call's
        result lands (the training loop starts scoring it there)."""
        payloads = [encode(chunk) for chunk in self.split(batch)]
        timeout_s = self.cfg.ray.call_timeout_s
        return call_all(lambda p: serve_ref(lambda: self.handle.rollout.remote(p), timeout_s, self.watch, "a rollout call"),
                        payloads,
                        self.cfg.rollout.call_retries, "rollout", self.stats,
                        self.before_retry, on_result, timeout_s=timeout_s)

    @contextmanager
    def paused(self, on: bool, max_s: float):
        """With ``on``: every live replica starts no new turn inside the block (turns running finish), and
        again after it; a replica resumes by itself after ``max_s`` should the driver die inside. Replicas
        that died are skipped (their replacements start unpaused)."""
        if on:
            self._each("pause_turns", max_s)
        try:
            yield
        finally:
            if on:
                self._each("resume_turns")

    def _each(self, method: str, *args) -> None:
        for r in self.handle.broadcast(method, *args).results(return_exceptions=True):
            if isinstance(r, BaseException):
                log.warning("rollout %s on a replica failed: %s", method, r)
