"""A run's metrics: one JSONL row per event, TensorBoard scalars, and a short console line.

    log = RunLog("runs/tiny", resume_step=12)    # rows of steps > 12 are dropped (a resumed run
    log.write("train", 13, {"reward_mean": ...})  # re-logs them), TensorBoard under runs/tiny/tb
    rows = read_rows("runs/tiny/metrics.jsonl", kind="eval")

Row: {"kind": "train"|"eval"|"sft", "step": int, "time": unix seconds, <metric>: float, ...}.
Rows also go to the trackers (TensorBoard, W&B, MLflow: services/pipeline/trackers.py) as ``<kind>/<metric>``. Console lines show a handful of headline metrics.
``log.write_groups(step, groups)`` appends a step's sampled training groups (decoded, for ``mempo
view``) to groups.jsonl, one line per group, with the same resume rule.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm import tqdm

from services.pipeline.trackers import open_trackers, scalar


HEADLINE = {
    "train": ("reward_mean", "scorer/r_mem_mean", "rollout/turns_mean", "rollout/peak_tokens_mean",
              "rollout/tool_failures", "version_lag_max", "step_s"),
    "eval": ("em", "f1", "turns", "r_mem"),
    "sft": ("sft_loss", "grad_norm"),
}


def read_rows(path: str | Path, kind: str | None = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r.get("kind") == kind]


class RunLog:
    """``trackers``: where rows go besides the JSONL (services/pipeline/trackers.py ``open_trackers``);
    None = TensorBoard alone, or nothing with ``tensorboard=False``."""

    def __init__(self, run_dir: str | Path, resume_step: int = 0, tensorboard: bool = True, trackers: list | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.groups_path = self.dir / "groups.jsonl"
        for path in (self.path, self.groups_path):
            kept = [r for r in read_rows(path) if r.get("step", 0) <= resume_step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            tmp.replace(path)  # the old rows or the kept ones, never an emptied file (a stop mid-rewrite)
        self.trackers = open_trackers(None, self.dir, "train", resume_step, tensorboard) if trackers is None else trackers

    def write(self, kind: str, step: int, metrics: dict, console: bool = True) -> dict:
        row = {"kind": kind, "step": int(step), "time": time.time()}
        row.update({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None})
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for tracker in self.trackers:
            tracker.log(kind, step, row)
        if console:
            keys = [k for k in HEADLINE.get(kind, ()) if scalar(row.get(k)) is not None]
            parts = [f"{k.split('/')[-1]}={row[k]:.3g}" for k in keys]
            tqdm.write(f"[{kind} {step}] " + " ".join(parts))
        return row

    def write_groups(self, step: int, groups: list[dict]) -> None:
        """One line per sampled training group of ``step`` (services/learner/group_samples.py)."""
        if groups:
            with open(self.groups_path, "a") as f:
                f.write("".join(json.dumps({"step": int(step), **g}) + "\n" for g in groups))

    def artifacts(self, paths) -> None:
        """Hand files of the run (reports, the page, the metrics) to the trackers that keep artifacts."""
        for tracker in self.trackers:
            tracker.artifacts(paths)

    def close(self, ok: bool = True) -> None:
        """Close the trackers; ``ok`` False marks a tracked run as stopped early (Ctrl-C, an error)."""
        for tracker in self.trackers:
            tracker.close(ok)
        self.trackers = []
