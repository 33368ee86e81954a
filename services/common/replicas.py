"""Why a Serve call has no replica yet, and whether it is worth waiting for one.

A call that no replica takes is waiting for one of three things:

- **busy replicas**: the deployment has running replicas (their queues are full, or one just died and
  Serve has not noticed yet). The call waits up to ``ray.call_timeout_s``, as any call does.
- **a replacement Serve is starting** (a lost node's replica re-placed on a survivor): a cold vLLM
  start takes about a minute on 2 cores and minutes for a 7B model on a loaded cluster. The call waits
  for it up to ``ray.replica_wait_s`` (0 = sized from the model's weights), however slow the machine,
  and says so in the log every few seconds.
- **nothing**: no replica runs or starts, the one Serve is starting fits no live node (no node has
  the resources it asks for, or Serve reports it unscheduled while no node has them free), or its
  constructor fails. The call fails at once with what Serve and the cluster said.

    watch = ReplicaWatch("rollout", "rollout", demand={"CPU": 1, "rollout_node": 1},
                         start_timeout_s=600, call_timeout_s=1800)
    ref = watch.assign(lambda: handle.rollout.remote(payload), "rollout call 3")  # a ref this process owns
    infos = watch.when_available(lambda: broadcast(handle, "info"), "the weight sync")  # retried while worth it
    watch.waited_s                    # seconds spent waiting for replacements (the run's metrics)

Everything read here is public Serve state (``serve.status()``) and the live nodes' resources; the
verdict itself is a pure function (:func:`judge`), tested without a cluster.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("mempo.replicas")

STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")
UNSCHEDULED_HINT = "to be scheduled"  # Serve's message for replicas pending allocation for > 30 s
BASE_START_S, START_S_PER_GIB = 600.0, 60.0  # the default start-up limit: a cold vLLM start, loaded


class NoReplica(RuntimeError):
    """No replica can take the call: nothing runs or starts, or what starts cannot be placed."""


@dataclass
class Seen:
    """One look at a deployment: what Serve says and what the verdict is."""

    verdict: str  # "running" (busy or not yet known dead), "starting" (a replacement is coming), "lost"
    running: int
    starting: int
    why: str  # a sentence for the log or the error


def judge(states: dict[str, int] | None, status: str, trigger: str, message: str, demand: dict[str, float],
          totals: list[dict[str, float]], free: list[dict[str, float]] | None, autoscaler: bool = False) -> Seen:
    """The verdict from Serve's view of a deployment (``states``: replica state -> count, None when the
    application is gone; ``status``, ``trigger``, ``message``: its status) and the live nodes' total and
    free resources. ``free`` None = unknown (then only totals decide). With ``autoscaler`` a replacement
    that fits no live node is still "starting": the cluster may add a node for it."""
    if states is None:
        return Seen("lost", 0, 0, "the application is not running (deleted, or never deployed)")
    running = states.get("RUNNING", 0)
    starting = sum(states.get(s, 0) for s in STARTING_STATES)
    said = f"Serve says {status}" + (f" ({trigger})" if trigger and trigger != "UNSPECIFIED" else "") + \
        (f": {message}" if message else "")
    if running:
        return Seen("running", running, starting, f"{running} running replica(s), all busy; {said}")
    if status == "DEPLOY_FAILED" or trigger == "REPLICA_STARTUP_FAILED":
        return Seen("lost", 0, starting, f"its replicas fail to start; {said}")
    if not starting:
        return Seen("lost", 0, 0, f"no replica is running or starting; {said}")
    need = ", ".join(f"{k} {v:g}" for k, v in sorted(demand.items())) or "nothing"
    if autoscaler:
        return Seen("starting", 0, starting, f"{starting} replacement replica(s) starting or waiting for the "
                                             f"autoscaler (needs {need}); {said}")
    if not any(_covers(n, demand) for n in totals):
        return Seen("lost", 0, starting, f"the replacement needs {need} and no live node has that many "
                                         f"({len(totals)} live node(s)); {said}")
    if free is not None and UNSCHEDULED_HINT in message and not any(_covers(n, demand) for n in free):
        return Seen("lost", 0, starting, f"the replacement needs {need}, it is still unscheduled and no live node "
                                         f"has that many free; {said}")
    return Seen("starting", 0, starting, f"{starting} replacement replica(s) starting (needs {need}); {said}")


def _covers(node: dict[str, float], demand: dict[str, float]) -> bool:
    return all(node.get(k, 0.0) + 1e-9 >= v for k, v in demand.items() if v > 0)


def start_limit_s(configured: float, model_path: str | None) -> float:
    """``ray.replica_wait_s``, or when it is 0 the default sized from the model: 600 s (a cold vLLM start
    of a tiny model on a loaded 2-core machine takes 1-2 min) plus 60 s per GiB of weights on disk."""
    if configured > 0:
        return configured
    gib = 0.0
    if model_path and Path(model_path).is_dir():
        gib = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors")) / 2 ** 30
    return BASE_START_S + START_S_PER_GIB * math.ceil(gib)


class ReplicaWatch:
    """Waits for a replica of one deployment to take a call, for as long as one is worth waiting for."""

    def __init__(self, app: str, deployment: str, demand: dict[str, float], start_timeout_s: float,
                 call_timeout_s: float = 0.0, autoscaler: bool = False, poll_s: float = 2.0,
                 log_every_s: float = 10.0):
        self.app, self.deployment, self.demand, self.autoscaler = app, deployment, dict(demand), autoscaler
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.poll_s, self.log_every_s = poll_s, log_every_s
        self.waited_s = 0.0  # seconds callers spent waiting for a replacement replica
        self.waits = 0  # how many waits saw a replacement starting

    def look(self) -> Seen:
        from ray import serve  # Ray on use

        app = serve.status().applications.get(self.app)
        d = app.deployments.get(self.deployment) if app is not None else None
        if d is None:
            return judge(None, "", "", "", self.demand, [], None)
        totals, free = _node_resources()
        return judge(dict(d.replica_states), str(getattr(d.status, "value", d.status)),
                     str(getattr(d.status_trigger, "value", d.status_trigger)), d.message or "", self.demand,
                     totals, free, self.autoscaler)

    def assign(self, call, what: str):
        """The ObjectRef of a Serve handle call (owned by this process, so the result outlives the
        replica), once a replica takes it. ``call()`` makes the call (a DeploymentResponse); it is made
        again when Serve refuses it outright (DeploymentUnavailableError: no replica at that moment).
        Raises NoReplica, or TimeoutError (the call cancelled), when no replica will take it within the
        limit that applies."""
        from ray.serve.exceptions import DeploymentUnavailableError  # Ray on use

        t0 = time.monotonic()
        wait = self.wait(what)
        response = None
        while True:
            try:
                response = response or call()
                ref = response._to_object_ref_sync(_timeout_s=self.poll_s)
                wait.close()
                return ref
            except TimeoutError:  # still unassigned: keep the same call waiting
                pass
            except DeploymentUnavailableError:  # refused: make it again once there is reason to
                response = None
                time.sleep(self.poll_s)
            try:
                wait.check(t0)
            except Exception:
                if response is not None:
                    response.cancel()
                raise

    def when_available(self, fn, what: str):
        """``fn()``, tried again while Serve refuses it for want of a replica (DeploymentUnavailableError)
        and a replica is worth waiting for; raises NoReplica or TimeoutError when none is."""
        from ray.serve.exceptions import DeploymentUnavailableError  # Ray on use

        t0, wait = time.monotonic(), self.wait(what)
        while True:
            try:
                out = fn()
            except DeploymentUnavailableError:
                wait.check(t0)
                time.sleep(min(1.0, self.poll_s))
                continue
            wait.close()
            return out

    def wait(self, what: str) -> "Wait":
        """The bookkeeping of one wait for a replica of this deployment (``what`` names it in the log)."""
        return Wait(self, what)


class Wait:
    """One wait: which limit applies, what was logged, the seconds it counts. ``check(t0)`` (``t0``:
    when the wait began, ``time.monotonic()``) returns while a replica is worth waiting for and raises
    NoReplica or TimeoutError when not; ``close()`` ends it."""

    def __init__(self, watch: ReplicaWatch, what: str):
        self.watch, self.what = watch, what
        self.starting_since: float | None = None
        self.started_at: float | None = None  # when the last replacement this wait saw stopped starting
        self.logged = 0.0

    def check(self, t0: float) -> None:
        w, now = self.watch, time.monotonic()
        seen = w.look()
        if seen.verdict == "lost":
            self.close()
            raise NoReplica(f"{self.what}: no replica can take it: {seen.why}")
        if seen.verdict == "starting":
            if self.starting_since is None:
                self.starting_since = now
                w.waits += 1
            limit, began, which = w.start_timeout_s, self.starting_since, "ray.replica_wait_s"
        else:
            if self.starting_since is not None:  # the replacement is up: the handle still has to route to it,
                self.started_at = now            # so the call's own limit counts again from here, not from t0
            self.close()
            limit, began, which = w.call_timeout_s, self.started_at or t0, "ray.call_timeout_s"
        if limit and now - began > limit:
            self.close()
            raise TimeoutError(f"{self.what}: no replica took it within {limit:g}s ({which}): {seen.why}")
        if now - self.logged >= w.log_every_s:
            self.logged = now
            log.warning("%s waiting %.0fs for a replica of %s: %s", self.what, now - t0, w.app, seen.why)

    def close(self) -> None:
        if self.starting_since is not None:
            self.watch.waited_s += time.monotonic() - self.starting_since
            self.starting_since = None


def _node_resources() -> tuple[list[dict[str, float]], list[dict[str, float]] | None]:
    """(total, free) resources of each live node; free None when this Ray cannot say."""
    import ray  # Ray on use

    alive = [n for n in ray.nodes() if n["Alive"]]
    totals = [dict(n["Resources"]) for n in alive]
    try:
        from ray._private.state import available_resources_per_node  # Ray on use

        per_node = available_resources_per_node()
        free = [dict(per_node.get(n["NodeID"], {})) for n in alive]
    except Exception:  # an internal API: without it, only the totals decide
        free = None
    return totals, free
