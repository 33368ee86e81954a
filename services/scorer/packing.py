"""Prefix-shared teacher forcing: score many continuations that hang off one shared token trunk in
a single forward pass, so the work grows with unique tokens, not with blocks x history length.

A *tree* is a trunk (e.g. one episode's full history, or a group's system+question prompt) and
branches; branch b hangs off the first ``attach_b`` trunk tokens. The packed sequence is the trunk
followed by every branch, with explicit position ids (a branch continues at ``attach_b``) and a 4D
additive attention mask: trunk tokens attend causally within the trunk, branch tokens attend to
``trunk[:attach_b]`` and causally within their own branch. The log-prob of branch token j is read
at the packed position that precedes it in its own sequence (trunk token ``attach_b - 1`` for
j = 0), and only those positions get logits (``logits_to_keep``). Trees larger than the token
budget are split into several forwards, each repeating only the trunk prefix it needs.

    lps = tree_logprobs(model, trunk_ids, [Branch(attach=120, ids=cont_ids), ...], token_budget=8192)
    lps[b][j] = log p(branch_b[j] | trunk[:attach_b] + branch_b[:j])

``naive_logprobs`` is the straightforward one-sequence-per-forward computation it must match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.model_io import target_logprobs

TRUNK_FACTOR = 3


@dataclass
class Branch:
    attach: int  # trunk tokens this branch continues (>= 1)
    ids: list[int]


def _chunks(trunk_len: int, branches: list[Branch], budget: int) -> list[list[int]]:
    """Branch indices per forward: sorted by attach point, greedily filled up to the budget."""
    order = sorted(range(len(branches)), key=lambda i: branches[i].attach)
    chunks, cur, cur_len = [], [], 0
    for i in order:
        need = len(branches[i].ids)
        trunk_need = max([branches[j].attach for j in cur] + [branches[i].attach])
        if cur and trunk_need + cur_len + need > budget:
            chunks.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len += need
    if cur:
        chunks.append(cur)
    return chunks


def pack(trunk: list[int], branches: list[Branch], dtype=torch.float32):
    """(input_ids [1, L], position_ids [1, L], additive mask [1, 1, L, L], predictor index per
    branch token, as one flat LongTensor in branch order)."""
    t = max(b.attach for b in branches)
    total = t + sum(len(b.ids) for b in branches)
    neg = torch.finfo(dtype).min
    mask = torch.full((total, total), neg, dtype=dtype)
    longest = max([t] + [len(b.ids) for b in branches])
    causal = torch.full((longest, longest), neg, dtype=dtype).triu_(1)  # 0 on and below the diagonal
    mask[:t, :t] = causal[:t, :t]
    ids, pos, predictors = list(trunk[:t]), list(range(t)), []
    off = t
    for b in branches:
        n = len(b.ids)
        ids += b.ids
        pos += range(b.attach, b.attach + n)
        mask[off:off + n, :b.attach] = 0
        mask[off:off + n, off:off + n] = causal[:n, :n]
        predictors += [b.attach - 1] + list(range(off, off + n - 1))
        off += n
    return torch.tensor([ids]), torch.tensor([pos]), mask[None, None], torch.tensor(predictors, dtype=torch.long)


def _gather_logprobs(model, input_ids, position_ids, mask, predictors, targets) -> torch.Tensor:
    device = next(model.parameters()).device
    out = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                attention_mask=mask.to(device), logits_to_keep=predictors.to(device), use_cache=False)
    return target_logprobs(out.logits[0], targets).cpu()  # logits [len(predictors), V]


@torch.no_grad()
def tree_logprobs(model, trunk: list[int], branches: list[Branch], token_budget: int = 8192,
                  stats: dict | None = None) -> list[np.ndarray]:
    """Per-token log-probs of every branch (see the module docstring)."""
    for b in branches:
        if not 1 <= b.attach <= len(trunk):
            raise ValueError(f"branch attach point {b.attach} is outside the trunk (length {len(trunk)})")
        if not b.ids:
            raise ValueError("empty branch")
    dtype = next(model.parameters()).dtype
    result: list[np.ndarray] = [np.zeros(0, np.float32)] * len(branches)
    # Attention under a dense tree mask costs ~L^2, so packing k branches of length n on a trunk of
    # length t costs ~(t + k n)^2 / k per branch: best near L = 2t. Short trunks (the mem contexts'
    # shared prompt) thus get small chunks; long ones (a full history) keep their branches together.
    t = max(b.attach for b in branches)
    budget = min(token_budget, max(TRUNK_FACTOR * t, t + max(len(b.ids) for b in branches)))
    for chunk in _chunks(len(trunk), branches, budget):
        sub = [branches[i] for i in chunk]
        input_ids, position_ids, mask, predictors = pack(trunk, sub, dtype)
        targets = torch.tensor([t for b in sub for t in b.ids], dtype=torch.long)
        lp = _gather_logprobs(model, input_ids, position_ids, mask, predictors, targets).numpy()
        if stats is not None:
            stats["forwards"] = stats.get("forwards", 0) + 1
            stats["tokens"] = stats.get("tokens", 0) + input_ids.shape[1]
        off = 0
        for i, b in zip(chunk, sub):
            result[i] = lp[off:off + len(b.ids)].astype(np.float32)
            off += len(b.ids)
    return result


@torch.no_grad()
def naive_logprobs(model, context: list[int], continuation: list[int], stats: dict | None = None) -> np.ndarray:
    """log p(continuation[j] | context + continuation[:j]) with one plain forward of the sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([context + continuation], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(context) - 1:-1].float()
    if stats is not None:
        stats["forwards"] = stats.get("forwards", 0) + 1
        stats["tokens"] = stats.get("tokens", 0) + ids.shape[1]
    return target_logprobs(logits, torch.tensor(continuation)).cpu().numpy()
