"""Search service throughput: queries/s for 1, 8 and 64 concurrent callers, over HTTP and over
Serve handles, with server-side batching on and off, in one run.

Two copies of the search deployment run side by side on a local Ray (same world index, one
replica each): one with ``search.batching=true`` at ``/b``, one with ``false`` at ``/p``. Each
caller sends single-query requests (first-hop questions of the world's test set, topk 3) back to
back for ``--seconds``; we count completed queries. Ratios batched/plain are printed per cell.

    .venv/bin/python bench/search.py [--seconds 4] [--config deploy/configs/tiny.yaml]

``--scale`` measures the dense backend on a generated corpus instead (default 1M passages), no Ray:
build time of each faiss index kind, resident memory of one replica (a fresh process that loads
the index and the corpus store and serves the queries, its RSS split into private memory and
file-backed pages shared through the page cache by the replicas of a node), queries/s at topk 3
(one query per call, and 64 per call as the service's batching merges them) and recall@3 against
the exact flat index, beside today's design (flat index read into memory, corpus as Python rows).

    .venv/bin/python bench/search.py --scale [--passages 1000000] [--dim 256] [--kinds 'flat;ivf;hnsw;ivfpq;IVF4096,SQ8']

The encoder is a stand-in, said in the output: a deterministic bag-of-words over a fixed random
word table (unknown words hashed into it), L2-normalised; encoding 1M passages with a real
encoder (e5-base) on 2 CPU cores would take hours. Its vectors cluster by topic as real embeddings
do (passages of one topic share words), so the index measurements mean something; the text of a
query is 4 words of a random passage.
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
    ap.add_argument("--scale", action="store_true", help="the dense backend on a generated corpus (no Ray)")
    ap.add_argument("--passages", type=int, default=1_000_000, help="--scale: corpus size")
    ap.add_argument("--dim", type=int, default=256, help="--scale: vector dimension of the stand-in encoder")
    ap.add_argument("--kinds", default="flat;ivf;hnsw;ivfpq;IVF4096,SQ8",
                    help="--scale: faiss index kinds to build (search.faiss_index values), ';'-separated")
    ap.add_argument("--nlist", type=int, default=0, help="--scale: IVF cells (search.nlist; 0 = about 4 sqrt(n))")
    ap.add_argument("--queries", type=int, default=1000, help="--scale: distinct queries")
    ap.add_argument("--dir", default="", help="--scale: working folder (default: a new one under /tmp, removed after)")
    ap.add_argument("--replica", default="", help=argparse.SUPPRESS)  # internal: one replica process
    args = ap.parse_args(argv)
    if args.replica:
        return _replica(args.replica)
    if args.scale:
        return _scale(args)

    import ray
    from ray import serve

    from services.config import load_config
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


# -- --scale: the dense backend on a generated corpus ----------------------------------------------------

STAND_IN = ("stand-in encoder: bag-of-words over a fixed random word table (unknown words hashed into it), "
            "L2-normalised; not a neural encoder (e5-base over 1M passages on 2 CPU cores would take hours)")
TOPICS = 2000  # the stand-in corpus's topics; the encoder's word table knows them by word id
_SYL = ["ka", "lo", "mi", "ne", "ru", "ta", "vi", "zo", "be", "du", "fa", "go", "hi", "ju", "pe", "sa", "to", "wu"]


def _vocab(size: int = 40_000) -> list[str]:
    words, n = [], len(_SYL)
    for i in range(size):  # distinct 3-4 syllable words, deterministic
        w, j = [], i + n * n
        while j:
            w.append(_SYL[j % n])
            j //= n
        words.append("".join(w))
    return words


class HashBowEncoder:
    """The stand-in encoder: the normalised sum of fixed random vectors of a text's words."""

    path = "stand-in:hash-bow"
    passage_prefix = query_prefix = ""

    def __init__(self, dim: int, seed: int = 0):
        import numpy as np

        self.dim, self.words = dim, _vocab()
        self.ids = {w: i for i, w in enumerate(self.words)}
        rng = np.random.default_rng(seed)
        # word w belongs to topic w % TOPICS and points near that topic's direction (real encoders place
        # related words near each other; without it no index could exploit any structure)
        topic = rng.standard_normal((TOPICS, dim), dtype=np.float32)
        table = topic[np.arange(len(self.words)) % TOPICS] + rng.standard_normal((len(self.words), dim), dtype=np.float32)
        self.table = np.concatenate([table, np.zeros((1, dim), np.float32)])  # the last row pads

    def _ids(self, text: str) -> list[int]:
        import zlib

        v = len(self.words)
        return [self.ids.get(w, zlib.crc32(w.encode()) % v) for w in text.lower().replace('"', " ").split()]

    def encode(self, texts: list[str], prefix: str = "", show_progress: bool = False):
        import numpy as np

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for s in range(0, len(texts), 8192):
            ids = [self._ids(t) for t in texts[s : s + 8192]]
            width = max((len(x) for x in ids), default=1) or 1
            pad = np.full((len(ids), width), len(self.words), dtype=np.int64)
            for i, x in enumerate(ids):
                pad[i, : len(x)] = x
            v = self.table[pad].sum(1)
            v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-9)
            out[s : s + len(ids)] = v
        return out

    def encode_queries(self, queries: list[str]):
        return self.encode(queries)


