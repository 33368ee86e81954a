"""What the memories of a training run claim: answer lines with and without support in what the episode
had been shown, step by step, and the memory advantage each kind received.

Reads the training groups a run logs (``<run_dir>/groups.jsonl``, ``train.sample_groups`` per step;
the decoded text of every turn). A memory block is cut into its question sections (``Q<i>: ...``, the
grammar the SFT transcripts teach) and each ``- Answer: X`` line in section i is a *claim* for question i.
A claim is *supported* when question i's gold answer (any alternative, SQuAD-normalised whole words:
services/algorithm/retention.py) appears in the observations the episode received before the block's turn,
*unsupported* when it does not (the memory wrote down an answer it had not found), and *right* when X
equals a gold alternative after normalisation. Per bucket of steps it prints the blocks, claims per block,
the share of claims that are unsupported and how many of those are right guesses, and the mean memory
advantage (A_mem) of blocks with an unsupported claim against blocks whose claims are all supported.

    .venv/bin/python bench/memclaims.py runs/long/compare/mempo_shown-s0 runs/long/compare/mem1-s0
    .venv/bin/python bench/memclaims.py RUN_DIR --buckets 4 --json out.json

Read it as a diagnostic of one hypothesis (docs/experiments.md exp26): a memory reward that credits the
``- Answer:`` lines of found answers teaches a small policy to write such lines for answers it has not
found, and then to answer on them. Text is decoded only to judge, never to train on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.common.rewards import normalize_answer  # noqa: E402
from services.algorithm.sections import ANSWER_LINE, memory_sections  # noqa: E402
from services.algorithm.retention import _contains  # noqa: E402

def claims(memory: str) -> list[tuple[int, str]]:
    """(question index from 0, claimed answer) for every ``- Answer:`` line under a ``Q<i>:`` header."""
    return [(q, m.group(1)) for q, a, b in memory_sections(memory) for m in ANSWER_LINE.finditer(memory[a:b])]


def judge_block(memory: str, golds: list[list[str]], shown_text: str) -> list[dict]:
    """Each claim of one memory: supported (its gold shown before the turn) and right (equals a gold)."""
    seen = normalize_answer(shown_text)
    out = []
    for q, said in claims(memory):
        alts = golds[q] if 0 <= q < len(golds) else []
        out.append({"q": q, "supported": any(_contains(seen, a) for a in alts),
                    "right": normalize_answer(said) in {normalize_answer(a) for a in alts}})
    return out


def blocks_of(row: dict):
    """(step, k, claims, a_mem) for every memory block of one logged group."""
    for ep in row["episodes"]:
        shown = []
        for turn in ep["turns"]:
            if turn.get("mem"):
                yield row["step"], row["k"], judge_block(turn["mem"], row["golds"], " ".join(shown)), turn.get("a_mem")
            shown.append(turn.get("observation") or "")


def summarize(rows: list[dict], buckets: int) -> list[dict]:
    """Per bucket of steps: blocks, claims per block, unsupported share, right share of unsupported,
    mean A_mem of blocks with / without an unsupported claim (those with claims only)."""
    blocks = [b for r in rows for b in blocks_of(r)]
    if not blocks:
        return []
    steps = sorted({b[0] for b in blocks})
    edges = np.array_split(np.array(steps), min(buckets, len(steps)))
    out = []
    for part in edges:
        mine = [b for b in blocks if part[0] <= b[0] <= part[-1]]
        said = [c for b in mine for c in b[2]]
        unsup = [c for c in said if not c["supported"]]
        with_a = [b for b in mine if b[3] is not None and b[2]]
        bad = [b[3] for b in with_a if any(not c["supported"] for c in b[2])]
        good = [b[3] for b in with_a if all(c["supported"] for c in b[2])]
        out.append({"steps": f"{part[0]}-{part[-1]}", "blocks": len(mine),
                    "claims_per_block": len(said) / len(mine),
                    "unsupported_share": len(unsup) / len(said) if said else float("nan"),
                    "unsupported_right": sum(c["right"] for c in unsup) / len(unsup) if unsup else float("nan"),
                    "a_mem_unsupported": float(np.mean(bad)) if bad else float("nan"),
                    "a_mem_supported": float(np.mean(good)) if good else float("nan")})
    return out


def read_groups(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "groups.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: is {run_dir} a `mempo train` run folder?")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the run stopped
            print(f"{path}:{n}: skipped (not JSON)", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run folders holding groups.jsonl")
    p.add_argument("--buckets", type=int, default=4, help="how many step ranges to split each run into")
    p.add_argument("--json", type=Path, help="also write the tables here")
    a = p.parse_args(argv)
    result = {}
    print("| run | steps | blocks | claims/block | unsupported | right of unsupported | A_mem unsupported | "
          "A_mem supported |\n|---|---|---|---|---|---|---|---|")
    for run in a.runs:
        result[str(run)] = summarize(read_groups(run), a.buckets)
        for r in result[str(run)]:
            print(f"| {run.name} | {r['steps']} | {r['blocks']} | {r['claims_per_block']:.2f} | "
                  f"{r['unsupported_share']:.3f} | {r['unsupported_right']:.2f} | {r['a_mem_unsupported']:+.3f} | "
                  f"{r['a_mem_supported']:+.3f} |")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
