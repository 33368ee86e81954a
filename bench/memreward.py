"""Does the memory reward see forgetting? R_mem against ground truth, with any policy.

Oracle episodes (services/world/oracle.py) whose memory rewrites either keep everything the history
has shown or deliberately lose one thing: a found answer (``lose_answer``), the bridge entity of a
2-hop question (``lose_bridge``), or a value replaced by a distractor passage's value
(``distractor``); episode i of a prompt plays ``("perfect",) + LOSSY_BEHAVIOURS`` [i % 4]. Every
block is labelled from the oracle's own bookkeeping (``TurnLabel``: which gold facts the history had
shown, which this memory kept), not from its text:
  keep   the memory kept every gold fact (bridge or answer) shown so far (at least one);
  lose   it lost one (dropped it, or wrote a distractor's value instead);
  none   nothing was shown yet (scored and pooled as in training, but in neither class).

Each block is scored with the scorer's own code in-process (transformers on CPU, no Ray): the mem
and full contexts of ``MemoryScorer.score_trajectories``, its continuation
(``build_continuation``) and prefix-shared forwards (``packing.tree_logprobs``), and
``memory_reward`` in every filter mode (the first prompt is also scored by
``score_trajectories`` itself, which must agree). Two continuations (``scorer.answer_template``'s
names): ``reference`` (the reference's sentence, which the policy never writes) and ``policy`` (the
policy's own answering turn, services/common/turn_format.answer_continuation: the default). Rules are
(filter, average) pairs of services/algorithm/memory_reward.py (``RULES``). Per template and
filter mode it prints:
  AUC          P(R_mem of a keep block > R_mem of a lose block), ties 1/2, pooled over prompts
               (0.5 = chance); AUC/prompt the mean of each prompt's own AUC; AUC matched only pairs of
               one prompt that had been shown the same facts (the comparison a prompt's pool makes at
               one point of the episode); then per loss kind;
  P_mem, P_full  mean per class; lose P_mem=1  share of lose blocks with P_mem exactly 1.0;
  A_mem AUC    the same AUC on the advantages the learner makes of R_mem (normalised within each pool
               of ``algorithm.mem_pooling``: prompt, prompt_turn, prompt_seen), pooled over prompts: a
               block alone in its pool gets 0;
  pool std     mean over prompts of the unbiased std of R_mem over the prompt's pool of blocks
               (the learner's ``mem_pool_std_mean``);
  answers scored  ``scorer.scored_answers``: every row twice, all questions' answers (the reference)
               and only those the episode's observations had shown (blocks with none shown get no
               score and leave the classes and pools: "blocks" counts what is left);
  non-answer   mean log-prob of the continuation's non-answer tokens (its think sentence and
               tags), after the mem / full context (near 0 when the policy would write it).

    .venv/bin/python bench/memreward.py                          # the `make run` SFT policy
    .venv/bin/python bench/memreward.py --policy rl              # runs/tiny/policy; or base, or a DIR
    .venv/bin/python bench/memreward.py --prompts 16 --episodes 8 --k 2 --json runs/tiny/memreward.json
    .venv/bin/python bench/memreward.py scorer.tau=-1.0          # config overrides key=value

The prompts are the first ``--prompts`` training prompts with k questions that are not SFT data
(the rows after ``world.oracle_trajectories``). ``--json`` writes the table and every block's
label and answer-token log-probs (for trying reward variants offline).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEMPLATES = ("reference", "policy")
# (filter, average) pairs of services/algorithm/memory_reward.py measured: the reference's, then the candidates
RULES = (("independent", "geometric"), ("joint", "geometric"), ("none", "geometric"), ("none", "per_question"),
         ("none", "arithmetic"), ("floor", "geometric"), ("floor", "per_question"), ("independent", "per_question"))
KINDS = ("answer", "bridge", "distractor")
SCORED = ("all", "shown")  # scorer.scored_answers: every question's answer, or only those the history had shown


def all_rules() -> tuple[tuple[str, str], ...]:
    """Every registered (filter, average) pair: a new rule is measured without editing this file."""
    from services.algorithm.memory_reward import AVERAGES, FILTERS

    return tuple((f, a) for f in FILTERS for a in AVERAGES)

from services.algorithm.memory_advantage import MEM_POOLINGS  # noqa: E402  (the pool choices)
from services.algorithm.retention import auc  # noqa: E402  (P(pos > neg) + ties/2, the retention check's)


def policy_dir(cfg, spec: str) -> Path:
    """sft (the `make run` cold start), rl (<run_dir>/policy), base (the world's pretrained model) or a dir."""
    from services.common.paths import model_path
    from services.pipeline.sft import sft_dir

    named = {"sft": lambda: sft_dir(cfg), "rl": lambda: Path(cfg.train.run_dir) / "policy",
             "base": lambda: model_path(cfg)}
    path = named[spec]() if spec in named else Path(spec)
    if not (path / "config.json").is_file():
        how = {"sft": "mempo sft", "rl": "mempo train"}.get(spec, "a Hugging Face model directory")
        raise SystemExit(f"--policy {spec}: no model at {path} ({how} makes it)")
    return path


def templates(cfg) -> dict[str, str]:
    """The reference's sentence and the policy's own answering turn (scorer.answer_template's names)."""
    from services.scorer.settings import ANSWER_TEMPLATES

    return dict(ANSWER_TEMPLATES)


def pick_rows(cfg, k: int, count: int) -> list[dict]:
    import pandas as pd

    from services.common.paths import data_path

    rows = pd.read_parquet(data_path(cfg, "train")).to_dict("records")[cfg.world.oracle_trajectories:]
    rows = [r for r in rows if int(r["extra_info"]["k"]) == k][:count]
    if not rows:
        raise SystemExit(f"no training prompts with k={k} beyond the SFT data; the world trains k in "
                         f"{cfg.world.train_objectives}")
    return rows


def score_group(model, tok, tt, cfg, group, template: str) -> list[dict]:
    """Whole-continuation log-probs of every scored block of ``group`` under both contexts, as
    ``MemoryScorer.score_trajectories`` builds and scores them (same trees, same branches)."""
    from services.scorer.continuation import build_continuation, gold_answers
    from services.scorer.packing import Branch, tree_logprobs
    from services.algorithm.retention import shown_answers

    cont = build_continuation(tok, template, gold_answers(group.prompt.golds), tt, cfg.scorer.gold_joiner)
    budget = cfg.scorer.token_budget
    blocks = [(ei, ti) for ei, ep in enumerate(group.episodes) for ti, t in enumerate(ep.turns)
              if t.mem_start >= 0 and t.turn >= 2]
    full = {}
    for ei, ep in enumerate(group.episodes):
        mine = [ti for e, ti in blocks if e == ei]
        if mine:
            lps = tree_logprobs(model, ep.full_ids.tolist(), [Branch(int(ep.turns[ti].full_prefix_len), cont.ids)
                                                              for ti in mine], budget)
            full.update({(ei, ti): lp for ti, lp in zip(mine, lps)})
    prompt = group.episodes[0].prompt_ids.tolist()
    turns = [group.episodes[ei].turns[ti] for ei, ti in blocks]
    mems = [t.response_ids[t.mem_start:t.mem_end].tolist() for t in turns]
    mem_lps = tree_logprobs(model, prompt, [Branch(len(prompt), m + cont.ids) for m in mems], budget)
    answer = np.zeros(len(cont.ids), bool)
    answer[cont.answer_start:cont.answer_end] = True
    spans = cont.question_spans()
    shown = shown_answers(tt, group, blocks)  # what scorer.scored_answers=shown would score
    return [{"episode": ei, "turn": ti, "full": full[(ei, ti)], "mem": lp[len(m):], "answer": answer, "spans": spans,
             "questions": sorted(found)} for (ei, ti), m, lp, found in zip(blocks, mems, mem_lps, shown)]


def check_against_scorer(model, tok, cfg, group, template: str, mine: list[dict]) -> None:
    """``MemoryScorer.score_trajectories`` on the same group must give the same answer log-probs."""
    from services.common.messages import TrajectoryBatch
    from services.scorer.scorer import MemoryScorer

    c = cfg.model_copy(deep=True)
    c.scorer.answer_template = template
    for scored in SCORED:  # under scored_answers=shown the scorer leaves out the blocks nothing was shown to
        c.scorer.scored_answers = scored
        got = MemoryScorer(model, tok, c).score_trajectories(TrajectoryBatch(groups=[group], policy_version=0), 0).scores
        expected = [b for b in mine if scored == "all" or b["questions"]]
        assert [(s.episode, s.turn) for s in got] == [(b["episode"], b["turn"]) for b in expected], "block order differs"
        for s, b in zip(got, expected):
            np.testing.assert_allclose(s.full_logp, b["full"][b["answer"]], atol=1e-5)
            np.testing.assert_allclose(s.mem_logp, b["mem"][b["answer"]], atol=1e-5)


def table_row(blocks: list[dict], template: str, rule: tuple[str, str], cfg, scored: str = "all") -> dict:
    from services.algorithm.memory_reward import memory_reward

    mode, average = rule
    if scored == "shown":  # scorer.scored_answers=shown: only the shown questions, no score where none was
        blocks = [b for b in blocks if b["questions"]]
    for b in blocks:
        s = b["scores"][template]
        r = memory_reward(s["full_answer"], s["mem_answer"], cfg.scorer.tau, mode, cfg.scorer.mean_eps, average,
                          s["spans"], cfg.scorer.logp_floor, b["questions"] if scored == "shown" else None)
        b["r"] = (r.p_mem, r.p_full, r.r_mem)
    keep = [b for b in blocks if b["label"] == "keep"]
    lose = [b for b in blocks if b["label"] == "lose"]

    def mean(items, i):
        return float(np.mean([b["r"][i] for b in items])) if items else float("nan")

    row = {"template": template, "filter": mode, "average": average, "scored": scored, "blocks": len(blocks), "auc": auc([b["r"][2] for b in keep], [b["r"][2] for b in lose])}
    per_prompt = [auc([b["r"][2] for b in keep if b["prompt"] == p], [b["r"][2] for b in lose if b["prompt"] == p])
                  for p in sorted({b["prompt"] for b in blocks})]
    row["auc_per_prompt"] = float(np.nanmean(per_prompt)) if not all(np.isnan(per_prompt)) else float("nan")
    # matched: keep against lose blocks of the same prompt that had been shown the same facts (what a
    # prompt's pool compares at one point of the episode), averaged over those pairs
    num = den = 0.0
    for key in sorted({(b["prompt"], b["shown"]) for b in blocks}):
        k = [b["r"][2] for b in keep if (b["prompt"], b["shown"]) == key]
        lo = [b["r"][2] for b in lose if (b["prompt"], b["shown"]) == key]
        if k and lo:
            num, den = num + auc(k, lo) * len(k) * len(lo), den + len(k) * len(lo)
    row["auc_matched"] = num / den if den else float("nan")
    for kind in KINDS:
        row[f"auc_{kind}"] = auc([b["r"][2] for b in keep], [b["r"][2] for b in lose if kind in b["kinds"]])
    row.update(p_mem_keep=mean(keep, 0), p_mem_lose=mean(lose, 0), p_full_keep=mean(keep, 1), p_full_lose=mean(lose, 1),
               lose_p_mem_1=float(np.mean([b["r"][0] == 1.0 for b in lose])) if lose else float("nan"))
    pools = [[b["r"][2] for b in blocks if b["prompt"] == p] for p in sorted({b["prompt"] for b in blocks})]
    row["pool_std"] = float(np.mean([np.std(v, ddof=1) for v in pools if len(v) >= 2]))
    for pooling in MEM_POOLINGS:  # what the learner's normalisation makes of R_mem, under each pooling
        row[f"a_auc_{pooling}"] = auc(*advantages_by_label(blocks, pooling, cfg))
    row["nonanswer_mem"] = float(np.mean([b["scores"][template]["nonanswer_mem"] for b in blocks]))
    row["nonanswer_full"] = float(np.mean([b["scores"][template]["nonanswer_full"] for b in blocks]))
    return row


def advantages_by_label(blocks: list[dict], pooling: str, cfg) -> tuple[list[float], list[float]]:
    """A_mem of the keep and of the lose blocks, each block normalised (the learner's ``normalize``)
    among the blocks of its prompt in the same pool (``b["pools"][pooling]``)."""
    from services.algorithm.memory_advantage import mem_credit
    from services.algorithm.outcome import normalize

    pools: dict[tuple, list[dict]] = {}
    for b in blocks:
        pools.setdefault((b["prompt"], b["pools"][pooling]), []).append(b)
    by_label: dict[str, list[float]] = {"keep": [], "lose": [], "none": []}
    for pool in pools.values():
        for b, a in zip(pool, normalize([mem_credit(b["r"][2], cfg.algorithm.mem_credit) for b in pool],
                                         cfg.algorithm.mem_eps, cfg.algorithm.mem_std_floor)):
            by_label[b["label"]].append(float(a))
    return by_label["keep"], by_label["lose"]


def pool_names(ep, t: int) -> dict[str, str]:
    """The block's pool under each ``algorithm.mem_pooling`` (services/algorithm/memory_advantage.pool_key), as
    short stable strings (the --json output keeps them)."""
    import hashlib

    from services.algorithm.memory_advantage import pool_key

    out = {}
    for pooling in MEM_POOLINGS:
        key = pool_key(ep, t, pooling)
        if isinstance(key, frozenset):
            key = hashlib.sha1(b"|".join(sorted(key))).hexdigest()[:12]
        out[pooling] = str(key)
    return out


def print_table(rows: list[dict]) -> None:
    cols = [("template", "template", "{}"), ("filter", "filter", "{}"), ("average", "average", "{}"),
            ("answers scored", "scored", "{}"), ("blocks", "blocks", "{}"),
            ("AUC", "auc", "{:.3f}"),
            ("AUC/prompt", "auc_per_prompt", "{:.3f}"), ("AUC matched", "auc_matched", "{:.3f}"), ("AUC answer", "auc_answer", "{:.3f}"),
            ("AUC bridge", "auc_bridge", "{:.3f}"), ("AUC distractor", "auc_distractor", "{:.3f}"),
            ("P_mem keep", "p_mem_keep", "{:.3f}"), ("P_mem lose", "p_mem_lose", "{:.3f}"),
            ("P_full keep", "p_full_keep", "{:.3f}"), ("P_full lose", "p_full_lose", "{:.3f}"),
            ("lose P_mem=1", "lose_p_mem_1", "{:.3f}"),
            *[(f"A_mem AUC {p}", f"a_auc_{p}", "{:.3f}") for p in MEM_POOLINGS], ("pool std R_mem", "pool_std", "{:.3f}"),
            ("non-answer logp mem / full", None, None)]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = [fmt.format(r[key]) for _, key, fmt in cols[:-1]]
        cells.append(f"{r['nonanswer_mem']:.2f} / {r['nonanswer_full']:.2f}")
        print("| " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--policy", default="sft", help="sft (default), rl, base, or a Hugging Face model directory")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--episodes", type=int, default=8, help="oracle episodes per prompt")
    ap.add_argument("--k", type=int, default=2, help="questions per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write the table and every block's scores here")
    ap.add_argument("--rules", default="", help="'all': every (filter, average) pair of the registries in "
                    "services/algorithm/memory_reward.py; default: the RULES pairs")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.config import load_config
    from services.common.token_text import TokenText
    from services.search_tool.bm25_index import BM25Index
    from services.common.paths import index_dir, world_dir
    from services.world.build import prepare_world
    from services.world.oracle import LOSSY_BEHAVIOURS
    from services.world.oracle_records import oracle_episodes

    cfg = prepare_world(load_config(args.config, args.overrides))
    path = policy_dir(cfg, args.policy)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tt, temps = TokenText(tok), templates(cfg)
    index = BM25Index.load(index_dir(cfg))  # the world's search index, as the world build's oracle uses it
    behaviours = ("perfect",) + LOSSY_BEHAVIOURS
    rows = pick_rows(cfg, args.k, args.prompts)
    blocks: list[dict] = []
    for p, row in enumerate(tqdm(rows, desc="memreward", unit="prompt", dynamic_ncols=True)):
        group, trajs = oracle_episodes(cfg, world_dir(cfg), row, args.episodes, tok,
                                       seed=args.seed * 10_000 + p, index=index, behaviours=behaviours)
        scored = {name: score_group(model, tok, tt, cfg, group, text) for name, text in temps.items()}
        if p == 0:
            for name, text in temps.items():
                check_against_scorer(model, tok, cfg, group, text, scored[name])
        for j, b in enumerate(scored["policy"]):
            ep, traj = group.episodes[b["episode"]], trajs[b["episode"]]
            assert len(ep.turns) == len(traj.labels)
            lab = traj.labels[b["turn"]]
            assert lab.has_mem and lab.turn == ep.turns[b["turn"]].turn
            scores = {}
            for name in temps:
                s = scored[name][j]
                scores[name] = {"full_answer": s["full"][s["answer"]], "mem_answer": s["mem"][s["answer"]],
                                "spans": s["spans"],
                                "nonanswer_mem": float(s["mem"][~s["answer"]].mean()),
                                "nonanswer_full": float(s["full"][~s["answer"]].mean())}
            blocks.append({"prompt": p, "episode": b["episode"], "behaviour": traj.behaviour, "turn": lab.turn,
                           "label": lab.label, "kinds": sorted({x.kind for x in lab.lost}),
                           "shown": len(lab.shown), "questions": b["questions"], "pools": pool_names(ep, b["turn"]), "lost": [[x.kind, x.fact.value, x.replaced_by] for x in lab.lost],
                           "scores": scores})
    rules = all_rules() if args.rules == "all" else RULES
    table = [table_row(blocks, name, rule, cfg, scored) for name in temps for rule in rules for scored in SCORED]
    count = {c: sum(b["label"] == c for b in blocks) for c in ("keep", "lose", "none")}
    kinds = {k: sum(k in b["kinds"] for b in blocks) for k in KINDS}
    print(f"\nmemory-reward bench: policy {path}, {len(rows)} training prompts (k={args.k}) x {args.episodes} oracle "
          f"episodes ({', '.join(behaviours)}), tau {cfg.scorer.tau:.3f}")
    print(f"{len(blocks)} scored blocks: keep {count['keep']}, lose {count['lose']} ("
          + ", ".join(f"{k} {n}" for k, n in kinds.items()) + f"), none (nothing shown yet) {count['none']}")
    for name, text in temps.items():
        print(f"template {name}: {text!r}")
    print()
    print_table(table)
    elapsed = time.perf_counter() - t0
    print(f"\nscored with the scorer's code (checked against MemoryScorer.score_trajectories on prompt 0); "
          f"{elapsed:.0f} s, torch threads {torch.get_num_threads()}")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        for b in blocks:
            b.pop("r", None)
            for s in b["scores"].values():
                s["full_answer"], s["mem_answer"] = s["full_answer"].tolist(), s["mem_answer"].tolist()
        out.write_text(json.dumps({"policy": str(path), "args": vars(args), "templates": temps, "counts": count,
                                   "kinds": kinds, "table": table, "blocks": blocks, "seconds": elapsed}, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