def _generate(path: Path, n: int, words: list[str], seed: int = 0) -> None:
    """n passages '"Title"\\ntext' of 16 words: 12 of the passage's topic's 20 words (word w is of topic
    w % 2000), 4 common ones (Zipf)."""
    import json

    import numpy as np

    rng = np.random.default_rng(seed)
    topics = np.arange(len(words)).reshape(-1, TOPICS).T  # (2000, 20): topic t's words
    with open(path, "w", encoding="utf-8") as f:
        for s in range(0, n, 100_000):
            m = min(n, s + 100_000) - s
            t = rng.integers(0, 2000, m)
            own = topics[t[:, None], rng.integers(0, topics.shape[1], (m, 12))]
            common = np.minimum(rng.zipf(1.3, (m, 4)), 2000) - 1
            body = np.concatenate([own, common], axis=1)
            for i in range(m):
                text = " ".join(words[w] for w in body[i])
                f.write(json.dumps({"id": str(s + i), "contents": f'"{words[own[i, 0]].title()} {s + i}"\n{text}'}) + "\n")


def _memory() -> dict:
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")):
            out[line.split(":")[0]] = int(line.split()[1]) / 1024  # MiB
    return out


def _replica(spec_path: str) -> int:
    """One replica: load the design, serve the queries, report memory, speed and the hits (a fresh process)."""
    import json

    import faiss
    import numpy as np

    from services.common.jsonl import read_jsonl
    from services.search_tool.dense_index import DenseIndex

    spec = json.loads(Path(spec_path).read_text())
    enc = HashBowEncoder(spec["dim"])
    queries = json.loads(Path(spec["queries"]).read_text())
    base = _memory()
    t0 = time.perf_counter()
    if spec["design"] == "in_memory":  # today's design: the flat index read in, the corpus as Python rows
        index = DenseIndex(faiss.read_index(str(Path(spec["dir"]) / "faiss.index")),
                           read_jsonl(Path(spec["dir"]) / "corpus.jsonl"), enc)
    else:
        index = DenseIndex.load(spec["dir"], enc, mmap=True, nprobe=spec["nprobe"], ef_search=spec["ef_search"],
                                refine_factor=spec["refine_factor"])
    load_s = time.perf_counter() - t0
    loaded = _memory()
    t0, ids = time.perf_counter(), []
    for s in range(0, len(queries), 64):  # 64 per call, as the service's batching merges them
        hits = index.search(queries[s : s + 64], 3)
        ids += [[int(r["id"]) for r, _ in h] for h in hits]
    batched = len(queries) / (time.perf_counter() - t0)
    t0, n = time.perf_counter(), 0
    while n < len(queries) and time.perf_counter() - t0 < spec["seconds"]:  # one query per call
        index.search([queries[n]], 3)
        n += 1
    single = n / (time.perf_counter() - t0)
    served = _memory()
    Path(spec["out"]).write_text(json.dumps({
        "load_s": load_s, "qps_batch64": batched, "qps_single": single, "ids": ids, "base": base,
        "loaded": loaded, "served": served, "threads": faiss.omp_get_max_threads()}))
    return 0


