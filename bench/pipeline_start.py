"""A pipeline's start and shutdown: the services deployed one after another against side by side.

``Pipeline.start`` submits every service's Serve application in one call (services/pipeline/
start_errors.py ``deploy_all``) and ``Pipeline.shutdown`` deletes them together (``delete_all``). This
bench times that against the one-by-one order (each ``serve.run`` waiting for its application before the
next, each ``serve.delete`` waiting for its replicas to stop), alternating the two ``--repeats`` times on
one local Ray cluster, and prints the seconds of each and their ratio.

    .venv/bin/python bench/pipeline_start.py [--config deploy/configs/tiny.yaml] [--repeats 3] [key=value ...]

The default overrides are those of the tests' pipelines (a W=2 learner, small CPU shares).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULTS = ["learner.world_size=2", "rollout.num_cpus=0.2", "search.num_cpus=0.05", "scorer.num_cpus=0.1",
            "learner.num_cpus_per_worker=0.1"]


def one_by_one(cfg) -> tuple[float, float]:
    from ray import serve

    from services.pipeline import apps
    from services.pipeline.plan import deployed
    from services.pipeline.registry import SERVICES, app_name, application, route_prefix, wired
    from services.pipeline.start_errors import deploy

    cfg = wired(apps.prepare_world(cfg))
    apps.connect(cfg)
    t0, names = time.perf_counter(), []
    for name in deployed(cfg, tuple(SERVICES)):
        deploy(application(cfg, name), app_name(cfg, name), route_prefix(cfg, name), name)
        names.append(app_name(cfg, name))
    t1 = time.perf_counter()
    for name in reversed(names):
        serve.delete(name)
    return t1 - t0, time.perf_counter() - t1


def side_by_side(cfg) -> tuple[float, float]:
    from services.pipeline.apps import Pipeline

    t0 = time.perf_counter()
    pipe = Pipeline.start(cfg)
    t1 = time.perf_counter()
    pipe.shutdown()
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*", help="key=value config overrides (after the defaults)")
    args = ap.parse_args()
    from services.config import load_config

    cfg = load_config(args.config, [f"train.run_dir={tempfile.mkdtemp(prefix='bench-start-')}", *DEFAULTS,
                                    *args.overrides])
    times: dict[str, list[tuple[float, float]]] = {"one_by_one": [], "side_by_side": []}
    for i in range(args.repeats):
        for fn in (one_by_one, side_by_side):
            start, stop = fn(cfg)
            times[fn.__name__].append((start, stop))
            print(f"round {i + 1}: {fn.__name__:12s} start {start:6.1f} s  shutdown {stop:5.1f} s", flush=True)
    mean = {k: (statistics.mean(s for s, _ in v), statistics.mean(d for _, d in v)) for k, v in times.items()}
    print("\n| order | start s | shutdown s |\n|---|---|---|")
    for k, (s, d) in mean.items():
        print(f"| {k} | {s:.1f} | {d:.1f} |")
    print(f"side by side / one by one: start {mean['side_by_side'][0] / mean['one_by_one'][0]:.2f}x, "
          f"shutdown {mean['side_by_side'][1] / mean['one_by_one'][1]:.2f}x")


if __name__ == "__main__":
    main()
