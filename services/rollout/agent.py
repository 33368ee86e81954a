"""The MemPO agent loop: multi-turn episodes on one policy engine, all in token ids.

For each prompt, ``n`` episodes (one GRPO group); all episodes of a call run concurrently on the
replica's engine, so vLLM batches turns from different episodes and a slow search only delays
its own episode. One turn:

    context  = prompt_ids + the last ``memory_window`` turns' (response + observation) ids
               (memory_window=1 is MemPO: the previous turn only; "full" = the whole history)
    response = engine.generate(context)               -> ids + sampled log-probs + version
    parse    = parse_turn(text of those ids)          -> action, <mem> span, problems
    obs      = search result / invalid-action note, wrapped by rollout.observation_template
               (tokenised environment text; model output is never re-tokenised)

The episode keeps ``prompt_ids`` (the reference's ``mem_sys_prompt_ids``) and ``full_ids``
(prompt + every response + observation); a turn's full context is ``full_ids[:full_prefix_len]``
and its mem context is ``prompt_ids + response_ids[mem_start:mem_end]``.
"""

from __future__ import annotations

import asyncio
import time
import zlib

import numpy as np

from services.config import MempoConfig
from services.common.messages import Episode, Prompt, PromptBatch, RolloutGroup, TrajectoryBatch
from services.common.turn_format import render_information
from services.rollout.engine import PolicyEngine
from services.rollout.records import EpisodeBuilder
from services.rollout.search_client import SearchClient


def turn_seed(batch_seed: int, prompt_uid: str, sample: int, turn: int) -> int:
    """The sampling seed of one turn: fixed by the batch's seed, the prompt, the sample and the turn,
    so a rerun (or a replay, bench/rollout.py) draws the same tokens whatever else is in the batch."""
    return zlib.crc32(f"{batch_seed}/{prompt_uid}/{sample}/{turn}".encode()) & 0x7FFFFFFF


class AgentLoop:
    def __init__(self, cfg: MempoConfig, engine: PolicyEngine, tokenizer, search: SearchClient):
        self.cfg = cfg
        self.rc = cfg.rollout
        self.engine = engine
        self.tokenizer = tokenizer
        self.search = search
        self.records = EpisodeBuilder(cfg, tokenizer)
        self.slots = asyncio.Semaphore(self.rc.max_concurrent_episodes)

    def sampling(self, max_tokens: int, seed: int, temperature: float = -1.0):
        # vLLM is first imported where an engine starts (PolicyEngine.start, after its thread settings)
        from vllm import SamplingParams

        temperature = self.rc.temperature if temperature < 0 else temperature
        return SamplingParams(temperature=temperature, top_p=self.rc.top_p, max_tokens=max_tokens,
                              stop=list(self.rc.stop), include_stop_str_in_output=True, logprobs=0, seed=seed)

    # -- one episode ------------------------------------------------------------------------

    async def episode(self, prompt: Prompt, sample: int, seed: int, temperature: float = -1.0,
                      search: bool = True) -> tuple[Episode, dict]:
        async with self.slots:
            return await self._episode(prompt, sample, seed, temperature, search)

    async def _observe(self, query: str, search: bool) -> tuple[str, bool]:
        """The observation of a search call; with ``search`` off, an empty <information> block."""
        if not search:
            return render_information(""), True
        return await self.search.observation(query, self.cfg.search.topk)

    async def _episode(self, prompt: Prompt, sample: int, seed: int, temperature: float,
                       search: bool) -> tuple[Episode, dict]:
        rb = self.records
        prompt_ids = rb.prompt_ids(prompt)
        full_ids = list(prompt_ids)
        pieces: list[list[int]] = []
        ep = Episode(uid=f"{prompt.uid}/{sample}", sample=sample, prompt_ids=np.asarray(prompt_ids, np.int32),
                     full_ids=np.zeros(0, np.int32))
        stats = {"engine_s": 0.0, "tool_s": 0.0, "generated": 0}
        finish = "max_turns"
        for t in range(1, self.rc.max_turns + 1):
            ctx = rb.context(prompt_ids, pieces)
            budget = min(self.rc.max_response_tokens, self.cfg.engine.max_model_len - len(ctx))
            if len(ctx) >= self.rc.max_context_tokens or budget <= 0:
                finish = "max_context"
                break
            out = await self.engine.generate(ctx, self.sampling(budget, turn_seed(seed, prompt.uid, sample, t), temperature))
            stats["engine_s"] += out.engine_s
            stats["generated"] += len(out.token_ids)
            rec, parsed = rb.record(t, ctx, out.token_ids, out.logprobs, out.version, out.finish_reason, len(full_ids))
            ep.peak_tokens = max(ep.peak_tokens, len(ctx) + len(out.token_ids))
            ep.total_tokens += len(ctx) + len(out.token_ids)
            obs: list[int] = []
            if parsed.action == "answer":
                ep.answer = rec.action_text
                finish = "answer"
            elif parsed.action == "search":
                t0 = time.perf_counter()
                observation, ok = await self._observe(parsed.argument, search)
                stats["tool_s"] += time.perf_counter() - t0
                ep.tool_calls += 1
                ep.tool_failures += 0 if ok else 1
                obs = rb.observation_ids(observation, out.token_ids)
            elif self.rc.invalid_action == "stop":
                finish = "invalid_action"
            else:
                obs = rb.observation_ids(self.rc.invalid_action_message, out.token_ids)
            rec.observation_ids = np.asarray(obs, np.int32)
            ep.turns.append(rec)
            full_ids += out.token_ids + obs
            pieces.append(out.token_ids + obs)
            if finish in ("answer", "invalid_action"):
                break
        ep.finish_reason = finish
        ep.full_ids = np.asarray(full_ids, np.int32)
        return ep, stats

    # -- a whole call -----------------------------------------------------------------------

    async def run(self, batch: PromptBatch) -> TrajectoryBatch:
        t0, version = time.perf_counter(), self.engine.version
        jobs = [self.episode(p, s, batch.seed, batch.temperature, batch.search)
                for p in batch.prompts for s in range(batch.n)]
        results = await asyncio.gather(*jobs)
        groups = []
        for i, p in enumerate(batch.prompts):
            groups.append(RolloutGroup(prompt=p, episodes=[ep for ep, _ in results[i * batch.n:(i + 1) * batch.n]]))
        eps = [ep for ep, _ in results]
        n = max(1, len(eps))
        metrics = {
            "episodes": float(len(eps)),
            "turns_mean": sum(len(e.turns) for e in eps) / n,
            "generated_tokens": float(sum(s["generated"] for _, s in results)),
            "tool_calls": float(sum(e.tool_calls for e in eps)),
            "tool_failures": float(sum(e.tool_failures for e in eps)),
            "peak_tokens_mean": sum(e.peak_tokens for e in eps) / n,
            "peak_tokens_max": float(max((e.peak_tokens for e in eps), default=0)),
            "total_tokens_mean": sum(e.total_tokens for e in eps) / n,
            "answered_share": sum(e.answer is not None for e in eps) / n,
            "format_ok_share": sum(all(t.format_ok for t in e.turns) for e in eps) / n,
            "engine_s": sum(s["engine_s"] for _, s in results),
            "tool_s": sum(s["tool_s"] for _, s in results),
            "wall_s": time.perf_counter() - t0,
        }
        return TrajectoryBatch(groups=groups, policy_version=version, step=batch.step, metrics=metrics)
