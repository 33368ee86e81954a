"""Over-sampling with a buffer (``train.over_sampling``): no step waits for its slowest group.

    pool = GroupPool(cfg, pipe, prompts, generate)
    batch = pool.take(step, version)   # the first prompts_per_step groups to complete, rollout and scoring done
    pool.close()

The pool keeps T = ``train.groups_in_flight`` prompt groups in flight, each its own rollout call (one
group, ``rollout.n`` episodes) whose result goes to the scorer as it lands. ``take`` tops the pool up to
T, waits until ``prompts_per_step`` groups have completed and hands those on in completion order; the
rest keep running, turn by turn under whatever policy the replicas hold when each turn is sampled
(the learner publishes to them mid-episode: a partial rollout), and wait in the buffer for a later
step. Every turn records the version that sampled it and the engine's log-probs; the learner's loss
corrects or masks the older ones (``learner.behaviour_is``).

The lag bound: a group launched while the learner was at version v asks its replicas for at least v
(``min_version``), so none of its tokens is older than v. Step s trains from version s, so a group is
kept for step s only when s - v <= ``train.max_staleness``; older ones (done, or still running) are
dropped and counted. The training loop takes step s's batch once the learner is at version s (the pool,
not a thread running ahead, is the overlap), so a group left over from one step is one version old at
the next. Prompts: step s draws the i-th group it launches from position s*T + i of the
seeded prompt order. A step launches at most T groups, so no position is drawn twice, also across a
stop and resume (which drops the buffer: its groups were sampled by a policy the resumed run no
longer holds).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from services.common.data import PromptStream
from services.common.messages import PromptBatch
from services.config import MempoConfig

log = logging.getLogger("mempo.oversample")


@dataclass
class Launched:
    """One group in the pool: where its prompt came from, when and under which learner version it started."""

    position: int  # in the seeded prompt order
    version: int  # the learner's version at launch: the oldest policy any of its tokens may come from
    started: float
    traj_refs: list = field(default_factory=list)
    score_refs: list = field(default_factory=list)


class GroupPool:
    def __init__(self, cfg: MempoConfig, pipe, prompts: PromptStream, generate):
        """``generate(cfg, pipe, batch) -> (traj refs, score refs, rollout s, scoring tail s)``: the one path
        that rolls out a PromptBatch and scores it (services/pipeline/ahead.py)."""
        self._generate = generate
        self.cfg, self.pipe, self.prompts = cfg, pipe, prompts
        self.target = cfg.train.groups_in_flight
        self.per_step = cfg.train.prompts_per_step
        self.max_lag = cfg.train.max_staleness
        self.running: dict[Future, Launched] = {}
        self.done: list[Launched] = []  # completed, in completion order, not yet trained
        self.dropped = 0  # groups dropped as too old, over the run
        self._closed = False
        # room for T live groups and for dropped ones still finishing in the background
        self._executor = ThreadPoolExecutor(max_workers=4 * self.target, thread_name_prefix="mempo-group")

    def _launch(self, step: int, i: int, version: int) -> None:
        g = Launched(position=step * self.target + i, version=version, started=time.perf_counter())
        batch = PromptBatch([self.prompts.prompt_at(g.position)], n=self.cfg.rollout.n, policy_version=version,
                            step=step, seed=self.cfg.train.seed, min_version=version)

        def run() -> Launched:
            g.traj_refs, g.score_refs, _, _ = self._generate(self.cfg, self.pipe, batch)
            return g

        self.running[self._executor.submit(run)] = g

    def _too_old(self, g: Launched, step: int) -> bool:
        return step - g.version > self.max_lag

    def _drop_too_old(self, step: int) -> int:
        """Forget groups that would train step ``step`` more than max_staleness versions late (a running one
        finishes in the background; its result is never read)."""
        old_done = [g for g in self.done if self._too_old(g, step)]
        old_running = [f for f, g in self.running.items() if self._too_old(g, step)]
        self.done = [g for g in self.done if not self._too_old(g, step)]
        for f in old_running:
            del self.running[f]
        n = len(old_done) + len(old_running)
        if n:
            log.info("step %d: %d over-sampled group(s) dropped, started more than %d version(s) before it",
                     step, n, self.max_lag)
        self.dropped += n
        return n

    def take(self, step: int, version: int) -> tuple[list, list, dict]:
        """(trajectory refs, score refs, metrics) of the first ``prompts_per_step`` groups to complete that
        are fresh enough for step ``step``; launches groups (drawn for ``step``) as the pool needs them.
        ``version``: the learner's version now. A group's call that fails after its retries raises here."""
        t0 = time.perf_counter()
        dropped = self._drop_too_old(step)
        launched = 0
        while True:
            while len(self.running) + len(self.done) < self.target and launched < self.target:
                self._launch(step, launched, version)
                launched += 1
            if len(self.done) >= self.per_step:
                break
            if not self.running:  # cannot happen while target >= per_step; a guard, not a wait without end
                raise RuntimeError(f"step {step}: {len(self.done)} groups done, none running, {self.per_step} needed")
            finished, _ = wait(list(self.running), return_when=FIRST_COMPLETED)
            landed = [g for g in (self.running.pop(f, None) for f in finished) if g is not None]  # None: closed
            if self._closed:
                raise RuntimeError("the group pool was closed while a step waited for its groups")
            for f in finished:
                f.result()  # a call that failed after its retries: the step fails here
            self.done += sorted(landed, key=lambda g: g.started)
            dropped += self._drop_too_old(step)
        taken, self.done = self.done[:self.per_step], self.done[self.per_step:]
        now = time.perf_counter()
        metrics = {"oversample/groups_in_flight": float(len(self.running)),
                   "oversample/groups_buffered": float(len(self.done)),
                   "oversample/groups_launched": float(launched),
                   "oversample/dropped_groups": float(dropped),
                   "oversample/dropped_groups_total": float(self.dropped),
                   "oversample/taken_version_min": float(min(g.version for g in taken)),
                   "oversample/taken_age_s_max": max(now - g.started for g in taken),
                   "oversample/wait_s": now - t0}
        return ([r for g in taken for r in g.traj_refs], [r for g in taken for r in g.score_refs], metrics)

    def close(self) -> dict:
        """Stop launching; groups in flight finish in the background and are dropped (a stop drops the
        buffer). Returns what was dropped: {"oversample/dropped_at_stop_running", ".._buffered"}."""
        self._closed = True
        out = {"oversample/dropped_at_stop_running": float(len(self.running)),
               "oversample/dropped_at_stop_buffered": float(len(self.done))}
        self.running.clear()
        self.done.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        return out
