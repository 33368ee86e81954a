"""Learner memory and speed per micro-batch token budget: the peak RSS (high-water) of one FSDP2
learner rank and its training tokens/s, for the tiny world model and a SmolLM2-135M-shaped model.

Each configuration runs in a fresh subprocess (so every peak is its own): a ``LearnerWorker`` built
in that process (W=1, gloo, no Ray; policy + frozen reference + AdamW, as the pipeline's learner),
PPO/GRPO steps on a synthetic batch of one full micro-batch (turn-like samples of 512 tokens, the
last 128 the response with loss and random advantages): a warm-up step, then ``--repeats`` timed
ones. tokens/s is the timed steps' median (every token of every sample, context + response, through
the reference forward and the policy's forward and backward); the peak is ``ru_maxrss`` after all
steps (model loading included; what the allocator keeps after frees counts too, as for an OOM kill).

Variants:
  before   the learner as of ``--baseline`` (a commit before chunked log-probs: full-vocabulary fp32
           logits at every position), its worker module read from git
  chunked  chunked log-probs at the loss positions (learner.logit_chunk_tokens)
  ac       chunked + activation checkpointing (learner.activation_checkpointing)
  bf16     chunked + ac with model.dtype bfloat16 (fp32 masters, bf16 compute)
  lora     chunked, LoRA adapters of rank 16 on every linear layer (learner.lora: the base frozen, no
           reference copy, AdamW over the adapters)
  lora_ac  lora + activation checkpointing
  X@mmap1  variant X with glibc's mmap threshold fixed at 1 MiB (learner.cpu_mmap_threshold_mib=1): freed
           tensors go back to the system at once, so the RSS high-water follows the live tensors

The estimate column is ``services/learner/memory.py``'s (what the worker warns with at start).
The SmolLM2 model is ``.cache/models/smollm2-135m-instruct-float32`` when that folder exists, else a
random-init Llama of its shape (vocab 49,152, hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536,
tied embeddings): the same memory and speed.

    .venv/bin/python bench/learner_memory.py [--budgets 1024 2048 4096] [--models tiny smollm2]
        [--variants before chunked ac] [--threads 2] [--repeats 1]

Measured on the 2-core, 24 GB CPU machine (shared with other jobs, so tokens/s wanders; peaks do
not), SmolLM2-135M, peak GB by budget 1,024 / 2,048 / 4,096:
  before 5.5 / 7.7 / 12.0;  chunked 5.4 / 6.8 / 10.7;  ac 4.5 / 5.2 / 5.5;  bf16 (+ac) 3.7 / 3.9 / 4.3
  (ac at 8,192: 7.4; before at 8,192 was OOM-killed at 20.7 GB in a pipeline run).
Tokens/s at 2,048, one thread, medians of 3 steps: before 64.5, chunked 73.1, ac 64.2, bf16 100.3
(the tiny model: 6,394 / 10,636 / 8,792 / 10,451).
LoRA (rank 16, all-linear) on SmolLM2 at 4,096, two threads, medians of 2 steps: peak 11.46 GB (lora) and
5.37 GB (lora_ac) against 10.63 (chunked) and 5.56 (ac); step 18.83 / 23.21 s against 22.72 / 23.87 s.
With glibc's mmap threshold fixed at 1 MiB (@mmap1): 6.57 / 2.25 GB against 8.64 / 3.79, steps 1.4-1.8x slower
(bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASELINE = "621f403"  # main before issue 40's chunked log-probs, activation checkpointing and fp32 masters
SMOLLM2_DIR = ROOT / ".cache/models/smollm2-135m-instruct-float32"
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
SAMPLE, RESPONSE = 512, 128
VARIANTS = {"before": {}, "chunked": {}, "ac": {"learner.activation_checkpointing": True},
            "bf16": {"learner.activation_checkpointing": True, "model.dtype": "bfloat16"},
            "lora": {"learner.lora.rank": 16}, "lora_ac": {"learner.lora.rank": 16, "learner.activation_checkpointing": True}}
# each variant also as "<variant>@mmap1": glibc's mmap threshold fixed at 1 MiB (learner.cpu_mmap_threshold_mib)
VARIANTS.update({f"{k}@mmap1": {**v, "learner.cpu_mmap_threshold_mib": 1} for k, v in list(VARIANTS.items()) if k != "before"})


def smollm2_dir(tmp: Path) -> Path:
    """The converted SmolLM2 folder, or a random-init model of its shape written under ``tmp``."""
    if (SMOLLM2_DIR / "config.json").is_file():
        return SMOLLM2_DIR
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp / "smollm2-shape"
    if not (out / "config.json").is_file():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2)).save_pretrained(out)
    return out


def synthetic_batch(vocab: int, budget: int, seed: int = 0):
    """One full micro-batch at ``budget`` of SAMPLE-token samples (RESPONSE of them with loss)."""
    import numpy as np

    from services.learner.samples import Sample, pack

    rng = np.random.default_rng(seed)
    per_mb = max(1, budget // SAMPLE)
    samples = [Sample(rng.integers(0, vocab, SAMPLE - RESPONSE), rng.integers(0, vocab, RESPONSE),
                      advantages=rng.normal(size=RESPONSE).astype(np.float32),
                      logprobs=np.full(RESPONSE, -2.0, np.float32), group=i)
               for i in range(per_mb)]
    return pack(samples)


def baseline_worker(commit: str):
    """``LearnerWorker`` of ``services/learner/worker.py`` at ``commit``, loaded as its own module."""
    src = subprocess.check_output(["git", "show", f"{commit}:services/learner/worker.py"], cwd=ROOT, text=True)
    mod = types.ModuleType("baseline_worker")
    mod.__file__ = f"{commit}:services/learner/worker.py"
    exec(compile(src, mod.__file__, "exec"), mod.__dict__)
    return mod.LearnerWorker


def child(args) -> dict:
    """One configuration in this (fresh) process: two steps, then the numbers as a dict."""
    import torch
    from transformers import AutoConfig

    from services.common.codec import encode
    from services.config import load_config
    from services.common.model_io import model_dtype
    from services.learner.memory import estimate_peak, heap_kept
    from services.learner.worker import LearnerWorker

    overrides = {"learner.micro_token_budget": args.budget, "learner.threads": args.threads,
                 "learner.world_size": 1, **VARIANTS[args.variant]}
    cfg = load_config(args.config, [f"{k}={v}" for k, v in overrides.items()])
    hf = AutoConfig.from_pretrained(args.model)
    est = estimate_peak(hf, cfg.learner, 1, model_dtype(cfg.model.dtype), cfg.learner.kl_coef > 0,
                        heap_kept=heap_kept(cfg.learner, "cpu"))
    cls = baseline_worker(args.baseline) if args.variant == "before" else LearnerWorker
    w = cls(0, 1, cfg.model_dump(mode="json"), args.model)
    w.join(*w.store_address())
    payload = encode(synthetic_batch(hf.vocab_size, args.budget))
    tokens = max(1, args.budget // SAMPLE) * SAMPLE
    times = []
    try:
        w.train_step(payload)  # warm-up; allocates AdamW's state, so the next steps reach the peak
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            m = w.train_step(payload)
            times.append(time.perf_counter() - t0)
    finally:
        w.shutdown()
    dt = statistics.median(times)
    return {"peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "tokens_s": tokens / dt,
            "step_s": dt, "est_gb": est["total"] / 2**30, "pg_loss": m["pg_loss"], "threads": torch.get_num_threads()}


def run_child(model: str, budget: int, variant: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--budget", str(budget), "--variant", variant,
           "--threads", str(args.threads), "--repeats", str(args.repeats), "--baseline", args.baseline,
           "--config", args.config]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        why = "killed (out of memory?)" if p.returncode < 0 else p.stderr.strip().splitlines()[-1:]
        return {"error": f"rc {p.returncode}: {why}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 2048, 4096], help="micro-batch token budgets")
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    ap.add_argument("--variants", nargs="+", default=["before", "chunked", "ac"], choices=list(VARIANTS))
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the learner rank")
    ap.add_argument("--repeats", type=int, default=1, help="timed steps after the warm-up step (median)")
    ap.add_argument("--baseline", default=BASELINE, help="git commit whose worker is the 'before' variant")
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0

    from services.config import load_config
    from services.world.build import build_world

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {"tiny": str(build_world(load_config(args.config), progress=False) / "model")}
        if "smollm2" in args.models:
            dirs["smollm2"] = str(smollm2_dir(Path(tmp)))
        for name in args.models:
            for budget in args.budgets:
                for variant in args.variants:
                    r = run_child(dirs[name], budget, variant, args)
                    rows.append((name, budget, variant, r))
                    print(f"  {name} {budget} {variant}: {r}", flush=True)
    print(f"\nlearner memory bench (W=1, gloo, {args.threads} threads, {os.cpu_count()} CPUs; samples of {SAMPLE} "
          f"tokens, {RESPONSE} with loss; peak = RSS high-water of the rank's process)")
    print(f"{'model':9s}{'budget':>7s}  {'variant':9s}{'peak GB':>9s}{'est GB':>8s}{'tokens/s':>10s}{'step s':>8s}")
    for name, budget, variant, r in rows:
        if "error" in r:
            print(f"{name:9s}{budget:7d}  {variant:9s}  {r['error']}")
            continue
        print(f"{name:9s}{budget:7d}  {variant:9s}{r['peak_gb']:9.2f}{r['est_gb']:8.2f}{r['tokens_s']:10.1f}"
              f"{r['step_s']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
