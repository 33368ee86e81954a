"""Driver side of the learner: the training loop's calls to the learner deployment, as plain methods.

    learner = LearnerDriver(serve.get_deployment_handle("learner", "learner"))
    result = learner.step(traj_refs, score_refs)  # update (and checkpoint): result.metrics (incl. "step"), .groups
    result.metrics.update(learner.publish())      # the new policy to every rollout and scorer replica
    learner.save(); learner.export("runs/x/policy"); learner.info()

Unlike rollout and scoring, a learner call is not retried: the learner is one stateful replica, and a
step that failed after its update must not be applied twice. The refs are passed inside lists, so
they reach the learner as refs and it reads the bytes from the object store itself. Each call waits
for the learner's replica to take it while one is running or starting (services/common/replicas.py).
"""

from __future__ import annotations

from typing import NamedTuple

import ray


class StepResult(NamedTuple):
    """What one update hands back: its metrics (a row of metrics.jsonl), and a few of its training groups
    with their rewards and advantages (services/learner/group_samples.py; ``train.sample_groups``), which
    the driver decodes into groups.jsonl for ``mempo view``."""

    metrics: dict
    groups: list


class LearnerDriver:
    def __init__(self, handle, cfg=None, watch=None, before_retry=None):
        """``watch``: a ReplicaWatch, so a call waits for a starting replacement replica. ``cfg`` and
        ``before_retry`` are taken, and not read, so that every driver is built alike
        (services/pipeline/registry.py): the learner's calls are never retried (it resumes instead)."""
        self.handle = handle
        self.watch = watch

    def _call(self, method: str, *args):
        if self.watch is None:
            return getattr(self.handle, method).remote(*args).result()
        return ray.get(self.watch.assign(lambda: getattr(self.handle, method).remote(*args),
                                         f"the learner's {method} call"))

    def step(self, traj_refs: list["ray.ObjectRef"], score_refs: list["ray.ObjectRef"] | None = None,
             max_staleness: int = 0) -> StepResult:
        """One policy update on these rollouts (and memory scores). Turns sampled more than
        ``max_staleness`` versions before the learner's are dropped (and counted)."""
        out = self._call("step", list(traj_refs), list(score_refs or []), max_staleness)
        return StepResult(out["metrics"], out["groups"])

    def save(self) -> str:
        """A complete checkpoint of the current step; its directory."""
        return self._call("save")

    def export(self, out_dir: str) -> str:
        """The current policy as a Hugging Face directory."""
        return self._call("export", out_dir)

    def publish(self) -> dict:
        """Send the current policy to every rollout and scorer replica (after each step; again when one
        was replaced); the publication's metrics (publish_s, published_replicas, published_version)."""
        return self._call("publish")

    def info(self) -> dict:
        return self._call("info")
