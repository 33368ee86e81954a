"""Search service throughput: queries/s for 1, 8 and 64 concurrent callers, over HTTP and over
Serve handles, with server-side batching on and off, in one run.

Two copies of the search deployment run side by side on a local Ray (same world index, one
replica each): one with ``search.batching=true`` at ``/b``, one with ``false`` at ``/p``. Each
caller sends single-query requests (first-hop questions of the world's test set, topk 3) back to
back for ``--seconds``; we count completed queries. Ratios batched/plain are printed per cell.

    .venv/bin/python bench/search.py [--seconds 4] [--config deploy/configs/tiny.yaml]
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

CONCURRENCY = (1, 8, 64)


def _queries(world: Path) -> list[str]:
    import pandas as pd

    from services.world.questions import questions_of
    from services.world.relations import RELATIONS

    out = []
    for row in pd.read_parquet(world / "test.parquet").to_dict("records"):
        hop = questions_of(row)[0].hops[0]
        out.append(RELATIONS[hop.relation].query.format(s=hop.subject))
    return out


async def _drive(call, queries: list[str], callers: int, seconds: float) -> float:
    done = 0
    stop = time.perf_counter() + seconds

    async def caller(i: int):
        nonlocal done
        j = i
        while time.perf_counter() < stop:
            await call(queries[j % len(queries)])
            done += 1
            j += callers

    t0 = time.perf_counter()
    await asyncio.gather(*[caller(i) for i in range(callers)])
    return done / (time.perf_counter() - t0)


async def _measure(handles: dict, url: str, queries: list[str], seconds: float) -> dict:
    import httpx

    results = {}
    limits = httpx.Limits(max_connections=128, max_keepalive_connections=128)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        for mode, prefix in (("batched", "/b"), ("plain", "/p")):
            handle = handles[mode]

            async def via_handle(q, h=handle):
                await h.search.remote([q], 3)

            async def via_http(q, p=prefix):
                r = await http.post(f"{url}{p}/retrieve", json={"queries": [q], "topk": 3, "return_scores": True})
                r.raise_for_status()

            for transport, call in (("handle", via_handle), ("http", via_http)):
                await _drive(call, queries, 8, 0.5)  # warm up
                for c in CONCURRENCY:
                    results[(transport, mode, c)] = await _drive(call, queries, c, seconds)
                    print(f"  {transport:6s} {mode:7s} callers={c:3d}: {results[(transport, mode, c)]:8.1f} queries/s", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    from services.common.config import load_config
    from services.common.local_ray import local_init_options
    from services.search_tool.service import search_app
    from services.world.build import build_world

    batched = load_config(args.config, ["search.batching=true", "search.num_cpus=0.5"])
    plain = load_config(args.config, ["search.batching=false", "search.num_cpus=0.5"])
    world = build_world(batched, progress=False)
    queries = _queries(world)
    ray.init(**local_init_options(num_cpus=os.cpu_count(), object_store_memory=300_000_000))
    port = 8123
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handles = {"batched": serve.run(search_app(batched), name="search_b", route_prefix="/b"),
               "plain": serve.run(search_app(plain), name="search_p", route_prefix="/p")}
    print(f"search bench: {len(queries)} distinct queries, {args.seconds}s per cell, {os.cpu_count()} CPUs, "
          f"batch <= {batched.search.max_batch_size} / wait {batched.search.batch_wait_timeout_s}s")
    res = asyncio.run(_measure(handles, f"http://127.0.0.1:{port}", queries, args.seconds))
    print("\nqueries/s            " + "".join(f"{c:>10d}" for c in CONCURRENCY) + "   (callers)")
    for transport in ("handle", "http"):
        for mode in ("batched", "plain"):
            print(f"{transport:6s} {mode:13s} " + "".join(f"{res[(transport, mode, c)]:10.1f}" for c in CONCURRENCY))
        print(f"{transport:6s} ratio b/p     " + "".join(
            f"{res[(transport, 'batched', c)] / res[(transport, 'plain', c)]:10.2f}" for c in CONCURRENCY))
    stats = handles["batched"].get_stats.remote().result()
    print(f"\nbatched replica: {stats['queries']} queries in {stats['index_passes']} index passes, largest batch {stats['max_batch']}")
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
