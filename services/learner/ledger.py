"""The learner's ledger: what each update trained, appended as it happens, for checks that must not
trust the driver's log (``mempo chaos``, services/pipeline/chaos_checks.py).

    <run_dir>/ledger.jsonl, one JSON line per event, flushed and fsynced:
    {"event": "start",   "step": 12, "time": ..., "digest": ..., "why": "checkpoint" | "fresh" | "rebuilt", "pid": ...}
    {"event": "trained", "step": 13, "time": ..., "digest": ..., "prompts": {"train-7": [1, 8], ...},
     "turn_versions": [12, 12], "score_versions": [12], "dropped_score_versions": [], "stale_samples": 0,
     "checkpoint": true, "metrics": {...}}

A ``start`` line is written whenever a learner group takes up weights: a fresh replica at step 0 or
at its latest complete checkpoint, or a group rebuilt after a worker died. ``digest`` is the sum of
|p| over every parameter after the event, so a start at step s must match the ``trained`` line of
step s (the weights resumed are the weights that step left). ``prompts`` gives, for each prompt uid
the update trained, its [groups, episodes]; ``turn_versions`` is the (lowest, highest) policy version
that sampled the turns it trained on, ``score_versions`` the versions that scored the memories it used
(``dropped_score_versions``: scores left out as stale). ``metrics`` is the learner's row of the step,
so that a step the driver could not log (stopped while the learner finished it) is not lost
(``unlogged``).

The lineage of a run (``lineage``) is what its final weights went through: read in order, a start at
step s drops every trained line after s (rolled back), so a step trained again after a rollback
counts once and the one it replaced is reported as rolled back, not as trained twice.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

NAME = "ledger.jsonl"


class Ledger:
    def __init__(self, run_dir: str | Path):
        self.path = Path(run_dir) / NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def _append(self, row: dict) -> None:
        # one write of a whole line, then fsync: a killed process leaves whole lines (a torn last one
        # at worst, which ``read`` skips)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def start(self, step: int, digest: float, why: str) -> None:
        self._append({"event": "start", "step": step, "time": time.time(), "digest": digest, "why": why,
                      "pid": os.getpid()})

    def trained(self, step: int, digest: float, prompts: dict[str, list[int]], turn_versions: list[int],
                score_versions: list[int], dropped_score_versions: list[int], stale_samples: int,
                checkpoint: bool, metrics: dict) -> None:
        self._append({"event": "trained", "step": step, "time": time.time(), "digest": digest, "prompts": prompts,
                      "turn_versions": [min(turn_versions), max(turn_versions)] if turn_versions else [],
                      "score_versions": sorted(set(score_versions)),
                      "dropped_score_versions": sorted(set(dropped_score_versions)), "stale_samples": stale_samples,
                      "checkpoint": checkpoint,
                      "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))}})


def read(run_dir: str | Path) -> list[dict]:
    """The ledger's lines in order; a torn last line (a process killed mid-write) is left out."""
    path = Path(run_dir) / NAME
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def lineage(rows: list[dict]) -> tuple[dict[int, dict], list[dict], list[dict]]:
    """(step -> the trained line the final weights went through, the trained lines a start rolled
    back, the trained lines of a step already in the lineage with no rollback between: a step
    trained twice, which must never happen)."""
    kept: dict[int, dict] = {}
    rolled_back: list[dict] = []
    twice: list[dict] = []
    for row in rows:
        if row["event"] == "start":
            for s in sorted(s for s in kept if s > row["step"]):
                rolled_back.append(kept.pop(s))
        elif row["event"] == "trained":
            if row["step"] in kept:
                twice.append(row)
            kept[row["step"]] = row
    return kept, rolled_back, twice


def unlogged(run_dir: str | Path, logged: set[int], upto: int) -> list[dict]:
    """The learner's metrics rows of lineage steps <= ``upto`` that the driver's log lacks (``logged``),
    oldest first: a step the learner finished after the driver stopped waiting for it."""
    kept, _, _ = lineage(read(run_dir))
    return [kept[s]["metrics"] | {"step": s} for s in sorted(kept) if s <= upto and s not in logged]
