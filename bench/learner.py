"""Learner throughput: training tokens/s of one GRPO step at W=1 and W=2 FSDP workers on CPU, and
the time to gather and publish the weights, for the tiny model and a ~100M-parameter model.

The batch is real world data: oracle episodes of training prompts turned into per-turn samples
(random token advantages, so every token carries gradient). Tokens/s counts every token of every
sample (context + response) through the forward and backward passes of one optimizer step.
"Gather" is the rank-0 full state dict (FSDP all-gather + CPU offload); "publish" is encoding one
WeightUpdate and putting it in the object store (the part every replica then reads).

"plain" is the yardstick: one process (the bench's own), no Ray, no FSDP, the same model, the same length-sorted padded
micro-batches, the same loss (policy and reference forward, PPO/GRPO loss with the KL term, backward,
clip, AdamW step) with the same threads; "vs plain" is the learner's tokens/s over the plain loop's:
medians of ``--repeats`` steps of each, taken in turns in the same run (a single step's ratio wanders
+-0.1 on 2 cores).

    .venv/bin/python bench/learner.py [--prompts 8] [--big-prompts 1] [--repeats 5]

Peak memory per micro-batch token budget (tiny model and SmolLM2-135M; chunked log-probs, activation
checkpointing, bf16 with fp32 masters) is the ``memory`` mode, measured by bench/learner_memory.py:

    .venv/bin/python bench/learner.py memory [--budgets 1024 2048 4096] [--models tiny smollm2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def make_batch(cfg, world, tok, prompts: int, n: int):
    import numpy as np
    import pandas as pd

    from services.common.messages import TrajectoryBatch
    from services.algorithm.advantages import compute_advantages
    from services.learner.samples import training_batch
    from services.world.oracle_records import oracle_group

    rows = pd.read_parquet(world / "train.parquet").to_dict("records")[:prompts]
    batch = TrajectoryBatch(groups=[oracle_group(cfg, world, r, n, tok, seed=i) for i, r in enumerate(rows)],
                            policy_version=0)
    adv = compute_advantages(batch, None, cfg.algorithm)
    rng = np.random.default_rng(0)
    for k, v in adv.token_advantages.items():
        adv.token_advantages[k] = rng.normal(size=v.shape).astype(np.float32)
    return training_batch(batch, adv)


def big_model(world: Path, out: Path) -> Path:
    """A ~100M-parameter Qwen2 (random init) with the world's tokenizer."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(world / "model")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def plain_loop(cfg, model_dir: str, tb):
    """The plain loop's update, ready to time (model, reference and optimizer built, one warm-up
    update done), on every core of the machine."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.algorithm.loss import aggregate, kl_penalty, policy_loss
    from services.learner.samples import global_counts, micro_batches
    from services.learner.worker import token_logprobs

    lc = cfg.learner
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).requires_grad_(False).eval()
    optim = torch.optim.AdamW(model.parameters(), lr=lc.lr, weight_decay=lc.weight_decay)

    def update() -> None:
        tokens, rows = global_counts(tb)
        micro = micro_batches(tb, lc.micro_token_budget)
        with torch.no_grad():
            refs = [token_logprobs(ref, mb)[0] for mb in micro]
        for mb, ref_lp in zip(micro, refs):
            lp, _ = token_logprobs(model, mb)
            pg, _ = policy_loss(lp, lp.detach(), mb.advantages, mb.loss_mask, lc.clip_eps_low, lc.clip_eps_high,
                                lc.dual_clip_c, lc.loss_agg, tokens, rows)
            kl = aggregate(kl_penalty(lp, ref_lp, lc.kl_type), mb.loss_mask, lc.loss_agg, tokens, rows)
            (pg + lc.kl_coef * kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), lc.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)

    update()  # warm-up, as the learner's
    return update


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(cfg, model_dir: str, tb, world_size: int, repeats: int, plain) -> dict:
    """The learner group's step against the plain loop's, ``repeats`` of each taken in turns (so a
    slow spell of the machine hits both), medians; then one gather and one publish."""
    import statistics

    from services.learner.group import LearnerGroup
    from services.learner.publish import ObjectStorePublisher

    cpus = max(1, (os.cpu_count() or 2) // world_size)  # the machine's cores, split between the ranks
    cfg = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"num_cpus_per_worker": float(cpus)})})
    group = LearnerGroup(cfg, model_dir, world_size=world_size)
    try:
        metrics = group.train_step(tb)  # warm-up (allocations, first all-gathers)
        plain_s, step_s = [], []
        for _ in range(repeats):
            plain_s.append(timed(plain))
            step_s.append(timed(lambda: group.train_step(tb)))
        t0 = time.perf_counter()
        state = group.full_state_dict()
        gather_s = time.perf_counter() - t0
        pub = ObjectStorePublisher([]).publish(state, 1)
    finally:
        group.shutdown()
    params = sum(v.numel() for k, v in state.items() if k != "lm_head.weight")
    return {"step_s": statistics.median(step_s), "plain_s": statistics.median(plain_s),
            "ratios": [p / s for p, s in zip(plain_s, step_s)], "tokens": int(tb.cu_seqlens[-1]),
            "loss_tokens": int(metrics["tokens"]), "gather_s": gather_s, "publish_s": pub["encode_put_s"],
            "mb": pub["bytes"] / 1e6, "params": params}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["memory"]:  # peak memory per token budget: its own subprocess per configuration
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import learner_memory

        return learner_memory.main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="tiny model: prompts (x4 episodes) in the batch")
    ap.add_argument("--big-prompts", type=int, default=1, help="~100M model: prompts (x4 episodes) in the batch; 0 skips it")
    ap.add_argument("--repeats", type=int, default=5, help="timed steps of each loop, taken in turns (medians)")
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    args = ap.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from services.config import load_config
    from services.common.local_ray import local_init_options
    from services.world.build import build_world

    cfg = load_config(args.config, ["learner.micro_token_budget=4096"])
    world = build_world(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(world / "model")
    ray.init(**local_init_options(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [("tiny", str(world / "model"), make_batch(cfg, world, tok, args.prompts, 4))]
        if args.big_prompts:
            cases.append(("~100M", str(big_model(world, Path(tmp) / "big")),
                          make_batch(cfg, world, tok, args.big_prompts, 4)))
        for name, path, tb in cases:
            plain = plain_loop(cfg, path, tb)  # one plain model per case, timed beside each W
            for w in (1, 2):
                r = measure(cfg, path, tb, w, args.repeats, plain)
                r["vs_plain"] = r["plain_s"] / r["step_s"]
                rows.append((name, w, r))
                print(f"  {name:6s} W={w}: {r['tokens'] / r['step_s']:8.1f} training tokens/s "
                      f"({r['tokens']} tokens, {r['loss_tokens']} with loss, step {r['step_s']:.2f}s), plain loop "
                      f"{r['tokens'] / r['plain_s']:8.1f} (step {r['plain_s']:.2f}s), ratios by round "
                      f"{' '.join(f'{x:.2f}' for x in r['ratios'])}; gather {r['gather_s']:.2f}s, "
                      f"encode+put {r['publish_s']:.2f}s for {r['mb']:.1f} MB", flush=True)
    print(f"\nlearner bench ({os.cpu_count()} CPUs, gloo, fp32, medians of {args.repeats} optimizer "
          f"steps after a warm-up step)")
    print(f"{'model':8s}{'params':>12s}{'W':>3s}{'tokens/s':>11s}{'plain':>9s}{'vs plain':>10s}{'gather s':>10s}{'publish s':>11s}")
    for name, w, r in rows:
        print(f"{name:8s}{r['params']:12,d}{w:3d}{r['tokens'] / r['step_s']:11.1f}{r['tokens'] / r['plain_s']:9.1f}"
              f"{r['vs_plain']:9.2f}x"
              f"{r['gather_s']:10.2f}{r['publish_s']:11.2f}")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
