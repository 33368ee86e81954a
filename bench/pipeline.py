"""Synchronous versus bounded-staleness and over-sampled training: steps per hour, episodes trained per
second, each stage's busy and idle time, and held-out EM after the same steps, for ``train.max_staleness``
0, 1 and 2 and any ``train.over_sampling`` (a mode ``S:F`` = max_staleness S, over_sampling F; ``S:F:pause``
also sets ``train.pause_rollout``: no new turn while the learner updates).

Each setting is one ``mempo train`` run from the same SFT start (same seed, steps and prompts), in
its own process and Ray cluster, one after another. Figures come from the runs' metrics.jsonl:

* steps/hour: steps over the summed step wall times (the periodic evals left out); episodes/s: the
  episodes trained over the same time;
* busy share of a stage: its summed busy seconds over the summed step time. Rollout is the driver's
  wall time of the rollout calls, scoring the scorer's own compute, learner its update without
  publication, weight_sync the publication (services/pipeline/train.py, ``stage_times``). With
  overlap the shares add up to more than 1;
* engine idle: the share of the step time the rollout engines generated nothing (no turn running:
  waiting for searches, the learner, the slowest group), from each replica's own clock;
* EM: the last periodic eval (``eval.during_training_per_k`` held-out prompts per k, greedy).

    make sft                                     # or any run that wrote runs/tiny/sft/model
    .venv/bin/python bench/pipeline.py [--config deploy/configs/tiny.yaml] [--sft runs/tiny/sft/model]
        [--steps 20] [--modes 0 1 2 1:1.5 1:1.5:pause] [--out runs/bench-pipeline] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STAGES = ("rollout", "scoring", "learner", "weight_sync")


def summarise(run_dir: Path) -> dict:
    """Steps/hour, busy share per stage, lag and importance-weight figures, last eval EM of one run."""
    from services.pipeline.runlog import read_rows

    rows = read_rows(run_dir / "metrics.jsonl", "train")
    evals = read_rows(run_dir / "metrics.jsonl", "eval")
    if not rows:
        raise SystemExit(f"{run_dir}: no training rows (did the run fail? see its log)")
    wall = sum(r["step_s"] for r in rows)
    out = {"steps": len(rows), "wall_s": wall, "steps_per_hour": 3600.0 * len(rows) / wall,
           "episodes_per_s": sum(r["episodes"] for r in rows) / wall,
           "dropped_groups": sum(r.get("oversample/dropped_groups", 0.0) for r in rows),
           "em": evals[-1].get("em", float("nan")) if evals else float("nan"),
           "reward": sum(r["reward_mean"] for r in rows) / len(rows),
           "lag_token_mean": sum(r.get("version_lag_token_mean", 0.0) for r in rows) / len(rows),
           "is_weight_mean": sum(r.get("is_weight_mean", 1.0) for r in rows) / len(rows),
           "is_truncated": sum(r.get("is_truncated_share", 0.0) for r in rows) / len(rows)}
    for stage in STAGES:
        out[f"busy/{stage}"] = sum(r.get(f"time/{stage}_s", 0.0) for r in rows) / wall
    timed = [r for r in rows if "engine_busy_share" in r]  # the engines' own clock (rollout replicas' info)
    out["engine_idle"] = (1.0 - sum(r["engine_busy_share"] * r["step_s"] for r in timed) / sum(r["step_s"] for r in timed)
                          if timed else float("nan"))
    return out


def run(config: str, sft: str, steps: int, mode: str, out_dir: Path, overrides: list[str]) -> Path:
    staleness, over, pause = (mode.split(":") + ["1", ""])[:3]
    run_dir = out_dir / f"mode-{mode.replace(':', '-')}"
    if (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir} exists: remove it (or pick another --out) so the run starts from the SFT policy")
    args = [str(ROOT / ".venv/bin/mempo"), "train", config, f"train.run_dir={run_dir}", f"train.sft_dir={sft}",
            f"train.steps={steps}", f"train.max_staleness={staleness}", f"train.over_sampling={over or 1}",
            f"train.pause_rollout={'true' if pause == 'pause' else 'false'}",
            f"train.eval_every={steps}", *overrides]
    print(f"--- mode {mode}: {' '.join(args[1:])}", flush=True)
    t0 = time.perf_counter()
    with open(out_dir / f"{run_dir.name}.log", "w") as log:
        rc = subprocess.call(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ.copy())
    if rc != 0:
        raise SystemExit(f"mode {mode} failed (exit {rc}); see {out_dir / f'{run_dir.name}.log'}")
    print(f"    done in {time.perf_counter() - t0:.0f}s", flush=True)
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--sft", default="runs/tiny/sft/model", help="the SFT policy every run starts from")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["0", "1", "2"],
                    help="S, S:F or S:F:pause: train.max_staleness S, train.over_sampling F (default 1), "
                         "train.pause_rollout")
    ap.add_argument("--out", default="runs/bench-pipeline")
    ap.add_argument("--only-summarise", action="store_true", help="print the table of runs already in --out")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every run")
    a = ap.parse_args()
    out_dir = (ROOT / a.out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    if not a.only_summarise and not (ROOT / a.sft / "config.json").is_file():
        raise SystemExit(f"no SFT policy at {a.sft}: run `make run` (or `mempo sft {a.config}`) first")
    results = {}
    for m in a.modes:
        run_dir = out_dir / f"mode-{m.replace(':', '-')}" if a.only_summarise else run(
            a.config, str((ROOT / a.sft).resolve()), a.steps, m, out_dir, a.overrides)
        results[m] = summarise(run_dir)
    base = next(iter(results.values()))["episodes_per_s"]
    print(f"\n{'mode':>6} {'steps/h':>8} {'episodes/s':>10} {'vs first':>8} "
          + " ".join(f"{'busy ' + s:>16}" for s in STAGES)
          + f" {'engine idle':>11} {'lag/token':>9} {'IS mean':>7} {'trunc':>6} {'dropped':>7} {'reward':>6} {'EM':>6}")
    for m, r in results.items():
        print(f"{m:>6} {r['steps_per_hour']:8.0f} {r['episodes_per_s']:10.3f} {r['episodes_per_s'] / base:7.2f}x "
              + " ".join(f"{r[f'busy/{st}']:16.2f}" for st in STAGES)
              + f" {r['engine_idle']:11.2f} {r['lag_token_mean']:9.2f} {r['is_weight_mean']:7.3f} {r['is_truncated']:6.3f}"
              f" {r['dropped_groups']:7.0f} {r['reward']:6.3f} {r['em']:6.3f}")


if __name__ == "__main__":
    main()