def _scale(args) -> int:
    import json
    import shutil
    import subprocess
    import tempfile

    import faiss
    import numpy as np

    from services.search_tool.corpus_store import CorpusStore
    from services.search_tool.dense_index import DenseIndex, factory_string

    kinds = [k for k in args.kinds.split(";") if k]
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mempo-search-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    from services.config import SearchConfig

    d = SearchConfig()
    params = {"nprobe": d.nprobe, "ef_search": d.ef_search, "refine_factor": d.refine_factor}
    print(f"search --scale: {args.passages:,} passages, dim {args.dim}, {os.cpu_count()} CPUs, faiss "
          f"{faiss.__version__} ({faiss.omp_get_max_threads()} threads), load average {os.getloadavg()[0]:.1f}")
    print(f"  {STAND_IN}")
    print(f"  query-time settings: search.nprobe={d.nprobe} search.ef_search={d.ef_search} "
          f"search.refine_factor={d.refine_factor}; work folder {work}")
    try:
        enc = HashBowEncoder(args.dim)
        corpus = work / "corpus.jsonl"
        t0 = time.perf_counter()
        if not corpus.is_file():
            _generate(corpus, args.passages, enc.words)
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        store = CorpusStore.open(corpus, work / "corpus.offsets.npy")
        offsets_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        vecs = np.zeros((len(store), args.dim), dtype=np.float32)
        for s in range(0, len(store), 50_000):
            vecs[s : s + 50_000] = enc.encode([r["contents"] for r in store[s : s + 50_000]])
        enc_s = time.perf_counter() - t0
        print(f"  corpus: {len(store):,} passages, {corpus.stat().st_size / 2**20:.0f} MiB JSONL, generated in "
              f"{gen_s:.1f}s; offsets {offsets_s:.1f}s; stand-in encoding {enc_s:.1f}s ({len(store) / enc_s:,.0f}/s)")
        rng = np.random.default_rng(1)
        queries = []
        for i in rng.integers(0, len(store), args.queries):
            words = store[int(i)]["contents"].split("\n", 1)[1].split()
            queries.append(" ".join(rng.choice(words, 4, replace=False)))
        (work / "queries.json").write_text(json.dumps(queries))
        qv = enc.encode(queries)
        build_s: dict[str, float] = {}
        print(f"\n  {'design':34s} {'build s':>8s} {'load s':>7s} {'private MiB':>12s} {'shared MiB':>11s} "
              f"{'total MiB':>10s} {'x today':>8s} {'q/s 1':>7s} {'q/s 64':>7s} {'recall@3':>9s}", flush=True)
        exact, base_total = None, None
        designs = [("flat", "in_memory")] + [(k, "mmap") for k in kinds]
        for kind, design in designs:  # build (once per kind), then one fresh replica process measures it
            out = work / kind
            if not (out / "faiss.index").is_file():
                out.mkdir(exist_ok=True)
                for name in ("corpus.jsonl", "corpus.offsets.npy"):
                    if not (out / name).exists():
                        os.link(work / name, out / name)  # one corpus file on disk
                rows = CorpusStore.open(out / "corpus.jsonl", out / "corpus.offsets.npy")
                t0 = time.perf_counter()
                index = DenseIndex.from_vectors(rows, vecs, kind=kind, nlist=args.nlist)
                build_s[kind] = time.perf_counter() - t0
                index.save(out)
                if kind == "flat":
                    _, exact = index.index.search(qv, 3)
                del index
            spec = {"design": design, "dir": str(out), "dim": args.dim, "queries": str(work / "queries.json"),
                    "seconds": 10.0, "out": str(work / f"{design}-{kind}.json"), **params}
            (work / "spec.json").write_text(json.dumps(spec))
            subprocess.run([sys.executable, __file__, "--replica", str(work / "spec.json")], check=True)
            r = json.loads(Path(spec["out"]).read_text())
            recall = float(np.mean([len(set(a) & set(e)) / 3 for a, e in zip(r["ids"], exact.tolist())]))
            anon = r["served"]["RssAnon"] - r["base"]["RssAnon"]
            file = r["served"]["RssFile"] - r["base"]["RssFile"]
            total = anon + file
            base_total = base_total or total
            label = ("flat in memory + rows (today)" if design == "in_memory" else
                     f"{factory_string(kind, len(store), args.dim, args.nlist)} mmap")
            size = (out / "faiss.index").stat().st_size / 2**20
            print(f"  {label:34s} {build_s.get(kind, float('nan')):8.1f} {r['load_s']:7.2f} {anon:12.0f} {file:11.0f} "
                  f"{total:10.0f} {total / base_total:8.2f} {r['qps_single']:7.1f} {r['qps_batch64']:7.1f} "
                  f"{recall:9.3f}   (index file {size:.0f} MiB)", flush=True)
        print("\n  private = RssAnon, shared = RssFile (pages of the memory-mapped index and corpus, one copy in the "
              "node's page cache for all its replicas), both after loading and serving all queries, less the "
              "process's memory before loading; 'x today' = total / today's total (one replica, nothing shared). "
              f"Replica processes import faiss and numpy only (no torch, no encoder weights: {STAND_IN.split(':')[0]}).")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
