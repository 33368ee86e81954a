"""Bring up the pipeline's Serve applications on a Ray cluster and hand back what drives them.

    pipe = Pipeline.start(cfg)                       # search, rollout, scorer, learner
    pipe = Pipeline.start(cfg, ("search", "scorer")) # only some (``mempo serve --apps``)
                                                     # (never search with search.url: an external server)
    refs = pipe.rollout.rollout(prompt_batch)        # RolloutDriver (retries dead replicas)
    score_refs = pipe.scorer.score(refs)             # ScorerDriver
    update = pipe.learner.step(refs, score_refs)      # LearnerDriver (no retries): .metrics, .groups
    pipe.learner.publish()                            # the new policy to the rollout and scorer replicas
    pipe.shutdown()

Each service is its own Serve application (named ``ray.app_prefix`` + service), so each scales and
fails on its own: rollout replicas are ``rollout.replicas`` vLLM engines, the scorer has
``scorer.replicas``, search may autoscale. HTTP: search at ``/`` (Search-R1's ``POST /retrieve``),
the scorer at ``/scorer`` (``POST /scorer/score``); with a prefix p: ``/{p}search`` and ``/{p}scorer``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.config import MempoConfig
from services.common.local_ray import init_keeping_sigterm, join_options, local_init_options
from services.common.replicas import ReplicaWatch, start_limit_s
from services.pipeline.plan import actors, deployed, fit, live_nodes, totals
from services.pipeline.registry import (POLICY_HOLDERS, SERVICES, app_name, application, route_prefix, service,
                                        wired)
from services.pipeline.start_errors import Target, delete_all, deploy, deploy_all
from services.world.build import prepare_world

log = logging.getLogger("mempo.pipeline")

__all__ = ["SERVICES", "Pipeline", "app_name", "application", "check_resources", "connect", "load_hf_state",
           "replica_watch", "route_prefix", "scale", "wired"]


def connect(cfg: MempoConfig, with_serve: bool = True) -> None:
    """Join ``ray.address`` (or start a loopback-only local cluster) and, unless told not to, start Serve."""
    import ray  # Ray on use: importing the pipeline (``mempo plan``, the tests' pieces) stays light
    from ray import serve  # the same

    if not ray.is_initialized():
        if cfg.ray.address:
            init_keeping_sigterm(**join_options(cfg.ray.address))
        else:  # a cluster of our own: loopback only, token auth on (services/common/local_ray.py)
            init_keeping_sigterm(**local_init_options(cfg.ray.num_cpus or None, cfg.ray.object_store_memory))
    for name in ("ray", "ray.serve"):  # keep the console to mempo's own lines
        logging.getLogger(name).setLevel(logging.WARNING)
    if with_serve:
        serve.start(proxy_location=cfg.ray.proxy_location,
                    http_options={"host": cfg.ray.http_host, "port": cfg.ray.http_port})


def check_resources(cfg: MempoConfig, services, strict: bool = True) -> None:
    """Fail fast, with the numbers, when this cluster's live nodes cannot place the services (Serve
    would otherwise wait forever for a replica that never fits). ``strict=False`` logs instead (a
    cluster with an autoscaler may add nodes). The arithmetic is services/pipeline/plan.py's."""
    errors, warnings = fit(actors(cfg, services), live_nodes())
    for w in warnings:
        log.warning("%s", w)
    if not errors:
        return
    msg = (f"the services do not fit this Ray cluster ({'; '.join(errors)}); lower replicas, num_cpus/num_gpus or "
           f"resources of search/rollout/scorer, learner.num_cpus_per_worker or world_size, or add nodes "
           f"(`mempo plan CONFIG` prints what a config needs)")
    if strict:
        raise ValueError(msg)
    log.warning("%s", msg)


