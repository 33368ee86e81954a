"""Rollout throughput: generated tokens/s of the full MemPO agent loop (real searches through the
search deployment) versus raw engine generation of the same number of tokens, in one run.

Both use the same in-process vLLM AsyncLLM engine. The agent loop runs ``--prompts`` x ``--n``
episodes concurrently (multi-turn, memory contexts, stop strings, searches over a Serve handle);
then the engine generates the same total number of tokens as one request per episode with
``ignore_eos`` (one long turn each, no tools). Ratio = agent tokens/s / raw tokens/s (target >= 0.8).

The policy is the tiny world model after a short grammar SFT (tests/rollout/grammar_model.py,
cached), so episodes really search and answer. The engine runs at the Ray workers' niceness, as the
rollout replica's does in the pipeline (at a higher priority it would starve the search replica).
It also prints the engine's batch occupancy and the longest episode's sequential tokens.

    .venv/bin/python bench/rollout.py [--prompts 16] [--n 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


async def _bench(loop, engine, batch) -> dict:
    # warm-up: one short episode and one short raw request
    from dataclasses import replace

    from vllm import SamplingParams

    await loop.run(replace(batch, prompts=batch.prompts[:1], n=1))
    busy: list[int] = []  # turns in the engine (running or queued), sampled every 20 ms while the agent loop runs

    async def sample_busy():
        while True:
            busy.append(engine.running)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample_busy())
    t0 = time.perf_counter()
    out = await loop.run(batch)
    agent_s = time.perf_counter() - t0
    sampler.cancel()
    generated = int(out.metrics["generated_tokens"])
    episodes = [e for g in out.groups for e in g.episodes]
    per = max(1, generated // len(episodes))
    params = SamplingParams(temperature=1.0, max_tokens=per, ignore_eos=True, logprobs=0, seed=0)
    prompts = [e.prompt_ids.tolist() for e in episodes]
    t0 = time.perf_counter()
    raw = await asyncio.gather(*[engine.generate(p, params) for p in prompts])
    raw_s = time.perf_counter() - t0
    raw_tokens = sum(len(r.token_ids) for r in raw)
    # replay: every turn's exact context and response length, all at once (no turn dependencies,
    # no searches): the engine work of the agent loop without the loop
    turns = [(t.context_ids.tolist(), len(t.response_ids)) for e in episodes for t in e.turns if len(t.response_ids)]
    t0 = time.perf_counter()
    replay = await asyncio.gather(*[engine.generate(c, SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True,
                                                                      logprobs=0, seed=0)) for c, n in turns])
    replay_s = time.perf_counter() - t0
    return {"agent_tokens": generated, "agent_s": agent_s, "raw_tokens": raw_tokens, "raw_s": raw_s,
            "replay_tokens": sum(len(r.token_ids) for r in replay), "replay_s": replay_s,
            "episodes": len(episodes), "metrics": out.metrics, "busy": busy,
            "longest": max((sum(len(t.response_ids) for t in e.turns), len(e.turns)) for e in episodes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from services.common.config import load_config
    from services.common.data import load_prompts
    from services.common.local_ray import local_init_options
    from services.common.messages import PromptBatch
    from services.rollout.agent import AgentLoop
    from services.rollout.engine import PolicyEngine
    from services.search_tool.client import SearchClient
    from services.search_tool.service import search_app
    from services.world.build import build_world
    from tests.rollout.grammar_model import grammar_model

    base = load_config(args.config)
    world = build_world(base, progress=False)
    model = grammar_model(world, Path(".cache/test-models"))
    cfg = load_config(args.config, [f"model.path={model}", "search.num_cpus=0.25", *args.overrides])
    ray.init(**local_init_options(num_cpus=os.cpu_count(), object_store_memory=300_000_000))
    serve.start(http_options={"host": "127.0.0.1", "port": 8125})
    search = SearchClient.from_handle(serve.run(search_app(cfg), name="search", route_prefix="/"), cfg.search)
    # In the pipeline the engine runs in the rollout replica, a Ray worker like the search replica, at
    # Ray's worker niceness. Here it runs in this process: at a higher priority (nice 0 against 15)
    # its busy engine core starved the search replica (tool waits 4x the pipeline's), so take the
    # workers' niceness first (the engine core process inherits it).
    worker_nice = ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote())
    if worker_nice > os.nice(0):
        os.nice(worker_nice - os.nice(0))

    async def run():
        engine = PolicyEngine(cfg, model)
        loop = AgentLoop(cfg, engine, AutoTokenizer.from_pretrained(model), search)
        prompts = load_prompts(world / "test.parquet", limit=args.prompts)
        res = await _bench(loop, engine, PromptBatch(prompts=prompts, n=args.n, policy_version=0, seed=1))
        engine.shutdown()
        return res

    r = asyncio.run(run())
    m = r["metrics"]
    agent_tps, raw_tps = r["agent_tokens"] / r["agent_s"], r["raw_tokens"] / r["raw_s"]
    print(f"\nrollout bench: {r['episodes']} episodes ({args.prompts} prompts x n={args.n}), {os.cpu_count()} CPUs, "
          f"engine at nice {os.nice(0)}")
    print(f"  agent loop : {r['agent_tokens']:6d} tokens in {r['agent_s']:6.2f}s = {agent_tps:7.1f} tok/s "
          f"(turns/episode {m['turns_mean']:.2f}, searches {int(m['tool_calls'])}, answered {m['answered_share']:.0%}, "
          f"tool wait {m['tool_s']:.2f}s summed over episodes)")
    print(f"  raw engine : {r['raw_tokens']:6d} tokens in {r['raw_s']:6.2f}s = {raw_tps:7.1f} tok/s")
    replay_tps = r["replay_tokens"] / r["replay_s"]
    print(f"  replay     : {r['replay_tokens']:6d} tokens in {r['replay_s']:6.2f}s = {replay_tps:7.1f} tok/s "
          f"(every turn's context and length at once: the loop's engine work without the loop)")
    print(f"  context tokens prefilled by the agent's turns: {m['total_tokens_mean'] * r['episodes'] - r['agent_tokens']:.0f} "
          f"(raw: {r['episodes']} prompts)")
    longest, turns = r["longest"]
    print(f"  turn dependencies: the longest episode generated {longest} tokens in {turns} turns "
          f"one after another (the raw engine's requests: {r['raw_tokens'] // r['episodes']} tokens each)")
    busy, seqs = r["busy"], cfg.engine.max_num_seqs
    print(f"  agent loop's engine batch: {sum(busy) / max(1, len(busy)):.1f} turns in it (running or queued) on average "
          f"(max_num_seqs {seqs}, max_concurrent_episodes {cfg.rollout.max_concurrent_episodes}); "
          f"full {sum(b >= seqs for b in busy) / max(1, len(busy)):.0%} of the time, "
          f"under half {sum(b < seqs / 2 for b in busy) / max(1, len(busy)):.0%}")
    print(f"  ratio agent/raw = {agent_tps / raw_tps:.2f}  (target >= 0.8)   agent/replay = {agent_tps / replay_tps:.2f}")
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
