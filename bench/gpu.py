"""GPU smoke check (`make gpu-check`): the scorer's packing and one FSDP2 learner step on CUDA, at the
Qwen2.5-0.5B shape, using only torch, transformers and the project's Ray-free modules.

  scorer   ``MemoryScorer.score_trajectories`` (prefix-shared packed trees, what the scorer service
           runs) against ``bench/scorer.py``'s ``naive_padded`` (the reference: 2 padded sequences
           per <mem> block), for one GRPO group of 16 episodes of exactly 4 and of exactly 9 turns:
           fp32 exactness (max |packed - naive| over every scored answer-token log-prob), bf16
           deviation (max |bf16 - fp32 naive|, packed and naive), bf16 wall time (best of 3 after a
           warm-up) and the speed-up.
  learner  ``LearnerWorker`` (services/learner/worker.py) called in-process, without Ray: FSDP2
           (``fully_shard`` per layer, then the root) over NCCL, world size 1, bf16, with the GPU
           recipe's learner settings (deploy/configs/gpu-qwen2.5-7b.yaml: 16k-token micro-batches,
           KL to a frozen reference). One PPO/GRPO step on the turns of both groups: training
           tokens/s (every context + response token of the step, after a warm-up step), peak GPU
           memory, and the rank-0 full state-dict gather (full_state_dict + cpu_offload).

The model is a randomly initialised Qwen2 with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14
heads, 2 KV heads, MLP 4864, vocab 151936, tied embeddings; seed 0). The data are synthetic token
sequences with the lengths of the embedded world's oracle trajectories (system + question prompt 272
tokens, first response 40, later responses 105 of which 70 are the <mem> block, observations 134,
the scored answer continuation 53 tokens with 11 answer tokens): no built world, tokenizer, Ray or
vLLM is needed. pydantic is (the config tree); carry it as wheels where it is missing.

    .venv/bin/python bench/gpu.py                        # CUDA; prints "no CUDA device" without one
    .venv/bin/python bench/gpu.py --device cpu --small   # the same code path on CPU (gloo), tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(QWEN25_05B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=2048)
# Token lengths of the embedded world's oracle trajectories (tiny config, world tokenizer).
LENGTHS = dict(prompt=272, first_response=40, think=10, mem=70, action=25, observation=134, continuation=53,
               answer=(39, 50))
TURNS = (4, 9)
FORBIDDEN = ("ray", "vllm")


def synthetic_group(rng, vocab: int, n: int, turns: int, lengths: dict = LENGTHS):
    """One GRPO group (``RolloutGroup``) of n episodes of ``turns`` turns each, random token ids.
    Turn 1 has no <mem>; turn t >= 2 answers think + <mem> + action. As with rollout.memory_window=1,
    turn t's context is the prompt + the previous turn's <mem> and action + its observation (turn 2:
    the whole history). The last turn (the answer) gets no observation."""
    import numpy as np

    from services.common.messages import ChatMessage, Episode, Prompt, RolloutGroup, TurnRecord

    def rand(k):
        return rng.integers(0, vocab, size=k).astype(np.int32)

    L = lengths
    prompt = rand(L["prompt"])
    episodes = []
    for e in range(n):
        full, records, prev = [prompt], [], None
        for t in range(1, turns + 1):
            if t == 1:
                resp, ms, me, ctx = rand(L["first_response"]), -1, -1, prompt
            else:
                resp = rand(L["think"] + L["mem"] + L["action"])
                ms, me = L["think"], L["think"] + L["mem"]
                kept = prev.response_ids[prev.mem_start:] if prev.mem_start >= 0 else prev.response_ids
                ctx = np.concatenate([prompt, kept, prev.observation_ids])
            obs = rand(0 if t == turns else L["observation"])
            prefix = int(sum(len(x) for x in full))
            prev = TurnRecord(turn=t, context_ids=ctx, response_ids=resp,
                              response_logprobs=-rng.exponential(size=len(resp)).astype(np.float32),
                              mem_start=ms, mem_end=me, action="answer" if t == turns else "search",
                              observation_ids=obs, full_prefix_len=prefix)
            records.append(prev)
            full += [resp, obs]
        episodes.append(Episode(uid=f"synthetic/{e}", sample=e, prompt_ids=prompt, full_ids=np.concatenate(full),
                                turns=records, answer="synthetic", finish_reason="answer"))
    prompt_msg = Prompt(uid="synthetic", messages=[ChatMessage("user", "synthetic")], golds=[["synthetic"]])
    return RolloutGroup(prompt=prompt_msg, episodes=episodes)


def synthetic_scorer(model, cfg, cont):
    """``MemoryScorer`` with one fixed continuation: the token ids are synthetic, so no tokenizer."""
    from services.scorer.scorer import MemoryScorer

    class SyntheticScorer(MemoryScorer):
        def __init__(self):
            self.model, self.tokenizer, self.cfg, self.tt = model, None, cfg.scorer, None

        def continuation(self, gold):
            return cont

    return SyntheticScorer()


def training_batch_of(batch, seed: int = 0):
    """Every turn as a (context, response) sample with random N(0, 1) token advantages."""
    import numpy as np

    from services.algorithm.advantages import Advantages
    from services.learner.samples import training_batch

    rng = np.random.default_rng(seed)
    adv = Advantages(token_advantages={(g, e, t): rng.normal(size=len(turn.response_ids)).astype(np.float32)
                                       for g, grp in enumerate(batch.groups) for e, ep in enumerate(grp.episodes)
                                       for t, turn in enumerate(ep.turns)})
    return training_batch(batch, adv)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int):
    """(best wall seconds of ``repeats`` calls after one warm-up call, last result)."""
    out, best = fn(), float("inf")
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        out = fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best, out


def max_diff(a: list, b: list) -> float:
    import numpy as np

    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max()) for x, y in zip(a, b))


def scorer_check(model, cfg, cases: dict, cont, repeats: int) -> dict:
    """fp32 exactness on ``model`` (fp32), then converts it to bf16 in place for deviation and speed."""
    import numpy as np
    import torch

    from bench.scorer import naive_padded

    out = {}
    for turns, batch in cases.items():  # fp32: packed vs naive, and the naive reference values
        scorer = synthetic_scorer(model, cfg, cont)
        packed = scorer.score_trajectories(batch, 0)
        _, _, naive = naive_padded(model, scorer, batch)
        ref = [lp for pair in naive for lp in pair]
        vals = np.concatenate(ref)
        out[turns] = {"blocks": len(packed.scores), "ref": ref, "lp_mean": float(vals.mean()), "lp_std": float(vals.std()),
                      "fp32_diff": max_diff([lp for s in packed.scores for lp in (s.full_logp, s.mem_logp)], ref)}
    model.to(torch.bfloat16)
    for turns, batch in cases.items():
        scorer, r = synthetic_scorer(model, cfg, cont), out[turns]
        r["packed_s"], packed = timed(lambda: scorer.score_trajectories(batch, 0), repeats)
        r["naive_s"], (_, r["naive_tokens"], naive) = timed(lambda: naive_padded(model, scorer, batch), repeats)
        r["packed_tokens"], r["forwards"] = int(packed.metrics["model_tokens"]), int(packed.metrics["forwards"])
        r["bf16_packed_diff"] = max_diff([lp for s in packed.scores for lp in (s.full_logp, s.mem_logp)], r["ref"])
        r["bf16_naive_diff"] = max_diff([lp for pair in naive for lp in pair], r["ref"])
    return out


def learner_check(cfg, model_dir: str, tb, steps: int) -> dict:
    """One in-process ``LearnerWorker`` (rank 0 of 1): a warm-up step, ``steps`` timed steps, one gather."""
    import torch

    from services.common.codec import encode
    from services.learner.samples import micro_batches
    from services.learner.worker import LearnerWorker

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    worker = LearnerWorker(0, 1, cfg.model_dump(mode="json"), model_dir)
    worker.join(*worker.store_address())
    try:
        payload = encode(tb)
        best, metrics = timed(lambda: worker.train_step(payload), steps)
        _sync()
        t0 = time.perf_counter()
        state = worker.full_state_dict()
        gather_s = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        backend = torch.distributed.get_backend()
    finally:
        worker.shutdown()
    return {"step_s": best, "tokens": int(tb.cu_seqlens[-1]), "samples": len(tb.cu_seqlens) - 1,
            "loss_tokens": int(metrics["tokens"]), "gather_s": gather_s, "peak_gib": peak, "backend": backend,
            "state_mb": sum(v.numel() * v.element_size() for v in state.values()) / 1e6,
            "micro": len(micro_batches(tb, cfg.learner.micro_token_budget)), "kl": cfg.learner.kl_coef > 0}


def result_rows(sc: dict | None, ln: dict | None, dtype: str) -> list[tuple]:
    """The table's rows; a part that failed (None) gets one FAILED row."""
    rows, (a0, a1) = [("measure", "value", "detail")], LENGTHS["answer"]
    if sc is None:
        rows.append(("scorer", "FAILED", "see the traceback above"))
    for turns, r in (sc or {}).items():
        head = f"scorer, {turns} turns"
        rows += [
            (f"{head}: fp32 max abs diff packed vs naive", f"{r['fp32_diff']:.2e}",
             f"{r['blocks']} <mem> blocks x {a1 - a0} answer tokens x (full, mem); log p mean {r['lp_mean']:.2f}, std {r['lp_std']:.2f}"),
            (f"{head}: bf16 packed max abs diff vs fp32 naive", f"{r['bf16_packed_diff']:.3f}",
             f"bf16 naive vs fp32 naive: {r['bf16_naive_diff']:.3f}"),
            (f"{head}: bf16 speed-up packed vs naive", f"{r['naive_s'] / r['packed_s']:.1f}x",
             f"naive {r['naive_s']:.3f}s, {r['naive_tokens']} tokens, {2 * r['blocks']} sequences; packed "
             f"{r['packed_s']:.3f}s, {r['packed_tokens']} tokens, {r['forwards']} forwards"),
        ]
    if ln is None:
        return rows + [("learner", "FAILED", "see the traceback above")]
    return rows + [
        (f"learner FSDP2 {ln['backend']} W=1 {dtype}: training tokens/s", f"{ln['tokens'] / ln['step_s']:,.0f}",
         f"step {ln['step_s']:.2f}s: {ln['samples']} turn samples, {ln['tokens']} tokens ({ln['loss_tokens']} with loss), "
         f"{ln['micro']} micro-batches, KL reference {'on' if ln['kl'] else 'off'}"),
        ("learner: peak GPU memory (max_memory_allocated)", "n/a (CPU)" if ln["peak_gib"] is None else f"{ln['peak_gib']:.1f} GiB",
         "policy + reference + AdamW + one micro-batch"),
        ("learner: full state-dict gather (cpu_offload)", f"{ln['gather_s']:.2f}s", f"{ln['state_mb']:,.0f} MB to CPU"),
    ]


