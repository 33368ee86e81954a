"""Test asset: the world's tiny model taught the MemPO turn grammar by a short SFT on oracle turns.

A randomly initialised model never writes ``<mem>`` or ``<search>``, so the rollout tests would
never see a memory span or a search. A couple of hundred AdamW steps of plain next-token training
on the oracle's memory-mode turns (context = system + question + previous turn) are enough for the
tiny model to produce the grammar. The result is cached on disk by world key and step count.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def memory_mode_samples(world: Path, tok) -> list[tuple[list[int], list[int]]]:
    samples = []
    for line in open(world / "oracle.jsonl"):
        msgs = json.loads(line)["messages"]
        for i in range(2, len(msgs), 2):
            ctx = msgs[:2] + (msgs[i - 2:i] if i >= 4 else [])
            prompt = tok.apply_chat_template(ctx, add_generation_prompt=True, tokenize=False)
            samples.append((tok.encode(prompt, add_special_tokens=False),
                            tok.encode(msgs[i]["content"], add_special_tokens=False)))
    return samples


def grammar_model(world: Path, cache: Path, steps: int = 200, batch: int = 16, lr: float = 3e-3) -> Path:
    out = cache / f"{world.name}-sft{steps}"
    if (out / "model.safetensors").is_file():
        return out
    torch.manual_seed(0)
    rng = random.Random(0)
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    samples = memory_mode_samples(world, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        chosen = rng.sample(samples, batch)
        length = max(len(a) + len(b) for a, b in chosen)
        ids = torch.full((batch, length), tok.pad_token_id)
        labels = torch.full((batch, length), -100)
        mask = torch.zeros((batch, length), dtype=torch.long)
        for j, (a, b) in enumerate(chosen):
            ids[j, : len(a) + len(b)] = torch.tensor(a + b)
            mask[j, : len(a) + len(b)] = 1
            labels[j, len(a) : len(a) + len(b)] = torch.tensor(b)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.copy(world / "model" / "generation_config.json", tmp / "generation_config.json")
    tmp.rename(out)
    return out
