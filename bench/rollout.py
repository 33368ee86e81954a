"""Rollout throughput: generated tokens/s of the full MemPO agent loop (real searches through the
search deployment) versus raw engine generation of the same number of tokens, in one run.

Both use the same in-process vLLM AsyncLLM engine. The agent loop runs ``--prompts`` x ``--n``
episodes concurrently (multi-turn, memory contexts, stop strings, searches over a Serve handle);
then the engine generates the same total number of tokens as one request per episode with
``ignore_eos`` (one long turn each, no tools). Ratio = agent tokens/s / raw tokens/s (target >= 0.8).

Between the two, three measurements split the gap into its causes (each ratio prints with them):
``matched`` (one request per episode of that episode's own length: the skew of episode lengths),
``chained`` (each episode's turns replayed in order with their exact contexts, no searches: turn
boundaries and memory-context prefills) and the agent loop itself (searches, parsing, its Python).
``chained/raw`` is thus the most agent/raw could reach with a loop that cost nothing (no searches,
no parsing, no Python between turns) on the turns the episodes generate. ``replay`` (every turn at
once) and ``two calls`` (two agent-loop calls in flight sharing the episode slots) are printed beside
them. Every measurement starts from an empty prefix cache, so no
replay reads the KV blocks the agent loop left; each runs ``--rounds`` times and medians are printed,
with the CPU seconds of the engine core, this process (loop + vLLM front end) and the search replica.

The policy is the tiny world model after a short grammar SFT (tests/rollout/grammar_model.py,
cached), so episodes really search and answer. The engine runs at the Ray workers' niceness, as the
rollout replica's does in the pipeline (at a higher priority it would starve the search replica).
It also prints the engine's batch occupancy and the longest episode's sequential tokens.

    .venv/bin/python bench/rollout.py [--prompts 16] [--n 4] [--rounds 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (the agent loop and vLLM's front end), vLLM's engine core
    and worker processes, the search replica and every other Ray process: where the cores go."""
    import psutil

    me = psutil.Process()
    out = {"front end + loop": sum(me.cpu_times()[:2]), "engine core": 0.0, "search replica": 0.0, "other Ray": 0.0}
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if proc.pid == me.pid:
                continue
            label = f"{proc.info['name'] or ''} {' '.join(proc.info['cmdline'] or [])}"
            if "VLLM::" in label:  # the engine core and its worker (children of this process)
                key = "engine core"
            elif "ServeReplica" in label and "search" in label:
                key = "search replica"
            elif "ray" in label.lower():  # GCS, raylet, Serve controller and proxy, idle workers
                key = "other Ray"
            else:
                continue
            out[key] += sum(proc.cpu_times()[:2])
        except psutil.Error:
            pass
    return out


def _cpu_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _params(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, logprobs=0, seed=0)


async def _timed(engine, work) -> tuple[float, dict, object]:
    """Run ``work()`` from an empty prefix cache (each measurement prefills its own contexts):
    (seconds, CPU seconds per process, result)."""
    await engine.engine.reset_prefix_cache()
    t0, c0 = time.perf_counter(), _cpu_seconds()
    out = await work()
    return time.perf_counter() - t0, _cpu_delta(c0, _cpu_seconds()), out