def table(rows: list[tuple]) -> str:
    """A markdown table."""
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    lines = [fmt(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(r) for r in rows[1:]]
    return "\n".join(lines)


def run_part(name: str, fn):
    """fn() or None after printing its traceback, so one failing part still leaves the other's figures."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception:  # noqa: BLE001 - reported, and the exit status says so
        traceback.print_exc()
        return None
    print(f"  {name} part done in {time.perf_counter() - t0:.0f}s", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if there is one")
    ap.add_argument("--small", action="store_true", help="tiny model shape (hidden 64, 2 layers, vocab 2048), 4 episodes")
    ap.add_argument("--n", type=int, default=None, help="episodes per group (default 16; 4 with --small)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed learner steps (after one warm-up step)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the worker picks NCCL/cuda whenever CUDA is visible
    import torch

    n = args.n or (4 if args.small else 16)
    shape = TINY if args.small else QWEN25_05B
    plan = (f"scorer: packed vs naive, fp32 + bf16, {n} episodes x {TURNS} turns; learner: one FSDP2 step "
            f"(bf16, world size 1); Qwen2 hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
            f"vocab {shape['vocab_size']}, random init")
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print(f"no CUDA device: skipping the GPU check. On a CUDA machine it runs {plan}.\n"
              "Try the same code path on CPU with: python bench/gpu.py --device cpu --small")
        return 0
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (--device cuda)")
        return 1

    import numpy as np
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.config import load_config
    from services.common.messages import TrajectoryBatch
    from services.scorer.continuation import Continuation

    overrides = ["learner.backend=auto", "model.dtype=bfloat16"]
    if device == "cpu":
        overrides.append(f"learner.threads={os.cpu_count() or 1}")
    if args.small:
        overrides.append("learner.micro_token_budget=4096")
    cfg = load_config(ROOT / "deploy/configs/gpu-qwen2.5-7b.yaml", overrides)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 for the exactness check
    torch.backends.cudnn.allow_tf32 = False
    rng = np.random.default_rng(0)
    vocab = shape["vocab_size"]
    cases = {t: TrajectoryBatch(groups=[synthetic_group(rng, vocab, n, t)], policy_version=0) for t in TURNS}
    a0, a1 = LENGTHS["answer"]
    cont = Continuation("(synthetic)", rng.integers(0, vocab, LENGTHS["continuation"]).tolist(), a0, a1)

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape, attn_implementation="sdpa")).eval()
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    shape_txt = (f"{name}, torch {torch.__version__}, transformers {transformers.__version__}; "
                 f"Qwen2 {'tiny' if args.small else 'Qwen2.5-0.5B'} shape (hidden {shape['hidden_size']}, "
                 f"{shape['num_hidden_layers']} layers, vocab {vocab}, {params / 1e6:.1f}M params, random init)")
    print(shape_txt, flush=True)
    sc = run_part("scorer", lambda: scorer_check(model, cfg, cases, cont, args.repeats))
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)  # bf16 now; the worker loads it like any checkpoint
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        tb = training_batch_of(TrajectoryBatch(groups=[c.groups[0] for c in cases.values()], policy_version=0))
        ln = run_part("learner", lambda: learner_check(cfg, tmp, tb, args.steps))
    bad = [m for m in FORBIDDEN if m in sys.modules]
    print()
    print(f"{shape_txt}; {n} episodes per group")
    print(table(result_rows(sc, ln, "bf16")))
    print(f"imported ray/vllm: {', '.join(bad) if bad else 'neither'}")
    return 1 if bad or sc is None or ln is None else 0


if __name__ == "__main__":
    sys.exit(main())
