"""SFT throughput: training tokens/s of the pipeline's SFT step (``mempo sft``: the learner group's
FSDP worker, W=1, padded length-sorted micro-batches) against two plain single-process PyTorch loops
on the same steps' samples, the same model, loss and optimizer, measured in one run:

* plain padded: the same micro-batches (``learner.micro_token_budget``), no Ray, no FSDP;
* learner worker, no Ray: the pipeline's FSDP worker built in this process (W=1), which separates
  the worker's own cost from Ray's;
* plain packed: each micro-batch's samples first-fit into rows as long as its longest sample,
  position ids restarting at every sample and a block-diagonal causal mask (the same loss, less
  padding; dense attention over a row, as CPU attention has no varlen kernel).

Tokens/s counts every token of every sample (context + response), padding left out. Pretraining
needs no bench of its own: services/world/pretrain.py already is a plain packed loop (one process,
documents joined into fixed blocks); its tokens/s is printed from the world's build log.

    .venv/bin/python bench/sft.py [--config deploy/configs/tiny.yaml] [--steps 4] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def timed_after_warmup(step, items) -> float:
    """Run ``step`` on the first item (warm-up), then seconds for the rest."""
    step(items[0])
    t0 = time.perf_counter()
    for item in items[1:]:
        step(item)
    return time.perf_counter() - t0


def step_batches(cfg, samples, steps: int):
    """The first ``steps`` + 1 SFT batches (one warm-up), drawn as `mempo sft` draws its first epoch
    (one seeded shuffle; this wraps around instead of reshuffling when the steps outrun the samples)."""
    from services.pipeline.sft import sft_batch

    rng, order, out = random.Random(cfg.train.seed), list(range(len(samples))), []
    rng.shuffle(order)
    per = cfg.train.sft_batch_size
    for step in range(steps + 1):
        chosen = [samples[order[(step * per + i) % len(order)]] for i in range(per)]
        out.append(sft_batch(chosen, step + 1))
    return out


def packed_rows(mb):
    """A padded micro-batch re-packed: its samples first-fit into rows no longer than its longest
    sample, each row's samples with position ids restarting and a block-diagonal causal mask, so
    the loss is the same one with less padding. Returns ids, position ids, 4D additive mask, loss mask."""
    import torch

    keep = mb.attention_mask.bool()
    lens = [int(n) for n in keep.sum(dim=1)]
    width = max(lens)
    rows: list[list[int]] = []
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        row = next((r for r in rows if sum(lens[j] for j in r) + lens[i] <= width), None)
        row.append(i) if row is not None else rows.append([i])
    ids = torch.zeros(len(rows), width, dtype=mb.input_ids.dtype)
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    doc = torch.full((len(rows), width), -1)
    loss = torch.zeros(len(rows), width, dtype=mb.loss_mask.dtype)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            n = lens[i]
            ids[r, at:at + n], loss[r, at:at + n] = mb.input_ids[i][keep[i]], mb.loss_mask[i][keep[i]]
            pos[r, at:at + n], doc[r, at:at + n] = torch.arange(n), d
            at += n
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (doc[:, :, None] == doc[:, None, :]) & (doc[:, :, None] >= 0) & causal
    allowed |= torch.eye(width, dtype=torch.bool)  # padding attends to itself (no all-masked rows)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return ids, pos, mask[:, None], loss


def plain_s(cfg, model_dir: str, batches, packed: bool) -> float:
    """Seconds for the steps after the warm-up one, every core of the machine."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.samples import micro_batches
    from services.common.model_io import target_logprobs
    from services.learner.worker import token_logprobs

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(cfg.train.seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.learner.sft_lr, weight_decay=cfg.learner.weight_decay)

    def step(tb) -> None:
        micro = micro_batches(tb, cfg.learner.micro_token_budget)
        n = float(sum(mb.loss_mask.sum() for mb in micro))
        for mb in micro:
            if packed:
                ids, pos, mask, loss_mask = packed_rows(mb)
                logits = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
                lp = torch.nn.functional.pad(target_logprobs(logits[:, :-1].float(), ids[:, 1:]), (1, 0))
            else:
                lp, _ = token_logprobs(model, mb)
                loss_mask = mb.loss_mask
            (-(lp * loss_mask).sum() / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.learner.grad_clip)
        optim.step()
        optim.zero_grad(set_to_none=True)

    return timed_after_warmup(step, batches)


def sft_config(cfg):
    """The learner settings run_sft uses on a local cluster: no reference model, every core to the rank."""
    cfg = cfg.model_copy(deep=True)
    cfg.learner.kl_coef, cfg.learner.num_cpus_per_worker = 0.0, float(os.cpu_count() or 1)
    return cfg


def worker_s(cfg, model_dir: str, batches) -> float:
    """The learner's FSDP worker (W=1) in this process: the pipeline's step without Ray."""
    from services.common.codec import encode
    from services.learner.worker import LearnerWorker

    cfg = sft_config(cfg)
    worker = LearnerWorker(0, 1, cfg.model_dump(), model_dir)
    worker.join(*worker.store_address())
    try:
        worker.set_lr(cfg.learner.sft_lr)
        return timed_after_warmup(worker.sft_step, [encode(tb) for tb in batches])
    finally:
        worker.shutdown()


def pipeline_s(cfg, model_dir: str, batches) -> float:
    from services.learner.group import LearnerGroup

    group = LearnerGroup(sft_config(cfg), model_dir, world_size=1)
    try:
        group.set_lr(cfg.learner.sft_lr)
        return timed_after_warmup(group.sft_step, batches)
    finally:
        group.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=4, help="timed SFT steps (after one warm-up step)")
    ap.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = ap.parse_args(argv)

    import ray
    from transformers import AutoTokenizer

    from services.config import load_config
    from services.common.local_ray import local_init_options
    from services.common.paths import data_path, model_path
    from services.pipeline.sft import load_transcripts, turn_samples
    from services.world.build import prepare_world

    cfg = prepare_world(load_config(args.config, args.overrides))
    source = str(model_path(cfg))
    transcripts = load_transcripts(data_path(cfg, "sft"), cfg.train.sft_min_em, cfg.rollout.system_prompt)
    samples = turn_samples(cfg, AutoTokenizer.from_pretrained(source), transcripts)
    batches = step_batches(cfg, samples, args.steps)
    tokens = sum(int(tb.cu_seqlens[-1]) for tb in batches[1:])
    ray.init(**local_init_options(num_cpus=os.cpu_count(), object_store_memory=500_000_000))
    try:
        times = {"plain packed": plain_s(cfg, source, batches, packed=True),
                 "plain padded": plain_s(cfg, source, batches, packed=False),
                 "learner worker, no Ray": worker_s(cfg, source, batches),
                 "pipeline (mempo sft, W=1)": pipeline_s(cfg, source, batches)}
    finally:
        ray.shutdown()
    print(f"\nSFT bench ({os.cpu_count()} CPUs, fp32, {args.steps} steps of {cfg.train.sft_batch_size} turns, "
          f"{tokens} tokens, micro-batches of <= {cfg.learner.micro_token_budget} tokens)")
    print(f"{'loop':28s}{'tokens/s':>10s}{'vs packed':>11s}")
    for name, s in times.items():
        print(f"{name:28s}{tokens / s:10.0f}{times['plain packed'] / s:10.2f}x")
    log = Path(source).parent / "build_log.json"
    if log.exists():
        pre = json.loads(log.read_text()).get("pretrain") or {}
        if pre.get("tokens_per_s"):
            print(f"pretraining (plain packed by construction, world build log): {pre['tokens_per_s']} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
