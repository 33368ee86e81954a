"""Does the memory reward pay a memory for looking finished? P_mem of the answers a memory could hold,
before and after its open questions are closed with answers it never found.

From a run's logged training groups (``<run_dir>/groups.jsonl``) it takes every memory block that holds
a supported claim (a ``- Answer:`` line whose gold answer the observations before its turn had shown:
bench/memclaims.py) and at least one open question (a section with no ``- Answer:`` line, the
``- Still needed: ...`` of the SFT grammar). Each is scored three ways with the scorer's own code
in-process (services/scorer/scorer.py: its memory context built from text, its continuation, the
configured rule with ``scored_answers=shown``, i.e. only the shown questions' answer tokens count):

  as written   the memory as the policy wrote it
  wrong        every open question's last line replaced by ``- Answer: X`` with X a gold answer of another
               prompt (a claim the episode never found, and false)
  right        the same line replaced by ``- Answer: <its own gold>`` (a lucky, unfounded right guess)

None of the edits touches the shown questions' lines, so a reward that scores what the memory kept of
them would not move. It prints the mean P_mem of each and the share of blocks whose P_mem rose, for
the blocks of the first ``--steps`` logged steps (the policy near its start).

    .venv/bin/python bench/memcounterfactual.py runs/long/compare/mempo_shown-s0 \\
        --policy runs/long/sft/model --config deploy/configs/long.yaml --steps 3
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memclaims import judge_block, read_groups  # noqa: E402
from services.algorithm.sections import ANSWER_LINE, memory_sections  # noqa: E402
from services.common.rewards import normalize_answer  # noqa: E402
from services.algorithm.retention import _contains  # noqa: E402

LAST_LINE = re.compile(r"\n- [^\n]*$")


def open_sections(memory: str) -> list[int]:
    """Question indices (from 0) whose section has no ``- Answer:`` line."""
    return [q for q, a, b in memory_sections(memory) if not ANSWER_LINE.search(memory[a:b])]


def close_sections(memory: str, answers: dict[int, str]) -> str:
    """``memory`` with the last ``- ...`` line of each question section in ``answers`` replaced by
    ``- Answer: <answer>`` (a section without such a line gets one appended)."""
    out, at = [], 0
    for q, a, b in memory_sections(memory):
        body = memory[a:b]
        if q in answers:
            tail = body.rstrip("\n")
            m = LAST_LINE.search(tail)
            body = (tail[:m.start()] if m else tail) + f"\n- Answer: {answers[q]}" + body[len(tail):]
        out.append(memory[at:a] + body)
        at = b
    return "".join(out) + memory[at:]


def inner(mem_block: str) -> str:
    """The text inside ``<mem>...</mem>``."""
    return mem_block.split("<mem>", 1)[-1].rsplit("</mem>", 1)[0].strip("\n")


def candidates(rows: list[dict], steps: int) -> list[dict]:
    """Blocks of the first ``steps`` logged steps with a supported claim and an open question whose answer
    was never shown; ``shown``: every question whose gold the observations before the turn hold (what
    ``scored_answers=shown`` scores)."""
    out = []
    for row in rows:
        if row["step"] > steps:
            continue
        for ep in row["episodes"]:
            shown = []
            for turn in ep["turns"]:
                if turn.get("mem"):
                    seen = normalize_answer(" ".join(shown))
                    found = [q for q, alts in enumerate(row["golds"]) if any(_contains(seen, x) for x in alts)]
                    said = judge_block(turn["mem"], row["golds"], " ".join(shown))
                    memory = inner(turn["mem"])
                    gone = [q for q in open_sections(memory) if q not in found]  # open and never shown
                    if any(c["supported"] for c in said) and gone:
                        out.append({"question": row["question"], "golds": row["golds"], "memory": memory,
                                    "open": gone, "shown": found})
                shown.append(turn.get("observation") or "")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run folder holding groups.jsonl")
    p.add_argument("--policy", type=Path, required=True, help="the policy that scores (a Hugging Face folder)")
    p.add_argument("--config", default="deploy/configs/long.yaml", help="the run's config (the scorer's rule)")
    p.add_argument("--steps", type=int, default=3, help="blocks of logged steps 1..STEPS")
    p.add_argument("--limit", type=int, default=300, help="at most this many blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write every block's three P_mem here")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.config import load_config
    from services.scorer.packing import Branch, tree_logprobs
    from services.scorer.scorer import MemoryScorer, text_contexts

    cfg = load_config(a.config, [f"model.path={a.policy}", "scorer.scored_answers=shown"])
    tok = AutoTokenizer.from_pretrained(a.policy)
    model = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32).eval()
    scorer = MemoryScorer(model, tok, cfg)
    rows = read_groups(a.run)
    blocks = candidates(rows, a.steps)[:a.limit]
    if not blocks:
        raise SystemExit(f"no block in steps 1..{a.steps} of {a.run} has both a supported claim and an open question")
    rng = random.Random(a.seed)
    pool = [g[0] for r in rows for g in r["golds"]]

    def p_mem(block: dict, memory: str, cont) -> float:
        ctx, _ = text_contexts(tok, cfg.rollout.system_prompt, [block["question"]], memory, [])
        lp = np.asarray(tree_logprobs(model, ctx, [Branch(len(ctx), cont.ids)], cfg.scorer.token_budget)[0])
        ans = lp[cont.answer_start:cont.answer_end]
        return scorer.reward(ans, ans, cont, block["shown"]).p_mem

    out = []
    with torch.no_grad():
        for b in blocks:
            golds = {q: b["golds"][q][0] for q in b["open"]}
            wrong = {q: rng.choice([x for x in pool if x not in b["golds"][q]]) for q in b["open"]}
            cont = scorer.continuation([g[0] for g in b["golds"]])  # one per block: the edits leave the golds
            out.append({"as_written": p_mem(b, b["memory"], cont), "k": len(b["golds"]),
                        "wrong": p_mem(b, close_sections(b["memory"], wrong), cont),
                        "right": p_mem(b, close_sections(b["memory"], golds), cont)})
    base = np.array([o["as_written"] for o in out])
    print(f"{len(out)} blocks (steps 1-{a.steps} of {a.run}; policy {a.policy}; rule {cfg.scorer.filter_mode}/"
          f"{cfg.scorer.average}, shown answers only)")
    print("| memory | mean P_mem | change | blocks whose P_mem rose |\n|---|---|---|---|")
    for name in ("as_written", "wrong", "right"):
        x = np.array([o[name] for o in out])
        print(f"| {name} | {x.mean():.3f} | {x.mean() - base.mean():+.3f} | "
              f"{'' if name == 'as_written' else f'{(x > base).mean():.2f}'} |")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
