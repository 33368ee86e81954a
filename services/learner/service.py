"""The learner deployment: owns the FSDP worker group, turns rollouts + memory scores into a policy
update, checkpoints, and publishes the new weights to the rollout and scorer deployments.

Handle methods:
    step([TrajectoryBatch refs], [MemoryScoreBatch refs or None], max_staleness=0) -> metrics incl. the
        new version (refs wrapped in a list stay refs: the learner reads the bytes from the object
        store itself); turns and memory scores more than max_staleness versions old are dropped, counted
    save() -> checkpoint path           info() -> {"replica", "version", "step", ...}
    publish() -> report (re-send the current policy, e.g. after a resume)
    export(out_dir) -> out_dir (a plain Hugging Face directory of the current policy)

One step: advantages per trajectory batch (docs/algorithm.md, section 5) -> per-turn samples -> one
PPO/GRPO update on W ranks -> version + 1 -> every ``learner.checkpoint_every`` steps a sharded
checkpoint in ``train.run_dir`` -> the full state dict to every replica of ``learner.publish_to``
(``learner.publish``: by the object store, or by a gloo group, services/learner/collective.py).
On start it resumes from the latest complete checkpoint of ``train.run_dir`` (``learner.resume``).
A worker that dies (mid-update, or idle before a save, publish or export) gets the group rebuilt from
that checkpoint (see ``_with_group``).
Each start and each update is appended to ``<run_dir>/ledger.jsonl`` (services/learner/ledger.py).

    serve.run(learner_app(cfg), name="learner", route_prefix=None)
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import ray
from ray import serve

from services.common.codec import decode
from services.config import MempoConfig, actor_options, replica_config
from services.common.messages import MemoryScoreBatch, TrajectoryBatch
from services.common.paths import model_path
from services.algorithm.retention import retention_metrics
from services.serve_version import pinned
from services.learner.ledger import Ledger

log = logging.getLogger("mempo.learner")


def memory_spread(adv_metrics: list[dict]) -> dict:
    """The step's memory-reward spread from each batch's advantages: the std of R_mem per pool (mean
    over pools, and the largest) and the mean |A_mem| per block."""
    pools = sum(m["mem_pools"] for m in adv_metrics)
    blocks = sum(m["mem_blocks"] for m in adv_metrics)
    return {"mem_pool_std_mean": sum(m["mem_pool_std_mean"] * m["mem_pools"] for m in adv_metrics) / max(pools, 1.0),
            "mem_pool_std_max": max((m["mem_pool_std_max"] for m in adv_metrics), default=0.0),
            "mem_adv_abs_mean": sum(m["mem_adv_abs_mean"] * m["mem_blocks"] for m in adv_metrics) / max(blocks, 1.0)}


def stage_metrics(trajs: list[TrajectoryBatch], scores: list[MemoryScoreBatch], version: int) -> dict:
    """What the rollout and scorer stages reported in their batches, merged over calls, plus how
    many versions behind the learner the sampled tokens were (0 = on-policy)."""
    out: dict[str, float] = {}
    eps = sum(t.metrics.get("episodes", 0.0) for t in trajs) or 1.0
    for key in ("episodes", "generated_tokens", "tool_calls", "tool_failures", "engine_s", "tool_s"):
        out[f"rollout/{key}"] = sum(t.metrics.get(key, 0.0) for t in trajs)
    for key in ("turns_mean", "peak_tokens_mean", "total_tokens_mean", "answered_share"):
        out[f"rollout/{key}"] = sum(t.metrics.get(key, 0.0) * t.metrics.get("episodes", 0.0) for t in trajs) / eps
    out["rollout/peak_tokens_max"] = max((t.metrics.get("peak_tokens_max", 0.0) for t in trajs), default=0.0)
    out["rollout/call_wall_s_max"] = max((t.metrics.get("wall_s", 0.0) for t in trajs), default=0.0)
    versions = [turn.policy_version for t in trajs for g in t.groups for ep in g.episodes for turn in ep.turns]
    out["version_lag_mean"] = float(np.mean([version - v for v in versions])) if versions else 0.0
    out["version_lag_max"] = float(max((version - v for v in versions), default=0))
    if scores:
        blocks = sum(s.metrics.get("blocks", 0.0) for s in scores)
        out["scorer/blocks"] = blocks
        out["scorer/seconds"] = sum(s.metrics.get("seconds", 0.0) for s in scores)
        for key in ("p_mem_mean", "p_full_mean", "r_mem_mean"):
            weighted = sum(s.metrics.get(key, 0.0) * s.metrics.get("blocks", 0.0) for s in scores)
            out[f"scorer/{key}"] = weighted / max(blocks, 1.0)
        # does R_mem track retention? over every block of the step (services/algorithm/retention.py)
        every = [x for s in scores for x in s.scores]
        out.update({f"scorer/{k}": v for k, v in retention_metrics([x.r_mem for x in every],
                                                                   [x.retained for x in every]).items()})
    return out


def trained_prompts(trajs: list[TrajectoryBatch]) -> dict[str, list[int]]:
    """Prompt uid -> [groups, episodes] over a step's trajectory batches (the ledger's ``prompts``)."""
    out: dict[str, list[int]] = {}
    for t in trajs:
        for g in t.groups:
            count = out.setdefault(g.prompt.uid, [0, 0])
            count[0] += 1
            count[1] += len(g.episodes)
    return out


def publish_handles(targets: list[str]) -> list:
    """Handles of the ``app:deployment`` targets the learner publishes weights to. One not deployed
    (``mempo serve --apps learner`` alone) is left out with a warning, not a failed start."""
    handles = []
    for name in targets:
        app, _, deployment = name.rpartition(":")
        try:
            handles.append(serve.get_deployment_handle(deployment, app_name=app or deployment))
        except KeyError:
            log.warning("%s is not deployed: the learner will not publish weights to it", name)
    return handles


@serve.deployment(name="learner")
class LearnerService:
    def __init__(self, config: dict):
        # The learner's torch modules are imported in the replica only: the driver imports this module to
        # build the application (registry.py), and torch would cost it seconds it never uses.
        from services.learner.collective import CollectivePublisher, store_host
        from services.learner.group import LearnerGroup
        from services.learner.publish import ObjectStorePublisher

        self.cfg = MempoConfig.model_validate(config)
        self.model_dir = str(model_path(self.cfg))
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.group = LearnerGroup(self.cfg, self.model_dir)
        resumed = self.group.resume(self.cfg.train.run_dir)
        self.step_no = resumed["step"] if resumed else 0
        self.ledger = Ledger(self.cfg.train.run_dir)  # what each update trained (services/learner/ledger.py)
        self.ledger.start(self.step_no, self.group.param_digest(), "checkpoint" if resumed else "fresh")
        handles = publish_handles(self.cfg.learner.publish_to)
        if self.cfg.learner.publish == "object_store" or self.cfg.learner.lora.served_as_adapter:  # adapters: megabytes
            self.publisher = ObjectStorePublisher(handles)
        else:  # the group's listeners: loopback on one machine, this node's address on a cluster
            self.publisher = CollectivePublisher(handles, self.cfg.learner.publish, store_host(self.cfg.ray.address),
                                                 min_bytes=int(self.cfg.learner.collective_min_mb * 1e6))
        self.busy = asyncio.Lock()
        self.restarts, self.last_restart_s = 0, 0.0
        self.phase = "idle"  # "train_step" while the workers update
        log.info("learner ready: W=%d, step %d%s", self.group.world, self.step_no, " (resumed)" if resumed else "")

    def _fetch(self, ref, what: str) -> bytes:
        """The bytes behind a ref, waiting at most ``ray.call_timeout_s`` (an object whose every copy was
        on a lost node either comes back through Ray's recovery or fails here, with its name)."""
        timeout = self.cfg.ray.call_timeout_s or None
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the learner waited {timeout:g}s (ray.call_timeout_s) for {what} and got "
                               f"nothing; was the node holding it lost?") from None

    def _step(self, traj_refs: list, score_refs: list, max_staleness: int = 0) -> dict:
        # torch (samples) in the replica only, as in __init__
        from services.algorithm.advantages import compute_advantages
        from services.learner.group_samples import group_records
        from services.learner.samples import pack, turn_samples

        t0 = time.perf_counter()
        samples, adv_metrics, trajs, score_batches, shown = [], [], [], [], []
        stale_scores = stale_samples = 0
        dropped_versions: list[int] = []  # of memory scores dropped as stale (the ledger lists them)
        for i, ref in enumerate(traj_refs):
            traj = decode(self._fetch(ref, f"trajectory batch {i}"), TrajectoryBatch)
            scores = (decode(self._fetch(score_refs[i], f"memory scores {i}"), MemoryScoreBatch)
                      if score_refs and score_refs[i] is not None else None)
            if scores is not None and not self._fresh(scores.policy_version, max_staleness):
                # scored by a policy older than the staleness bound allows (a replacement replica that had
                # not been synced yet holds model.path): its memory rewards would be wrong, so none
                log.warning("memory scores of version %d dropped (learner at %d, max_staleness %d)",
                            scores.policy_version, self.version, max_staleness)
                stale_scores += 1
                dropped_versions.append(scores.policy_version)
                scores = None
            adv = compute_advantages(traj, scores, self.cfg.algorithm)
            shown += group_records(traj, scores, adv, self.cfg.train.sample_groups - len(shown))  # for mempo view
            turns = turn_samples(traj, adv, first_group=sum(len(t.groups) for t in trajs))
            fresh = [x for x in turns if self._fresh(x.version, max_staleness)]
            samples += fresh
            stale_samples += len(turns) - len(fresh)
            adv_metrics.append(adv.metrics)
            trajs.append(traj)
            score_batches += [scores] if scores is not None else []
        stages = stage_metrics(trajs, score_batches, self.version)
        batch = pack(samples, self.version, self.step_no)
        prep_s = time.perf_counter() - t0
        try:
            metrics = self._train_step(batch)
        finally:
            self.phase = "idle"
        self.step_no += 1
        if self.step_no % self.cfg.learner.checkpoint_every == 0:
            metrics["checkpoint"] = self._with_group(f"the checkpoint of step {self.step_no}", self._save)
        n = max(1, len(adv_metrics))
        for key in ("reward_mean", "f1_mean", "format_ok_share", "groups_with_variance"):
            metrics[key] = sum(m[key] for m in adv_metrics) / n
        metrics.update(memory_spread(adv_metrics))
        metrics.update(version=self.version, step=self.step_no, prepare_s=prep_s, samples=len(batch.cu_seqlens) - 1,
                       episodes=sum(len(g.episodes) for t in trajs for g in t.groups),
                       prompt_groups=sum(len(t.groups) for t in trajs),
                       prompt_groups_unique=len({g.prompt.uid for t in trajs for g in t.groups}),
                       stale_score_batches=float(stale_scores), stale_samples_dropped=float(stale_samples), **stages)
        # on record before the weights go out and before the driver hears of the step: a publication that
        # fails, or a driver stopped meanwhile, leaves the step trained and in the ledger (ledger.py)
        digest = self._with_group("the ledger's digest", lambda: self.group.param_digest())
        self.ledger.trained(self.step_no, digest, trained_prompts(trajs),
                            [x.version for x in samples], [s.policy_version for s in score_batches],
                            dropped_versions, stale_samples, "checkpoint" in metrics, metrics)
        metrics.update(busy_s=time.perf_counter() - t0)
        return {"metrics": metrics, "groups": shown}  # groups: sampled training groups, for groups.jsonl

    def _publish(self) -> dict:
        """The current policy to every rollout and scorer replica; the publication's metrics."""
        t0 = time.perf_counter()
        report = self.publisher.publish(self._full_state(), self.version) if self.publisher.handles else {}
        out = {"publish_s": time.perf_counter() - t0, "published_replicas": report.get("replicas", 0),
               "published_version": self.version}
        if "path" in report:  # learner.publish collective/auto: 1 when these weights went by the group
            out["publish_collective"] = float(report["path"] == "collective")
        return out

    @property
    def version(self) -> int:
        """The policy version: how many updates the weights have had. Its one owner; the replicas and the
        driver hold the version they were given or told (``info``, ``publish``)."""
        return self.step_no

    def _fresh(self, version: int, max_staleness: int) -> bool:
        """Within the staleness bound: sampled (or scored) at most ``max_staleness`` versions ago. The
        driver keeps every batch within it; this catches what it cannot (a replica replaced mid-run)."""
        return self.version - version <= max_staleness

    def _train_step(self, batch) -> dict:
        """One update, on a group rebuilt first if a worker of it died (``_with_group``)."""
        self.phase = "train_step"
        restarts = self.restarts
        metrics = self._with_group(f"step {self.step_no + 1}", lambda: self.group.train_step(batch))
        if self.restarts != restarts:
            metrics.update(learner_restarts=float(self.restarts), learner_restart_s=self.last_restart_s)
        return metrics

    def _with_group(self, what: str, call):
        """``call()`` on the worker group (a callable that reads ``self.group`` when called, so that a retry
        runs on the rebuilt group). If a worker of it has died (during the call, or idle since the
        last one), the group is rebuilt from the latest complete checkpoint and, when that checkpoint
        holds the current step (for an update: the step before it), ``call`` is made again (automatic).
        Otherwise the steps since that checkpoint are gone: the call fails saying so, and the same
        ``mempo train`` command resumes there."""
        from services.learner.group import RankLost  # torch in the replica only, as in __init__

        try:
            return call()
        except RankLost as e:  # a rank died, whichever rank's error came first (group.gather)
            log.error("a learner worker died (%s during %s); rebuilding the group", e, what)
            t0 = time.perf_counter()
            resumed = self._rebuild_group()
            self.restarts += 1
            self.last_restart_s = time.perf_counter() - t0
            if resumed != self.step_no:
                self.step_no = resumed
                raise RuntimeError(f"a learner worker died; the group was rebuilt from the checkpoint of step "
                                   f"{resumed} (the latest complete one): run the same command again to resume "
                                   f"from there") from e
            log.warning("learner group rebuilt at step %d in %.1fs; %s again", resumed, self.last_restart_s, what)
            return call()

    def _save(self) -> str:
        return self.group.save_checkpoint(self.cfg.train.run_dir, self.step_no, {"version": self.version})

    def _full_state(self) -> dict:
        """The policy's state dict for publication (with ``learner.lora.publish: adapter`` the adapters only),
        from a rebuilt group if a worker had died."""
        form = "adapter" if self.cfg.learner.lora.served_as_adapter else "merged"
        return self._with_group("publication", lambda: self.group.full_state_dict(form))

    def _rebuild_group(self) -> int:
        """A fresh worker group at the latest complete checkpoint of the run; returns its step."""
        from services.learner.group import LearnerGroup  # torch in the replica only, as in __init__

        try:
            self.group.shutdown()
        except Exception:  # the dead worker cannot answer; the others are killed anyway
            pass
        self.group = LearnerGroup(self.cfg, self.model_dir)
        resumed = self.group.resume(self.cfg.train.run_dir)
        step = resumed["step"] if resumed else 0
        self.ledger.start(step, self.group.param_digest(), "rebuilt")
        return step

    async def step(self, traj_refs: list, score_refs: list | None = None, max_staleness: int = 0) -> dict:
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        async with self.busy:  # one update at a time; save/publish/export wait for it to finish
            return await asyncio.to_thread(self._step, list(traj_refs), list(score_refs or []), max_staleness)

    async def save(self) -> str:
        """A checkpoint of the current step (kept as is if this step already has a complete one)."""
        from services.learner.checkpoint import MARKER, step_dir  # torch in the replica only, as in __init__

        async with self.busy:
            path = step_dir(self.cfg.train.run_dir, self.step_no)
            if (path / MARKER).is_file():
                return str(path)
            return await asyncio.to_thread(self._with_group, f"the checkpoint of step {self.step_no}", self._save)

    async def publish(self) -> dict:
        """Send the current policy to every rollout and scorer replica (after each step, and again when the
        driver finds a replica behind); {"publish_s", "published_replicas", "published_version", ...}."""
        async with self.busy:
            return await asyncio.to_thread(self._publish)

    async def export(self, out_dir: str) -> str:
        async with self.busy:
            return await asyncio.to_thread(self._with_group, "the export",
                                           lambda: self.group.export_hf(out_dir, self.model_dir))

    def info(self) -> dict:
        return {"replica": self.replica, "version": self.version, "step": self.step_no, "world_size": self.group.world, "model": self.model_dir,
                "worker_pids": self.group.pids, "phase": self.phase, "restarts": self.restarts,
                "node_id": ray.get_runtime_context().get_node_id()}

    def __del__(self):
        group = getattr(self, "group", None)
        if group is not None:
            try:
                group.shutdown()
            except Exception:  # the cluster may already be gone
                pass


REPLICA_SHARE = 0.001  # of each custom learner resource, taken by the learner's Serve replica


def deployment_options(cfg: MempoConfig) -> dict:
    """One replica that reserves no CPU itself (its FSDP workers do); it asks REPLICA_SHARE of each of
    ``learner.resources`` so that it runs on the learner's nodes, beside its workers."""
    share = {k: REPLICA_SHARE for k in cfg.learner.resources}
    return {"num_replicas": 1, "ray_actor_options": actor_options(0, 0.0, share),
            "max_ongoing_requests": 4}


def learner_app(cfg: MempoConfig):
    config = replica_config(cfg)
    return pinned(LearnerService.options(**deployment_options(cfg)), config, "learner").bind(config)
