"""Driver side of the learner: the training loop's calls to the learner deployment, as plain methods.

    learner = LearnerDriver(serve.get_deployment_handle("learner", "learner"))
    stats = learner.step(traj_refs, score_refs)   # update, checkpoint, publish -> metrics incl. "step"
    learner.save(); learner.export("runs/x/policy"); learner.info(); learner.publish()

Unlike rollout and scoring, a learner call is not retried: the learner is one stateful replica, and a
step that failed after its update must not be applied twice. The refs are passed inside lists, so
they reach the learner as refs and it reads the bytes from the object store itself.
"""

from __future__ import annotations

import ray


class LearnerDriver:
    def __init__(self, handle):
        self.handle = handle

    def step(self, traj_refs: list["ray.ObjectRef"], score_refs: list["ray.ObjectRef"] | None = None,
             max_staleness: int = 0) -> dict:
        """One policy update on these rollouts (and memory scores); metrics of the step. Turns sampled
        more than ``max_staleness`` versions before the learner's are dropped (and counted)."""
        return self.handle.step.remote(list(traj_refs), list(score_refs or []), max_staleness).result()

    def save(self) -> str:
        """A complete checkpoint of the current step; its directory."""
        return self.handle.save.remote().result()

    def export(self, out_dir: str) -> str:
        """The current policy as a Hugging Face directory."""
        return self.handle.export.remote(out_dir).result()

    def publish(self) -> dict:
        """Send the current policy to every rollout and scorer replica again."""
        return self.handle.publish.remote().result()

    def info(self) -> dict:
        return self.handle.info.remote().result()
