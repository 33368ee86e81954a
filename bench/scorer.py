"""Memory scoring cost: the scorer's prefix-shared packing versus the reference's naive scoring.

One GRPO group of n=16 episodes (oracle trajectories of one world prompt with 4 turns, turned into
protocol records) is scored twice with the same tiny model, in one run:

  packed  ``MemoryScorer.score_trajectories`` (what the scorer service runs): one forward per
          episode for all its full contexts, one per group for all mem contexts;
  naive   the reference: per <mem> block, the (full context + answer) and (mem context + answer)
          sequences padded to one length and run as a batch of 2.

It prints wall time (best of --repeats), tokens through the model, and checks both give the same
rewards (within 1e-4).

    .venv/bin/python bench/scorer.py [--n 16] [--repeats 3]
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
    from services.scorer.continuation import gold_text

    rewards, tokens, logprobs = [], 0, []
    for group in batch.groups:
        cont = scorer.continuation(gold_text(group.prompt.golds, scorer.cfg.gold_joiner))
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
                rewards.append(scorer.reward(lps[0], lps[1]).r_mem)
    return rewards, tokens, logprobs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value, e.g. scorer.token_budget=1024")
    args = ap.parse_args(argv)

    import numpy as np
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.common.config import load_config
    from services.common.messages import TrajectoryBatch
    from services.scorer.scorer import MemoryScorer
    from services.world.build import build_world
    from services.world.oracle_records import oracle_group

    cfg = load_config(args.config, args.overrides)
    world = build_world(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = pd.read_parquet(world / "train.parquet").to_dict("records")
    row = next(r for r in rows if r["extra_info"]["k"] == 2 and sum(r["extra_info"]["hops"]) == 3)  # 4 turns
    batch = TrajectoryBatch(groups=[oracle_group(cfg, world, row, args.n, tok)], policy_version=0)
    eps = batch.groups[0].episodes
    scorer = MemoryScorer(model, tok, cfg)

    def best(fn):
        times, out = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    packed_s, packed = best(lambda: scorer.score_trajectories(batch, 0))
    naive_s, (naive_r, naive_tokens, _) = best(lambda: naive_padded(model, scorer, batch))
    np.testing.assert_allclose([s.r_mem for s in packed.scores], naive_r, atol=1e-4)
    blocks = len(packed.scores)
    print(f"scorer bench: token budget {cfg.scorer.token_budget}, 1 group, n={args.n} episodes, turns/episode {np.mean([len(e.turns) for e in eps]):.2f}, "
          f"{blocks} <mem> blocks, torch threads {torch.get_num_threads()}")
    print(f"  naive (2 padded sequences per block): {naive_s:7.3f}s  {naive_tokens:7d} tokens through the model  "
          f"{2 * blocks} sequences")
    print(f"  packed (prefix-shared trees)        : {packed_s:7.3f}s  {int(packed.metrics['model_tokens']):7d} tokens  "
          f"{int(packed.metrics['forwards'])} forwards")
    print(f"  speed-up {naive_s / packed_s:.2f}x (target >= 3x), tokens {naive_tokens / packed.metrics['model_tokens']:.2f}x fewer; "
          f"rewards agree within 1e-4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
