"""Training batches generated ahead of the learner, never more than ``train.max_staleness`` versions.

    ahead = RolloutsAhead(cfg, pipe, prompts, first_step=0)   # a background thread starts generating
    batch = ahead.next()                # the rollout + memory-score refs of the next step, in order
    update = pipe.learner.step(batch.traj_refs, batch.score_refs)
    pipe.learner.publish()              # the new policy to the replicas
    ahead.learner_at(update.metrics["step"])     # the learner's new version: lets the thread run further ahead
    ahead.close()

The thread generates step b's batch (rollout, with each rollout call's result sent to the scorer as it
lands) only once the learner has reached version b - s (s = ``train.max_staleness``), so every token
of the batch is sampled by a policy at most s versions older than the one that trains on it (the
learner checks the bound again and corrects for the lag in its loss). With s = 0 it waits for the
previous update, then syncs the replicas' weights, exactly as a synchronous loop: same batches, same
order, same numbers. With s >= 1 the rollout of step b + 1 runs while the learner trains step b; new
weights reach the rollout replicas mid-generation (their running turns finish on the old version).
With ``train.over_sampling`` > 1 a step's batch is instead the first groups of a pool to complete
(services/pipeline/oversample.py); the rest stay in flight for later steps, within the same bound.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from services.config import MempoConfig
from services.common.data import PromptStream
from services.common.messages import PromptBatch
from services.pipeline.oversample import GroupPool


@dataclass
class Generated:
    """One step's training batch: refs to its TrajectoryBatches and MemoryScoreBatches, and timings."""

    step: int  # the training step it is for (0-based: trained from version ``step``)
    traj_refs: list
    score_refs: list
    rollout_s: float  # first rollout call launched -> last rollout result landed
    scoring_tail_s: float  # last rollout result -> last memory score (scoring overlaps the rollout)
    started_at_version: int  # the learner's version when generation began (>= step - max_staleness)
    waited_s: float = 0.0  # how long the thread waited for the learner before starting this batch
    resynced: bool = False  # replicas held another policy and got the current one again (max_staleness 0)
    pool: dict = field(default_factory=dict)  # over-sampling's metrics of this step (services/pipeline/oversample.py)


def generate(cfg: MempoConfig, pipe, batch: PromptBatch) -> tuple[list, list, float, float]:
    """Roll out one PromptBatch and score its memory blocks; scoring of each rollout call starts when
    that call's result lands. Replicas holding a policy older than ``batch.min_version`` (a
    replacement not yet synced) refuse, and the driver re-syncs them and retries. Returns
    (trajectory refs, score refs, rollout seconds, scoring tail)."""
    t0 = time.perf_counter()
    if not (cfg.algorithm.use_memory_reward and pipe.scorer is not None):
        traj_refs = pipe.rollout.rollout(batch)
        return traj_refs, [], time.perf_counter() - t0, 0.0
    scoring = pipe.scorer.stream(batch.min_version)  # each rollout call's result is scored as it lands
    try:
        traj_refs = pipe.rollout.rollout(batch, on_result=scoring.add)
    except BaseException:
        scoring.cancel()
        raise
    t1 = time.perf_counter()
    score_refs = scoring.results(len(traj_refs))  # the scoring calls, retried where they failed
    return traj_refs, score_refs, t1 - t0, time.perf_counter() - t1


class RolloutsAhead:
    def __init__(self, cfg: MempoConfig, pipe, prompts: PromptStream, first_step: int):
        self.cfg, self.pipe, self.prompts = cfg, pipe, prompts
        self.max_staleness = cfg.train.max_staleness
        self.version = first_step  # the learner's version as the driver last heard it
        self.ready: queue.Queue = queue.Queue()  # Generated batches in step order, or the thread's error
        self._cond = threading.Condition()
        self._stop = False
        # train.over_sampling > 1: groups kept in flight across steps, each step the first to complete. The
        # pool is the overlap then: a step's batch is taken once the learner is at its version, so the lag
        # bound is left to the groups that run on across updates (taken ahead, every leftover would be too old)
        self.pool = GroupPool(cfg, pipe, prompts, generate) if cfg.train.over_sampling > 1 else None
        self.ahead = 0 if self.pool is not None else self.max_staleness
        self._thread = threading.Thread(target=self._run, args=(first_step,), name="mempo-rollouts-ahead",
                                        daemon=True)
        self._thread.start()

    def learner_at(self, version: int) -> None:
        """The learner finished an update: batches up to ``version + max_staleness`` may be generated."""
        with self._cond:
            self.version = version
            self._cond.notify_all()

    def next(self) -> Generated:
        """The next step's batch (blocks until it is generated); re-raises the thread's error."""
        while True:  # short waits, so a Ctrl-C (or interrupt_main) is raised here promptly
            try:
                item = self.ready.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> dict:
        """Stop generating (a batch in flight finishes in the background; nothing waits for it). Returns
        what over-sampling's pool dropped at the stop (``GroupPool.close``; {} without one)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=0.1)
        return self.pool.close() if self.pool is not None else {}

    def _run(self, step: int) -> None:
        try:
            while step < self.cfg.train.steps:
                t0 = time.perf_counter()
                with self._cond:  # the staleness bound: the learner must be at version step - s
                    self._cond.wait_for(lambda: self._stop or self.version >= step - self.ahead)
                    if self._stop:
                        return
                    version = self.version
                waited = time.perf_counter() - t0
                # synchronous: make every replica hold the learner's policy first (resumed, or replaced);
                # ahead, the learner publishes each new version to all live replicas itself
                resynced = self.pipe.sync_weights(version=step) if self.max_staleness == 0 else False
                if self.pool is not None:  # the first groups to complete, some started steps ago
                    traj, scores, pool = self.pool.take(step, version)
                    self.ready.put(Generated(step, traj, scores, pool["oversample/wait_s"], 0.0,
                                             int(pool["oversample/taken_version_min"]), waited, resynced, pool))
                    step += 1
                    continue
                # min_version: the oldest policy the learner will accept for this step
                batch = PromptBatch(self.prompts.at(step), n=self.cfg.rollout.n, policy_version=version, step=step,
                                    seed=self.cfg.train.seed, min_version=max(0, step - self.max_staleness))
                traj, scores, rollout_s, tail_s = generate(self.cfg, self.pipe, batch)
                self.ready.put(Generated(step, traj, scores, rollout_s, tail_s, version, waited, resynced))
                step += 1
        except BaseException as e:  # handed to the training loop, which raises it
            self.ready.put(e)