@dataclass
class Pipeline:
    cfg: MempoConfig
    apps: list[str]
    search: Any = None  # DeploymentHandle
    rollout: Any = None  # RolloutDriver
    scorer: Any = None  # ScorerDriver
    learner: Any = None  # LearnerDriver
    version: int | None = None  # the policy version the training loop last synced
    republished: int = 0  # publishes to bring replaced (or new) replicas up to date, since start
    watches: dict = field(default_factory=dict)  # service -> ReplicaWatch: why a call waits, for how long
    start_s: dict = field(default_factory=dict)  # service -> seconds from the deploy call until it ran (kept: ~1 s)
    # one weight sync at a time: the loop's, the rollout's retries and the scoring stream's (each its own thread)
    _syncing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def start(cls, cfg: MempoConfig, services: tuple[str, ...] | list[str] = tuple(SERVICES)) -> "Pipeline":
        cfg = wired(prepare_world(cfg))  # the world is built here, once; replicas get concrete paths
        connect(cfg)
        # search, the policy copies, the learner (the order of pipe.apps and of the logs); no search with
        # search.url (the rollout calls that external server)
        order = deployed(cfg, services)
        if "search" in services and "search" not in order:
            log.info("search is external (search.url=%s): not deployed", cfg.search.url)
        check_resources(cfg, order, strict=not cfg.ray.address)  # a cluster with an autoscaler may grow
        pipe = cls(cfg, [app_name(cfg, name) for name in order])
        # every service submitted at once: their replicas start side by side (a learner that publishes to the
        # policy copies finds their applications already registered, and sends nothing before a step)
        started = deploy_all([Target(application(cfg, name), app_name(cfg, name), route_prefix(cfg, name), name)
                              for name in order])
        for name in order:  # each driver whole: its replica watch, and the resync a replaced policy copy needs
            handle, pipe.start_s[name] = started[name]
            watch = replica_watch(cfg, name) if SERVICES[name].driver_class else None
            if watch is not None:
                pipe.watches[name] = watch
            setattr(pipe, name, SERVICES[name].driver(handle, cfg, watch=watch, before_retry=pipe.resync))
        return pipe

    def resync(self) -> None:
        """Before a retried call: a replica Serve started in place of a dead one holds ``model.path``;
        bring it to the learner's current policy (with rollout ahead of the learner, newer than the last
        ``sync_weights``; without a learner, that sync's, and a no-op before the first)."""
        target = self.learner.info()["version"] if self.learner is not None else self.version
        if target is not None:
            self.sync_weights(target)

    def sync_weights(self, version: int) -> bool:
        """Make every live rollout/scorer replica hold policy ``version`` before it samples: a replica
        Serve started to replace a dead one loads ``model.path``, not the current policy. Returns
        whether the learner had to publish again."""
        with self._syncing:
            self.version = version
            stale = [r for d in self._policy_holders()
                     for r in self._replica_info(d) if r.get("version") != version]
            if stale and self.learner is not None:
                log.warning("%d replica(s) behind version %d (replaced?); publishing again", len(stale), version)
                self.learner.publish()
                self.republished += 1
            return bool(stale)

    def engine_busy(self) -> dict[str, float]:
        """Each live rollout replica's seconds with a turn generating since it started (its ``info``); a
        metric, so it never waits for a replica or fails the step: {} when none answers."""
        from services.learner.publish import broadcast  # imports Ray and torch at its top

        if self.rollout is None:
            return {}
        try:
            infos = broadcast(self.rollout.handle, "info")[0]
        except Exception as e:  # no replica alive (one being replaced): the step's share is left out
            log.debug("engine busy time unavailable: %s", e)
            return {}
        return {str(r.get("replica")): float(r.get("engine_busy_s", 0.0)) for r in infos}

    def replica_names(self) -> dict[str, list[str]]:
        """service -> the names of its live replicas (rollout, scorer, learner; the search service
        has no ``info``): the same names after a redeploy mean Serve kept the replicas."""
        drivers = {name: getattr(self, name) for name, svc in SERVICES.items() if svc.driver_class is not None}
        return {s: sorted(str(r.get("replica")) for r in self._replica_info(d))
                for s, d in drivers.items() if d is not None}

    def _policy_holders(self) -> list:
        """The drivers of the running services that hold a copy of the policy (rollout, scorer)."""
        return [d for d in (getattr(self, name) for name in POLICY_HOLDERS) if d is not None]

    @staticmethod
    def _replica_info(driver) -> list[dict]:
        """``info`` of every live replica of a driver's deployment. One whose every replica died has none
        until Serve's replacement is up: that is waited for while the driver's ReplicaWatch says one is
        starting and fits the cluster (up to ``ray.replica_wait_s``), and fails at once when not."""
        from services.learner.publish import broadcast  # imports Ray and torch at its top

        if driver.watch is None:
            return broadcast(driver.handle, "info")[0]
        return driver.watch.when_available(lambda: broadcast(driver.handle, "info")[0],
                                           f"the weight sync of {driver.watch.app}")

    def publish_model(self, model_dir: str, version: int) -> dict:
        """Load a Hugging Face policy directory into every rollout and scorer replica (for eval)."""
        from services.learner.publish import ObjectStorePublisher  # imports Ray and torch at its top

        handles = [d.handle for d in self._policy_holders()]
        return ObjectStorePublisher(handles).publish(load_hf_state(model_dir), version)

    def shutdown(self) -> None:
        delete_all(self.apps)
        self.apps = []


