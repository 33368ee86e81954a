"""The faults ``mempo chaos`` injects, and the seeded schedule that draws them.

    plan = schedule(seed=0, steps=30)                  # [Fault(step=2, kind="scorer_replica", ...), ...]
    plan = parse_plan("2:scorer_replica+vllm_engine,4:driver_sigterm")
    injector = Injector(cluster, prefix="chaos-")      # connected to the cluster (ray.init by the caller)
    record = injector.inject(fault)                    # {"kind", "at", "target", "seconds", ...}

Every kind is done for real, to the running pipeline:

    rollout_replica   ray.kill of a rollout replica's actor (its worker process dies; Serve replaces it)
    vllm_engine       SIGKILL to the vLLM engine core process of a rollout replica (restarted in place)
    scorer_replica    ray.kill of a scorer replica
    search_replica    ray.kill of a search replica
    learner_rank      SIGKILL to one FSDP worker of the learner (the group is rebuilt from its checkpoint)
    node              a worker node lost as a machine is (raylet and its processes, SIGKILL), and a new
                      node with the same resources added back (the autoscaler's part)
    search_delay      the search replicas' processes stopped (SIGSTOP) for some seconds, then continued:
                      every search in that window answers that much later
    driver_sigterm    SIGTERM to the ``mempo train`` driver; the chaos run starts the same command again

The schedule: after a fault at step s the next comes at s + 1..3 (``every``), the first at step 2;
with probability ``overlap`` a second kind, drawn from the others, lands in the same step. Each lands
a drawn fraction of a step (``at``) after its step begins, a step's seconds being the run's median so
far, so faults land inside their step on a fast pipeline and a slow one alike.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass

KINDS = ("rollout_replica", "vllm_engine", "scorer_replica", "search_replica", "learner_rank", "node",
         "search_delay", "driver_sigterm")


@dataclass(frozen=True)
class Fault:
    step: int  # the training step (1-based) during which it lands
    kind: str
    at: float  # when in the step: this fraction of a step's seconds after it starts (the previous step's ledger line)
    seconds: float = 0.0  # search_delay: how long searches are held


def schedule(seed: int, steps: int, kinds: tuple[str, ...] = KINDS, every: tuple[int, int] = (1, 3),
             overlap: float = 0.35, max_faults: int | None = None, at: tuple[float, float] = (0.05, 0.7),
             hold_s: tuple[float, float] = (2.0, 6.0)) -> list[Fault]:
    """The seeded fault plan of a run of ``steps`` steps: the same seed gives the same plan."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown fault kind(s) {unknown or kinds}; choose from {', '.join(KINDS)}")
    rng = random.Random(f"chaos/{seed}")
    plan: list[Fault] = []
    step = 2
    while step <= steps and (max_faults is None or len(plan) < max_faults):
        drawn = [rng.choice(kinds)]
        if len(kinds) > 1 and rng.random() < overlap:
            drawn.append(rng.choice([k for k in kinds if k != drawn[0]]))
        for kind in drawn:
            if max_faults is not None and len(plan) >= max_faults:
                break
            plan.append(Fault(step, kind, round(rng.uniform(*at), 2),
                              round(rng.uniform(*hold_s), 2) if kind == "search_delay" else 0.0))
        step += rng.randint(*every)
    return plan


def parse_plan(text: str) -> list[Fault]:
    """``STEP:KIND[+KIND...][,STEP:KIND...]`` -> faults (a third of a step after it starts; a search_delay
    holds 4 s)."""
    plan = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        step, sep, kinds = part.partition(":")
        if not sep or not step.strip().isdigit() or int(step) < 1:
            raise ValueError(f"--plan {part!r}: expected STEP:KIND[+KIND...] with STEP >= 1")
        for kind in kinds.split("+"):
            if kind not in KINDS:
                raise ValueError(f"--plan {part!r}: unknown fault kind {kind!r}; choose from {', '.join(KINDS)}")
            plan.append(Fault(int(step), kind, 0.33, 4.0 if kind == "search_delay" else 0.0))
    return sorted(plan, key=lambda f: f.step)


