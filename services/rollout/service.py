"""The rollout service: one vLLM engine per Serve replica, running the MemPO agent loop.

Methods (through a DeploymentHandle; payloads are msgpack bytes of protocol messages, so an
ObjectRef passed as the top-level argument arrives resolved):

    rollout(PromptBatch bytes) -> TrajectoryBatch bytes   (returned by value: the caller turns the
                                                           response into an ObjectRef it owns, so
                                                           the data outlives this replica)
    update_weights(WeightUpdate bytes, version) -> {"version", "seconds", "replica"}
    weight_group() / join_weight_group(...) / receive_weights(...) / commit_weights(group_id, version)
        -> the collective publication's steps (services/learner/collective.py)
    generate(prompt_ids, max_tokens, temperature, seed) -> {"token_ids", "logprobs", "version"}
    info() -> {"replica", "version", "model", "engine_pid", "turns_running", "engine_restarts", ...}

A vLLM engine that dies (its process killed or crashed) is restarted in place with the policy it
held (services/rollout/engine.py); the driver retries the calls it failed.

Replicas, CPUs/GPUs per replica and per-replica concurrency come from the ``rollout`` config
section; the agent reaches the search deployment (Serve app ``rollout.search_app``) by handle.

    serve.run(rollout_app(cfg), name="rollout", route_prefix=None)
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

import ray
from ray import serve

from services.common.calls import require_version
from services.common.codec import decode, encode
from services.config import MempoConfig, actor_options, replica_config
from services.common.messages import PromptBatch, WeightUpdate
from services.common.paths import model_path
from services.serve_version import pinned

log = logging.getLogger("mempo.rollout")


@serve.deployment(name="rollout")
class RolloutService:
    def __init__(self, config: dict):
        # vLLM, torch and transformers are imported in the replica only: the driver imports this module to
        # build the application (registry.py) and would wait seconds for them.
        from transformers import AutoTokenizer

        from services.rollout.agent import AgentLoop
        from services.rollout.engine import PolicyEngine
        from services.rollout.search_client import SearchClient

        cfg = MempoConfig.model_validate(config)
        model_dir = model_path(cfg)
        self.engine = PolicyEngine(cfg, model_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        if cfg.search.url:  # an external Search-R1 server: no search deployment to reach
            search = SearchClient.from_url(cfg.search.url, cfg.search)
        else:
            search = SearchClient.from_handle(serve.get_deployment_handle("search", app_name=cfg.rollout.search_app),
                                              cfg.search)
        self.loop = AgentLoop(cfg, self.engine, tokenizer, search)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.model_dir = str(model_dir)
        self._restart_task = None
        self._restart_error: str | None = None

    async def rollout(self, payload: bytes) -> bytes:
        batch = decode(payload, PromptBatch)
        await self.engine.ensure_alive()  # a call retried after the engine died runs on a restarted one
        require_version(self.engine.version, batch.min_version, self.replica)  # a replacement not yet synced
        out = await self.loop.run(batch)
        out.replica = self.replica
        return encode(out)

    async def update_weights(self, payload: bytes, version: Optional[int] = None) -> dict:
        update = decode(payload, WeightUpdate)
        if version is not None and version != update.version:
            raise ValueError(f"version {version} does not match the WeightUpdate's version {update.version}")
        seconds = await self.engine.update_weights(update.tensors, update.version)
        return {"version": update.version, "seconds": seconds, "replica": self.replica}

    # collective publication (services/learner/collective.py): the engine joins the learner's group,
    # stages a whole broadcast, and takes it as the policy when the learner commits
    async def weight_group(self) -> Optional[str]:
        return await self.engine.weight_group()

    async def join_weight_group(self, host: str, port: int, world: int, group_id: str, timeout_s: float) -> int:
        return await self.engine.join_weight_group(host, port, world, group_id, timeout_s)

    async def receive_weights(self, group_id: str, version: int, plan: list, timeout_s: float) -> dict:
        out = await self.engine.receive_weights(group_id, version, plan, timeout_s)
        return {**out, "replica": self.replica}

    async def commit_weights(self, group_id: str, version: int) -> dict:
        if group_id != await self.engine.weight_group():
            raise RuntimeError(f"commit of weight group {group_id}: this replica is not in it")
        seconds = await self.engine.commit_weights(version)
        return {"version": version, "seconds": seconds, "replica": self.replica}

    async def pause_turns(self, max_s: float) -> str:
        """No new turn until resume_turns (or ``max_s``): the driver's pause while the learner updates
        (``train.pause_rollout``); turns already generating finish."""
        self.engine.pause_turns(max_s)
        return self.replica

    async def resume_turns(self) -> str:
        self.engine.resume_turns()
        return self.replica

    async def generate(self, prompt_ids: list[int], max_tokens: int = 32, temperature: float = 0.0,
                       seed: int = 0) -> dict:
        from vllm import SamplingParams  # imported where the engine starts (PolicyEngine.start)

        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed,
                                ignore_eos=True)
        out = await self.engine.generate(list(prompt_ids), params)
        return {"token_ids": out.token_ids, "logprobs": out.logprobs, "version": out.version}

    async def check_health(self) -> None:
        """Serve's periodic health check. A dead vLLM engine is restarted in place (in the background,
        so the check answers at once); only a replica whose restart itself failed is reported
        unhealthy, and Serve replaces it."""
        if self._restart_error is not None:
            raise RuntimeError(f"replica {self.replica} could not restart its vLLM engine: {self._restart_error}")
        if self.engine.engine.errored and (self._restart_task is None or self._restart_task.done()):
            self._restart_task = asyncio.ensure_future(self._restart())

    async def _restart(self) -> None:
        try:
            await self.engine.ensure_alive()
        except Exception as e:  # the next health check reports it
            self._restart_error = repr(e)

    def info(self) -> dict:
        return {"replica": self.replica, "version": self.engine.version, "model": self.model_dir,
                "node_id": ray.get_runtime_context().get_node_id(),
                "engine_pid": self.engine.pid, "turns_running": self.engine.running,
                "engine_busy_s": self.engine.busy_seconds,
                "engine_restarts": self.engine.restarts, "engine_restart_s": self.engine.last_restart_s}

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def deployment_options(cfg: MempoConfig) -> dict:
    r = cfg.rollout
    return {"num_replicas": r.replicas,
            "ray_actor_options": actor_options(r.num_cpus, r.num_gpus, r.resources),
            "max_ongoing_requests": max(8, 4 * r.max_concurrent_episodes),
            "graceful_shutdown_timeout_s": 5}


def rollout_app(cfg: MempoConfig):
    config = replica_config(cfg)
    return pinned(RolloutService.options(**deployment_options(cfg)), config, "rollout").bind(config)
