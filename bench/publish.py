"""Weight publication: seconds and GB/s of the object-store path and the collective path
(``learner.publish``; services/learner/publish.py, services/learner/collective.py), in one run.

Per model and rollout replica count (``--rollout-replicas``, default 1 and 2), that many rollout
replicas (vLLM) and one scorer replica are deployed on a local Ray cluster;
the publishing process is this one (the learner's Serve replica does the same after each step).
The policy published is the model's own weights moved by a seeded perturbation (so every
publication changes what the replicas serve). Each path publishes ``--repeats`` times, alternating
(object store, collective, object store, ...); the collective's first publication also builds the
group and is shown apart. GB/s = the state dict's bytes / seconds, per publication (every replica
receives it). After each collective round the rollout's greedy log-probs must equal the object-store
round's exactly (bit-identical weights).

    .venv/bin/python bench/publish.py [--models tiny smollm2-fp32 smollm2-bf16] [--rollout-replicas 1 2] [--repeats 3]

Models: tiny = the world's model after the tests' grammar SFT; smollm2-fp32 / smollm2-bf16 =
.cache/models/smollm2-135m-instruct-float32 / -bfloat16 (``make model``), with deploy/configs/smollm2.yaml.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {"smollm2-fp32": (".cache/models/smollm2-135m-instruct-float32", "float32"),
          "smollm2-bf16": (".cache/models/smollm2-135m-instruct-bfloat16", "bfloat16")}


def _policy(model_dir: Path, seed: int) -> dict:
    import torch

    from services.pipeline.apps import load_hf_state

    gen = torch.Generator().manual_seed(seed)
    return {k: (v + (0.01 * torch.randn(v.shape, generator=gen)).to(v.dtype)) if v.is_floating_point() else v
            for k, v in load_hf_state(str(model_dir)).items()}


def _logprobs(r_handle) -> list[float]:
    return r_handle.generate.remote([1, 5, 9, 14, 22, 40], 8, 0.0, 0).result()["logprobs"]


def bench_model(name: str, cfg, repeats: int) -> dict:
    name = f"{name} x{cfg.rollout.replicas}"
    from ray import serve

    from services.learner.collective import CollectivePublisher
    from services.learner.publish import ObjectStorePublisher
    from services.rollout.service import rollout_app
    from services.scorer.service import scorer_app
    from services.search_tool.service import search_app

    t0 = time.perf_counter()
    serve.run(search_app(cfg), name="search", route_prefix=None)
    r = serve.run(rollout_app(cfg), name="rollout", route_prefix=None)
    s = serve.run(scorer_app(cfg), name="scorer", route_prefix=None)
    print(f"[{name}] services up in {time.perf_counter() - t0:.0f}s", flush=True)
    store, coll = ObjectStorePublisher([r, s]), CollectivePublisher([r, s], "collective")
    times = {"object_store": [], "collective": [], "first_collective": None}
    nbytes = 0
    try:
        for i in range(repeats):
            state = _policy(Path(cfg.model.path), seed=i)
            nbytes = sum(v.numel() * v.element_size() for v in state.values())
            t = time.perf_counter()
            store.publish(state, 100 + 2 * i)
            times["object_store"].append(time.perf_counter() - t)
            ref = _logprobs(r)
            t = time.perf_counter()
            report = coll.publish(state, 101 + 2 * i)
            dt = time.perf_counter() - t
            assert report["path"] == "collective", report
            if report["group_rebuilt"]:
                times["first_collective"] = dt
            else:
                times["collective"].append(dt)
            assert _logprobs(r) == ref, "the collective's weights are not the object store's"
            print(f"[{name}] round {i}: object store {times['object_store'][-1]:.2f}s, collective {dt:.2f}s "
                  f"(send {report['send_s']:.2f}s, commit {report['commit_s']:.2f}s"
                  f"{', group built' if report['group_rebuilt'] else ''})", flush=True)
    finally:
        coll.close()
        for app in ("scorer", "rollout", "search"):
            serve.delete(app)
    return {"model": name, "replicas": cfg.rollout.replicas, "bytes": nbytes, **times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", *MODELS])
    ap.add_argument("--rollout-replicas", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import ray
    from ray import serve

    from services.config import load_config
    from services.common.local_ray import local_init_options
    from services.world.build import build_world
    from tests.rollout.grammar_model import grammar_model

    base = load_config("deploy/configs/tiny.yaml")
    world = build_world(base, progress=False)
    ray.init(**local_init_options(num_cpus=2, object_store_memory=1_500_000_000))
    serve.start(http_options={"host": "127.0.0.1", "port": 0})
    rows = []
    try:
        for name in args.models:
            for n in args.rollout_replicas:  # n rollout replicas + scorer + search fit in 2 CPUs
                fit = [f"rollout.replicas={n}", f"rollout.num_cpus={0.75 if n == 1 else 1.25 / n}",
                       "search.num_cpus=0.25", "scorer.num_cpus=0.25"]
                if name == "tiny":
                    cfg = load_config("deploy/configs/tiny.yaml",
                                      [f"model.path={grammar_model(world, Path('.cache/test-models'))}", *fit])
                else:
                    path, dtype = MODELS[name]
                    cfg = load_config("deploy/configs/smollm2.yaml", [f"model.path={path}", f"model.dtype={dtype}", *fit])
                rows.append(bench_model(name, cfg, args.repeats))
    finally:
        serve.shutdown()
        ray.shutdown()
    print("\n| model x rollout replicas (+ 1 scorer) | MB | object store s | GB/s | collective s | GB/s | "
          "collective / object store | first collective (group built) s |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        o, c = statistics.median(row["object_store"]), statistics.median(row["collective"] or [float("nan")])
        gb = row["bytes"] / 1e9
        print(f"| {row['model']} | {row['bytes'] / 1e6:.1f} | {o:.3f} | {gb / o:.2f} | {c:.3f} | {gb / c:.2f} | "
              f"{c / o:.2f}x | {row['first_collective']:.3f} |")


if __name__ == "__main__":
    main()