class Injector:
    """Does one fault to the pipeline of app prefix ``prefix`` on ``cluster`` (a LocalCluster); the
    caller's process is connected to that cluster. ``driver`` is called for driver_sigterm."""

    def __init__(self, cluster, prefix: str, driver_sigterm=None, node_resources: dict | None = None):
        self.cluster, self.prefix, self.driver_sigterm = cluster, prefix, driver_sigterm
        self.node_resources = node_resources or {}  # worker name -> its (cpus, resources), to add back alike
        self.added = 0
        self.holds: list[threading.Timer] = []  # search_delay's pending SIGCONTs (``release`` ends them now)

    def replicas(self, service: str) -> list[str]:
        import ray  # Ray on use (the module's plan functions need none)

        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(f"SERVE_REPLICA::{self.prefix}{service}#"))

    def _handle(self, service: str):
        from ray import serve  # Ray on use

        return serve.get_deployment_handle(service, app_name=f"{self.prefix}{service}")

    def _kill_replica(self, service: str, rng: random.Random) -> str:
        import ray  # Ray on use

        names = self.replicas(service)
        if not names:
            raise LookupError(f"no live {service} replica to kill")
        name = rng.choice(names)
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def _replica_pids(self, service: str) -> dict[str, list[int]]:
        return self.cluster.processes(f"ray::ServeReplica:{self.prefix}{service}:{service}")

    def inject(self, fault: Fault, rng: random.Random) -> dict:
        """Do ``fault`` now; returns what was done (target, when, and for search_delay how long)."""
        record = {"step": fault.step, "kind": fault.kind, "at": time.time()}
        kind = fault.kind
        if kind in ("rollout_replica", "scorer_replica", "search_replica"):
            record["target"] = self._kill_replica(kind.removesuffix("_replica"), rng)
        elif kind == "vllm_engine":
            infos = [i for i in _broadcast_info(self._handle("rollout")) if i.get("engine_pid")]
            if not infos:
                raise LookupError("no rollout replica reported a vLLM engine process")
            pid = rng.choice(infos)["engine_pid"]
            os.kill(pid, signal.SIGKILL)
            record["target"] = f"engine pid {pid}"
        elif kind == "learner_rank":
            pids = self._handle("learner").info.remote().result(timeout_s=60)["worker_pids"]
            rank = rng.randrange(len(pids))
            os.kill(pids[rank], signal.SIGKILL)
            record["target"] = f"learner rank {rank} (pid {pids[rank]})"
        elif kind == "node":
            workers = sorted(n for n in self.cluster.nodes if n != "head" and self.cluster.alive(n))
            victim = rng.choice(workers)
            self.cluster.kill_node(victim)
            self.added += 1
            cpus, resources = self.node_resources[victim]
            name = f"{victim.split('+')[0]}+{self.added}"  # worker-1 -> worker-1+1: the same resources, anew
            self.node_resources[name] = (cpus, resources)
            self.cluster.add(name, cpus, resources)
            record.update(target=victim, added=name, node_back_s=time.time() - record["at"])
        elif kind == "search_delay":
            pids = [p for ps in self._replica_pids("search").values() for p in ps]
            if not pids:
                raise LookupError("no search replica process to hold")
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            record["target"] = f"search pids {pids}"

            def resume():
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            timer = threading.Timer(fault.seconds, resume)
            timer.start()
            self.holds.append(timer)
            record["seconds"] = fault.seconds
        elif kind == "driver_sigterm":
            record["target"] = self.driver_sigterm()
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return record


    def release(self) -> None:
        """Wait for every held search replica to be continued."""
        for timer in self.holds:
            timer.join()


def _broadcast_info(handle) -> list[dict]:
    from services.learner.publish import broadcast  # Ray and torch at its top

    return broadcast(handle, "info")[0]
