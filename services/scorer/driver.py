"""Driver side of scoring: one scorer call per rollout result, retried if its replica dies.

    scorer = ScorerDriver(serve.get_deployment_handle("scorer", "scorer"), cfg)
    score_refs = scorer.score(traj_refs)     # one MemoryScoreBatch ref per TrajectoryBatch ref
    early = {i: scorer.start(ref)}           # scoring one result as soon as it lands ...
    score_refs = scorer.score(traj_refs, started=early)   # ... then the rest, retrying what failed

Each TrajectoryBatch ref is passed as the call's top-level argument, so the replica reads the
bytes straight from the object store; the driver never decodes them. Results are refs the driver
owns, in the order of ``traj_refs``; Serve spreads the calls over the scorer replicas. A failed
call is sent again up to ``scorer.call_retries`` times.
"""

from __future__ import annotations

import logging

import ray

from services.common.calls import call_all, serve_ref
from services.config import MempoConfig

log = logging.getLogger("mempo.scorer")

class ScorerDriver:
    def __init__(self, handle, cfg: MempoConfig, watch=None, before_retry=None, retries: int | None = None):
        """``watch``: a ReplicaWatch, so a call waits for a starting replacement replica; ``before_retry``:
        run before a retried call (the Pipeline's re-sync of replaced replicas to the current policy)."""
        self.handle = handle
        self.retries = cfg.scorer.call_retries if retries is None else retries
        self.timeout_s = cfg.ray.call_timeout_s
        self.stats = {"calls": 0, "retries": 0, "failed_s": 0.0}
        self.watch, self.before_retry = watch, before_retry

    def start(self, traj_ref: "ray.ObjectRef", min_version: int = -1) -> "ray.ObjectRef | None":
        """Launch the scoring of one TrajectoryBatch ref now; its MemoryScoreBatch ref. A replica
        holding a policy older than ``min_version`` refuses (and the call is retried after a re-sync).
        None when no replica took the call (e.g. none within ``ray.call_timeout_s``): an early start is
        only a head start, so ``score()`` sends the call again with its retries and its clear error."""
        self.stats["calls"] += 1
        try:
            return self._launch(traj_ref, min_version)
        except Exception as e:
            log.warning("early scoring call not taken (%s: %s); it is sent again with the step's others",
                        type(e).__name__, e)
            return None

    def _launch(self, traj_ref: "ray.ObjectRef", min_version: int) -> "ray.ObjectRef":
        return serve_ref(lambda: self.handle.score.remote(traj_ref, min_version), self.timeout_s, self.watch,
                         "a scoring call")

    def score(self, traj_refs: list["ray.ObjectRef"], started: dict[int, "ray.ObjectRef"] | None = None,
              min_version: int = -1) -> list["ray.ObjectRef"]:
        """One MemoryScoreBatch ref per TrajectoryBatch ref, in order; ``started[i]`` is awaited
        instead of launching call i again (a failed one is relaunched)."""
        return call_all(lambda ref: self._launch(ref, min_version), list(traj_refs), self.retries, "score",
                        self.stats, self.before_retry, started=started, timeout_s=self.timeout_s)