def replica_watch(cfg: MempoConfig, service: str):
    """The ReplicaWatch of one service's deployment: what one replica asks of a node (services/pipeline/
    plan.py, the numbers ``mempo plan`` prints) and the config's limits."""
    replica = next(a for a in actors(cfg, (service,)) if a.what == "replica")
    return ReplicaWatch(app_name(cfg, service), service, replica.demand(),
                        start_limit_s(cfg.ray.replica_wait_s, cfg.model.path), cfg.ray.call_timeout_s,
                        cfg.ray.autoscaler)


def scale(cfg: MempoConfig, name: str, replicas: int) -> None:
    """Resize one service of a running pipeline. ``cfg`` is the config it was deployed with (a
    training run writes it to ``<run_dir>/pipeline.yaml``); only the replica count changes, so Serve
    adds or removes replicas and leaves the running ones alone. New rollout/scorer replicas start
    from ``model.path`` and take the current policy at the learner's next publish (every step)."""
    import ray  # Ray on use (see connect)
    from ray import serve  # the same

    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if name == "search" and cfg.search.url:
        raise ValueError(f"search is external (search.url={cfg.search.url}): scale that server, not the pipeline")
    if not service(name).scalable:
        raise ValueError(f"{name} cannot be scaled; choose from "
                         f"{', '.join(n for n, s in SERVICES.items() if s.scalable)}")
    cfg = cfg.model_copy(deep=True)
    section = getattr(cfg, name)  # a scalable service's section is named after it and has ``replicas``
    section.replicas = replicas
    if name == "search":
        section.autoscaling = False
    connect(cfg)
    status = serve.status().applications.get(app_name(cfg, name))
    if status is None:
        raise ValueError(f"no running application {app_name(cfg, name)!r}: is the pipeline up?")
    current = sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())
    extra = totals(actors(cfg, (name,))).get("CPU", 0.0) * max(0, replicas - current) / replicas
    free = ray.available_resources().get("CPU", 0.0)
    if extra > free + 1e-9:
        raise ValueError(f"{replicas - current} more {name} replica(s) need {extra:g} CPUs; the cluster has {free:g} "
                         f"free (add nodes, or lower {name}.num_cpus in the run's config before starting it)")
    deploy(application(cfg, name), app_name(cfg, name), route_prefix(cfg, name), name)


def load_hf_state(model_dir: str) -> dict:
    """The tensors of a Hugging Face model directory (one or several safetensors files)."""
    from safetensors.torch import load_file  # imports torch

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights (expected a Hugging Face model directory)")
    state: dict = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
