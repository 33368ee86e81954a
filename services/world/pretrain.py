"""Language-model pretraining of the embedded tiny model on the world's own text.

A real MemPO run starts from a pretrained base (Qwen2.5), which can already copy a name it has just
read. The embedded tiny model starts from random weights, and SFT on oracle turns alone teaches it
the turn grammar but not to copy: it writes plausible names it memorised instead of the question's
(docs/experiments.md has the figures). A short causal-LM stage on the world's passages and oracle
transcripts, where every name repeats within a few hundred tokens, is what builds that skill. It
runs once per world, inside ``mempo world build``, when ``world.pretrain_tokens > 0``, and the
result is the world's ``model/`` (the base the SFT cold start begins from).

    stats = pretrain(model_dir, texts, cfg.world)   # trains in place, saves back to model_dir

Plain single-process PyTorch: documents are tokenised, joined with ``<|endoftext|>`` and cut into
fixed-length blocks (no padding); AdamW with linear warm-up and cosine decay; same seed, same
blocks, same order.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from services.config import WorldConfig


def pack_blocks(docs: list[list[int]], sep: int, seq_len: int, seed: int) -> np.ndarray:
    """Shuffle the documents, join them with ``sep`` and cut [n, seq_len] blocks (the tail is dropped)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    stream = np.fromiter((t for i in order for t in [*docs[i], sep]), dtype=np.int64)
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"the pretraining text has {len(stream)} tokens, fewer than one block of {seq_len}")
    return stream[: n * seq_len].reshape(n, seq_len)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to ``peak``, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def pretrain(model_dir: Path, texts: list[str], cfg: WorldConfig, progress: bool = True) -> dict:
    """Train the model saved in ``model_dir`` for ``cfg.pretrain_tokens`` tokens; save it back."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers on use

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    blocks = pack_blocks(docs, tokenizer.pad_token_id, cfg.pretrain_seq_len, cfg.seed + 5)
    rows = max(1, cfg.pretrain_batch_tokens // cfg.pretrain_seq_len)
    steps = max(1, cfg.pretrain_tokens // (rows * cfg.pretrain_seq_len))
    torch.manual_seed(cfg.seed + 5)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.pretrain_lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 20)
    perm = np.random.default_rng(cfg.seed + 5).permutation(len(blocks))
    model.train()
    t0, losses = time.perf_counter(), []
    bar = tqdm(range(steps), desc="pretrain base", unit="step", disable=not progress, leave=False)
    for step in bar:
        lr = lr_at(step, steps, cfg.pretrain_lr, warmup)
        for g in optim.param_groups:
            g["lr"] = lr
        take = [perm[(step * rows + r) % len(perm)] for r in range(rows)]
        x = torch.from_numpy(blocks[take])
        loss = model(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    model.eval()
    model.save_pretrained(model_dir, safe_serialization=True)
    seconds = time.perf_counter() - t0
    return {"steps": steps, "tokens": steps * rows * cfg.pretrain_seq_len, "blocks": int(len(blocks)),
            "epochs": round(steps * rows / len(blocks), 2), "loss_first": round(float(np.mean(losses[:20])), 4),
            "loss_last": round(float(np.mean(losses[-20:])), 4), "seconds": round(seconds, 1),
            "tokens_per_s": round(steps * rows * cfg.pretrain_seq_len / max(seconds, 1e-9))}
