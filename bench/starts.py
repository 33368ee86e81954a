"""RL's gain over its SFT start, at several SFT starts: does `make run`'s conclusion hold whatever start
a machine happens to give?

    .venv/bin/python bench/starts.py [--seeds 3] [--config deploy/configs/tiny.yaml] [--root runs/tiny-seeds] \
        [key=value ...]                                            # or: make starts SEEDS=3

Seed s (0 .. SEEDS-1) stands in for a machine: `make run`'s four commands (world, sft, train, eval
--report) run with ``train.seed=s`` (the SFT's shuffle and renaming, the RL prompt order) in
``<root>/s<s>/``. A seed whose eval.json is there already is kept as it is (a stopped bench goes on
with the same command). Then one table, printed and written to ``<root>/starts.md``: each start's SFT
EM per k, and RL - SFT per k and pooled over the held-out prompts, with the 95% paired-bootstrap CI,
and the minutes each start's four commands took when this bench ran them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.pipeline.report import episode_em  # noqa: E402
from services.pipeline.stats import paired_bootstrap_diff  # noqa: E402

MEMPO = str(Path(sys.executable).parent / "mempo")


def run_start(config: str, overrides: list[str], run_dir: Path, seed: int) -> float:
    """`make run` at one seed; returns its minutes (also kept in <run_dir>/start_minutes.json)."""
    args = [config, *overrides, f"train.run_dir={run_dir}", f"train.seed={seed}"]
    t0 = time.time()
    for cmd in (["world", "build"], ["sft"], ["train"], ["eval"]):
        extra = ["--report"] if cmd == ["eval"] else []
        print(f"[starts] seed {seed}: mempo {' '.join(cmd)}", flush=True)
        subprocess.run([MEMPO, *cmd, *args, *extra], cwd=ROOT, check=True)
    minutes = (time.time() - t0) / 60
    (run_dir / "start_minutes.json").write_text(json.dumps({"minutes": minutes}))
    return minutes


def start_row(run_dir: Path) -> dict:
    """SFT EM per k and RL - SFT per k and pooled (paired per prompt) from a run's episodes.jsonl."""
    em = episode_em(run_dir / "episodes.jsonl")
    keys = sorted(em["sft"])
    ks = sorted({k for k, _ in keys})
    row = {"sft": {k: sum(em["sft"][x] for x in keys if x[0] == k) / sum(1 for x in keys if x[0] == k) for k in ks}}
    for k in ks + ["all"]:
        chosen = [x for x in keys if k == "all" or x[0] == k]
        row[k] = paired_bootstrap_diff([em["sft"][x] for x in chosen], [em["rl"][x] for x in chosen])
    timing = run_dir / "start_minutes.json"
    row["minutes"] = json.loads(timing.read_text())["minutes"] if timing.is_file() else None
    return row


def table(rows: dict[int, dict]) -> str:
    ks = sorted(next(iter(rows.values()))["sft"])
    head = ("| seed | SFT EM " + " / ".join(f"k={k}" for k in ks) + " | "
            + " | ".join(f"RL - SFT k={k}" for k in ks) + " | RL - SFT pooled [95% CI] | minutes |")
    lines = [head, "|" + "---|" * (len(ks) + 4)]
    for seed, r in rows.items():
        cells = [" / ".join(f"{r['sft'][k]:.3f}" for k in ks)] + [f"{r[k][0]:+.3f}" for k in ks]
        d, lo, hi = r["all"]
        flag = "" if lo > 0 else " (CI not above 0)"
        lines.append(f"| {seed} | " + " | ".join(cells) + f" | {d:+.3f} [{lo:+.3f}, {hi:+.3f}]{flag} | "
                     + (f"{r['minutes']:.1f}" if r["minutes"] is not None else "n/a") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="SFT starts: train.seed 0 .. SEEDS-1 (default 3)")
    p.add_argument("--config", default="deploy/configs/tiny.yaml")
    p.add_argument("--root", default="runs/tiny-seeds", help="the starts' folders: <root>/s<seed>/")
    p.add_argument("overrides", nargs="*", help="key=value overrides for every start")
    a = p.parse_args(argv)
    root = Path(a.root)
    rows = {}
    for seed in range(a.seeds):
        run_dir = root / f"s{seed}"
        if not (run_dir / "eval.json").is_file():
            run_start(a.config, a.overrides, run_dir, seed)
        rows[seed] = start_row(run_dir)
    text = table(rows)
    (root / "starts.md").write_text(f"# RL - SFT at {a.seeds} SFT starts ({a.config})\n\n{text}\n")
    print(text, flush=True)
    return 0 if all(r["all"][1] > 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