async def _round(loop, engine, batch) -> dict:
    """One round of every measurement; returns {name: (tokens, seconds)} and the diagnostics."""
    from dataclasses import replace

    busy: list[int] = []  # turns in the engine (running or queued), sampled every 20 ms while the agent loop runs

    async def sample_busy():
        while True:
            busy.append(engine.running)
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample_busy())
    agent_s, agent_cpu, out = await _timed(engine, lambda: loop.run(batch))
    sampler.cancel()
    generated = int(out.metrics["generated_tokens"])
    episodes = [e for g in out.groups for e in g.episodes]
    prompts = [e.prompt_ids.tolist() for e in episodes]
    lengths = [sum(len(t.response_ids) for t in e.turns) for e in episodes]
    turns = [(t.context_ids.tolist(), len(t.response_ids)) for e in episodes for t in e.turns if len(t.response_ids)]
    gen = lambda reqs: asyncio.gather(*[engine.generate(c, _params(n)) for c, n in reqs])  # noqa: E731
    count = lambda outs: sum(len(o.token_ids) for o in outs)  # noqa: E731
    res = {"agent": (generated, agent_s)}
    # raw: one request per episode, every one generating the mean episode's token count
    raw_s, _, raw = await _timed(engine, lambda: gen([(p, max(1, generated // len(episodes))) for p in prompts]))
    res["raw"] = (count(raw), raw_s)
    # matched: one request per episode of that episode's own token count (the length skew kept)
    s_, _, m = await _timed(engine, lambda: gen([(p, max(1, n)) for p, n in zip(prompts, lengths)]))
    res["matched"] = (count(m), s_)
    # replay: every turn's exact context and length at once (no turn dependencies, no searches)
    s_, _, rp = await _timed(engine, lambda: gen(turns))
    res["replay"] = (count(rp), s_)
    # chained: each episode's turns in order (exact contexts and lengths), as many episodes at once as
    # the loop runs: the turn dependencies and memory-context prefills without searches or parsing
    from services.rollout.agent import turn_seed

    slots = asyncio.Semaphore(loop.rc.max_concurrent_episodes)

    async def chain(e, params):
        """Replay one episode's turns in order, params(episode, turn number, turn) sampling each; tokens generated."""
        async with slots:
            n = 0
            for t, turn in enumerate(e.turns, 1):
                if len(turn.response_ids):
                    n += len((await engine.generate(turn.context_ids.tolist(), params(e, t, turn))).token_ids)
            return n

    exact = lambda e, t, turn: _params(len(turn.response_ids))  # noqa: E731

    def sampled(e, t, turn):  # the loop's temperature, stop strings and per-turn seed: turns end where they ended
        budget = min(loop.rc.max_response_tokens, loop.cfg.engine.max_model_len - len(turn.context_ids))
        return loop.sampling(budget, turn_seed(batch.seed, e.uid.rsplit("/", 1)[0], e.sample, t), batch.temperature)

    chained_s, chained_cpu, _ = await _timed(engine, lambda: asyncio.gather(*[chain(e, exact) for e in episodes]))
    res["chained"] = (sum(lengths), chained_s)
    # the same with the loop's own sampling: what the loop's sampling costs the engine
    s_, sampled_cpu, ns = await _timed(engine, lambda: asyncio.gather(*[chain(e, sampled) for e in episodes]))
    res["chained, loop sampling"] = (sum(ns), s_)
    # two calls in flight on one loop (its episode slots shared): the second call's episodes take the
    # slots the first call's stragglers leave, as consecutive steps' rollouts could overlap
    s_, _, pair = await _timed(engine, lambda: asyncio.gather(
        *[loop.run(replace(batch, seed=batch.seed + 100 + i)) for i in range(2)]))
    pair_tokens = sum(int(o.metrics["generated_tokens"]) for o in pair)
    res["two calls"] = (pair_tokens, s_)
    s_, _, raw2 = await _timed(engine, lambda: gen([(p, max(1, pair_tokens // (2 * len(prompts)))) for p in prompts * 2]))
    res["raw, 2x"] = (count(raw2), s_)
    return {"tokens_s": res, "cpu": {"agent": agent_cpu, "chained": chained_cpu, "chained, loop sampling": sampled_cpu}, "busy": busy,
            "episodes": len(episodes), "metrics": out.metrics,
            "longest": max((n, len(e.turns)) for n, e in zip(lengths, episodes))}


# measurement -> what it is, printed beside its speed
WHAT = {
    "agent": "the MemPO agent loop (multi-turn, memory contexts, searches through Serve)",
    "raw": "one request per episode, each the mean episode's token count",
    "matched": "one request per episode, each that episode's own token count",
    "replay": "every turn's exact context and length at once",
    "chained": "each episode's turns in order, exact contexts and lengths, no searches",
    "chained, loop sampling": "the same with the loop's temperature, stop strings and seeds",
    "two calls": "two agent-loop calls in flight on one loop",
    "raw, 2x": "raw for the two calls' tokens",
}
# ratio -> (numerator, denominator, what the step between them costs)
RATIOS = {
    "agent/raw": ("agent", "raw", "the issue's ratio (target >= 0.8)"),
    "agent/chained": ("agent", "chained", "searches, parsing and the loop's own work"),
    "chained/matched": ("chained", "matched", "turn boundaries and memory-context prefills"),
    "matched/raw": ("matched", "raw", "the skew of episode lengths (stragglers)"),
    "chained/raw": ("chained", "raw", "the ceiling of agent/raw for any loop: these turns' engine work alone"),
    "agent/replay": ("agent", "replay", "everything the loop adds to its turns' engine work"),
    "two calls/raw, 2x": ("two calls", "raw, 2x", "the straggler tail filled by a second call"),
}


async def _bench(loop, engine, batch, rounds: int) -> dict:
    from dataclasses import replace

    await loop.run(replace(batch, prompts=batch.prompts[:1], n=1))  # warm-up: one short episode
    return {"rounds": [await _round(loop, engine, batch) for _ in range(rounds)]}


def _report(r: dict, cfg, args) -> None:
    rounds = r["rounds"]
    tps = {k: [x["tokens_s"][k][0] / x["tokens_s"][k][1] for x in rounds] for k in WHAT}
    first = rounds[0]
    m = first["metrics"]
    print(f"\nrollout bench: {first['episodes']} episodes ({args.prompts} prompts x n={args.n}), {os.cpu_count()} CPUs, "
          f"engine at nice {os.nice(0)}, {len(rounds)} rounds (medians; every measurement from an empty prefix cache)")
    print(f"  episodes: {m['turns_mean']:.2f} turns, {int(m['tool_calls'])} searches, answered {m['answered_share']:.0%}, "
          f"tool wait {m['tool_s']:.2f}s summed over episodes (first round)")
    for k, what in WHAT.items():
        print(f"  {k:22s}: {first['tokens_s'][k][0]:6d} tokens, {statistics.median(tps[k]):7.1f} tok/s "
              f"(rounds: {' / '.join(f'{v:.0f}' for v in tps[k])})  {what}")
    print(f"  prefilled context tokens across the agent's turns: {m['total_tokens_mean'] * first['episodes'] - first['tokens_s']['agent'][0]:.0f} "
          f"(raw: {first['episodes']} prompts)")
    longest, turns = first["longest"]
    print(f"  the longest episode generated {longest} tokens in {turns} turns one after another "
          f"(raw requests: {first['tokens_s']['raw'][0] // first['episodes']} tokens each)")
    busy, seqs = [b for x in rounds for b in x["busy"]], cfg.engine.max_num_seqs
    print(f"  agent loop's engine batch: {sum(busy) / max(1, len(busy)):.1f} turns in it (running or queued) on average "
          f"(max_num_seqs {seqs}, max_concurrent_episodes {cfg.rollout.max_concurrent_episodes}); "
          f"full {sum(b >= seqs for b in busy) / max(1, len(busy)):.0%} of the time, "
          f"under half {sum(b < seqs / 2 for b in busy) / max(1, len(busy)):.0%}")
    for k in first["cpu"]:
        cpu = {name: statistics.median(x["cpu"][k][name] for x in rounds) for name in first["cpu"][k]}
        print(f"  CPU seconds during {k:7s}: " + ", ".join(f"{name} {v:.2f}" for name, v in cpu.items()))
    for name, (a, b, what) in RATIOS.items():
        per = [x / y for x, y in zip(tps[a], tps[b])]
        print(f"  {name:18s} = {statistics.median(per):.2f}  (rounds: {' / '.join(f'{v:.2f}' for v in per)})  {what}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every measurement (medians are printed)")
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)

    import ray
    from ray import serve
    from transformers import AutoTokenizer

    from services.config import load_config
    from services.common.data import load_prompts
    from services.common.local_ray import local_init_options
    from services.common.messages import PromptBatch
    from services.rollout.agent import AgentLoop
    from services.rollout.engine import PolicyEngine
    from services.rollout.search_client import SearchClient
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
        prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, limit=args.prompts)
        res = await _bench(loop, engine, PromptBatch(prompts=prompts, n=args.n, policy_version=0, seed=1), args.rounds)
        engine.shutdown()
        return res

    _report(asyncio.run(run()), cfg, args)
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
