"""Memory scoring cost at three horizons: the scorer's prefix-shared scoring versus the reference's
naive scoring, and both against the unique tokens (the least any scorer must run).

For each horizon, one GRPO group of n=16 oracle episodes (protocol records, as the rollout writes
them) is scored twice with the same tiny model:

  packed  ``MemoryScorer.score_trajectories`` (what the scorer service runs): each episode's full
          history goes through the model once into a KV cache and every block's answer is scored
          from it; the group's shared prompt once, every memory block from its cache;
  naive   the reference: per <mem> block, the (full context + answer) and (mem context + answer)
          sequences padded to one length and run as a batch of 2.

Horizons: a world prompt with k=2 questions (4 turns), one with k=4 (~9 turns), and two k=4 prompts
asked together as k=8 (~16 turns). Unique tokens = per episode its longest scored history, plus
every memory block, plus one answer continuation per block and context, plus the group's prompt.
It prints wall time (best of --repeats for 4 turns, one run for the longer ones), tokens, the
speed-up, and checks both give the same rewards (within 1e-4).

    .venv/bin/python bench/scorer.py [--n 16] [--repeats 3] [--horizons 4 9 16] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def padded_logprobs(model, contexts: list[list[int]], continuation: list[int]) -> tuple[list, int]:
    """log p(continuation[j] | context + continuation[:j]) after each context, the reference's way:
    the (context + continuation) sequences right-padded to one length and run as one batch.
    Returns (one numpy array per context, tokens through the model incl. padding)."""
    import torch

    from services.common.model_io import target_logprobs

    device = next(model.parameters()).device
    seqs = [c + continuation for c in contexts]
    length = max(map(len, seqs))
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    att = torch.zeros((len(seqs), length), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=att.to(device), use_cache=False).logits
        target = torch.tensor(continuation)
        out = []
        for i, ctx in enumerate(contexts):  # log-probs at the continuation's predictor positions only
            rows = logits[i, len(ctx) - 1 : len(ctx) + len(continuation) - 1]
            out.append(target_logprobs(rows, target).cpu().numpy())
    return out, len(seqs) * length


def naive_padded(model, scorer, batch) -> tuple[list[float], int, list[tuple]]:
    """The reference's scoring: 2 padded sequences per block. Returns (r_mem per block, tokens,
    (full, mem) answer-token log-probs per block), blocks in ``score_trajectories`` order."""
    from services.scorer.continuation import gold_answers

    rewards, tokens, logprobs = [], 0, []
    for group in batch.groups:
        cont = scorer.continuation(gold_answers(group.prompt.golds))
        a0, a1 = cont.answer_start, cont.answer_end
        for ep in group.episodes:
            for t in ep.turns:
                if t.mem_start < 0 or t.turn < 2:
                    continue
                full = ep.full_ids[: t.full_prefix_len].tolist()
                mem = ep.prompt_ids.tolist() + t.response_ids[t.mem_start : t.mem_end].tolist()
                lps, n = padded_logprobs(model, [full, mem], cont.ids)
                tokens += n
                lps = [lp[a0:a1] for lp in lps]
                logprobs.append(tuple(lps))
                rewards.append(scorer.reward(lps[0], lps[1], cont).r_mem)
    return rewards, tokens, logprobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--horizons", type=int, nargs="+", default=[4, 9, 16], choices=[4, 9, 16])
    ap.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. scorer.token_budget=1024")
    args = ap.parse_args(argv)

    import numpy as np
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.config import load_config
    from services.common.messages import TrajectoryBatch
    from services.scorer.scorer import MemoryScorer
    from services.world.build import build_world
    from services.world.oracle_records import oracle_group

    cfg = load_config(args.config, ["rollout.max_turns=24", *args.overrides])  # room for k=8 episodes
    world = build_world(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32, attn_implementation="sdpa").eval()
    scorer = MemoryScorer(model, tok, cfg)
    train = pd.read_parquet(world / "train.parquet").to_dict("records")
    test = pd.read_parquet(world / "test.parquet").to_dict("records")
    four = [r for r in test if r["extra_info"]["k"] == 4]
    rows = {4: next(r for r in train if r["extra_info"]["k"] == 2 and sum(r["extra_info"]["hops"]) == 3),
            9: max(four, key=lambda r: sum(r["extra_info"]["hops"])), 16: merged_row(four[1], four[2])}
    print(f"scorer bench: token budget {cfg.scorer.token_budget}, 1 group of n={args.n} oracle episodes per horizon, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'turns/ep':>8} {'blocks':>6} {'naive tok':>10} {'packed tok':>10} {'unique tok':>10} {'packed/unique':>13} "
          f"{'naive s':>8} {'packed s':>8} {'speed-up':>8} {'naive/unique':>12}")
    for horizon in args.horizons:
        batch = TrajectoryBatch(groups=[oracle_group(cfg, world, rows[horizon], args.n, tok)], policy_version=0)
        eps = batch.groups[0].episodes
        repeats = args.repeats if horizon <= 4 else 1

        def best(fn):
            times, out = [], None
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = fn()
                times.append(time.perf_counter() - t0)
            return min(times), out

        packed_s, packed = best(lambda: scorer.score_trajectories(batch, 0))
        naive_s, (naive_r, naive_tokens, _) = best(lambda: naive_padded(model, scorer, batch))
        np.testing.assert_allclose([s.r_mem for s in packed.scores], naive_r, atol=1e-4)
        unique = unique_tokens(scorer, batch)
        ptok = int(packed.metrics["model_tokens"])
        print(f"{np.mean([len(e.turns) for e in eps]):8.2f} {len(packed.scores):6d} {naive_tokens:10d} {ptok:10d} {unique:10d} "
              f"{ptok / unique:12.2f}x {naive_s:8.2f} {packed_s:8.2f} {naive_s / packed_s:7.2f}x {naive_tokens / unique:11.2f}x",
              flush=True)
    print("rewards agree with the naive scoring within 1e-4 at every horizon")
    return 0


def merged_row(a: dict, b: dict) -> dict:
    """Two prompts' questions asked together (k = k_a + k_b), as the world writes a prompt row."""
    import json

    ia, ib = a["extra_info"], b["extra_info"]
    info = {key: list(ia[key]) + list(ib[key]) for key in ("questions", "answers", "hops", "planted")}
    info.update(split="bench", index=0, k=ia["k"] + ib["k"],
                chains=json.dumps(json.loads(ia["chains"]) + json.loads(ib["chains"])))
    prompt = [dict(a["prompt"][0]), {"role": "user", "content": "; ".join(info["questions"])}]
    target = "; ".join(x[0] for x in info["answers"])
    return {**a, "prompt": prompt, "reward_model": {"style": "rule", "ground_truth": {"target": [target]}},
            "extra_info": info}


def unique_tokens(scorer, batch) -> int:
    """The least any scorer must run: per episode its longest scored history, every memory block,
    one answer continuation per block and context, and each group's prompt once."""
    from services.scorer.continuation import gold_answers

    total = 0
    for group in batch.groups:
        cont = scorer.continuation(gold_answers(group.prompt.golds))
        blocks = 0
        for ep in group.episodes:
            scored = [t for t in ep.turns if t.mem_start >= 0 and t.turn >= 2]
            if scored:
                total += max(t.full_prefix_len for t in scored) + sum(t.mem_end - t.mem_start for t in scored)
                blocks += len(scored)
        total += 2 * blocks * len(cont.ids) + len(group.episodes[0].prompt_ids)
    return total

if __name__ == "__main__":
    sys.exit(main())
