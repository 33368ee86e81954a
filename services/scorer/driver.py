"""Driver side of scoring: one scorer call per rollout result, retried if its replica dies.

    scorer = ScorerDriver(serve.get_deployment_handle("scorer", "scorer"), cfg)
    score_refs = scorer.score(traj_refs)          # one MemoryScoreBatch ref per TrajectoryBatch ref

    scoring = scorer.stream(min_version)          # or: each result scored as it lands ...
    traj_refs = rollout.rollout(batch, on_result=scoring.add)
    score_refs = scoring.results(len(traj_refs))  # ... awaited once the rollout is done

Each TrajectoryBatch ref is passed as the call's top-level argument, so the replica reads the
bytes straight from the object store; the driver never decodes them. Results are refs the driver
owns, in the order of ``traj_refs``; Serve spreads the calls over the scorer replicas. A failed
call is sent again up to ``scorer.call_retries`` times. Both ways are the same path
(``call_all``, services/common/calls.py); a stream runs it on a thread of its own, so a scoring call
waiting for a replica never holds up the rollout that hands it over.
"""

from __future__ import annotations

import logging
import threading

import ray

from services.common.calls import Arrivals, call_all, serve_ref
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

    def score(self, traj_refs: "list[ray.ObjectRef] | Arrivals", min_version: int = -1) -> list["ray.ObjectRef"]:
        """One MemoryScoreBatch ref per TrajectoryBatch ref, in order. A replica holding a policy older
        than ``min_version`` refuses, and the call is retried after a re-sync."""
        launch = lambda ref: serve_ref(lambda: self.handle.score.remote(ref, min_version), self.timeout_s,  # noqa: E731
                                       self.watch, "a scoring call")
        return call_all(launch, traj_refs, self.retries, "score", self.stats, self.before_retry,
                        timeout_s=self.timeout_s)

    def stream(self, min_version: int = -1) -> "ScoreStream":
        """Scoring calls launched as their TrajectoryBatch refs are handed over (``ScoreStream.add``)."""
        return ScoreStream(self, min_version)


class ScoreStream:
    """One batch's scoring calls, each launched as its rollout result is handed over and retried as any
    call is: ``ScorerDriver.score`` on a thread of its own, fed by ``add``."""

    def __init__(self, driver: ScorerDriver, min_version: int):
        self._arrivals = Arrivals()
        self._refs: list | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(driver, min_version), name="mempo-scoring",
                                        daemon=True)
        self._thread.start()

    def _run(self, driver: ScorerDriver, min_version: int) -> None:
        try:
            self._refs = driver.score(self._arrivals, min_version)
        except BaseException as e:  # raised to the caller of results()
            self._error = e

    def add(self, i: int, traj_ref: "ray.ObjectRef") -> None:
        """Score rollout result ``i`` (returns at once: the call is launched on the stream's thread)."""
        self._arrivals.add(i, traj_ref)

    def results(self, n: int) -> list["ray.ObjectRef"]:
        """The MemoryScoreBatch refs of results 0..n-1, once every call has one; the calls' error if not."""
        self._arrivals.close(n)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._refs

    def cancel(self) -> None:
        """Stop waiting for results (the rollout failed); calls in flight are left to finish unread."""
        self._arrivals.abort()
