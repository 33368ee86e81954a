"""Prefix-shared teacher forcing: score many continuations that hang off one shared token trunk, so
the work grows with the unique tokens, not with blocks x history length.

A *tree* is a trunk (one episode's full history, or a group's system+question prompt) and branches;
branch b continues the first ``attach_b`` trunk tokens. The trunk runs through the model once, in
chunks of at most ``token_budget`` tokens that extend one KV cache (transformers' ``DynamicCache``).
As soon as the cache holds a branch's prefix, the branch is scored from the cache: branches are packed
up to the budget per forward with explicit position ids (a branch continues at ``attach_b``) and a 4D
additive mask (branch tokens see ``cache[:attach_b]`` and their own earlier tokens), and the cache is
cut back to the trunk afterwards. The first token of branch b is predicted by trunk token
``attach_b - 1``: the output head runs at just those positions of a trunk chunk, and over a forward's
kept positions 1,024 at a time (``model_io.forward_logprobs``: never a [budget, vocab] logits tensor).
So every trunk token and every branch token (but its last, which predicts nothing) goes through the
model once, whatever the budget; memory is the trunk's cache plus one forward of at most the budget.

    lps = tree_logprobs(model, trunk_ids, [Branch(attach=120, ids=cont_ids), ...], token_budget=8192)
    lps[b][j] = log p(branch_b[j] | trunk[:attach_b] + branch_b[:j])

``naive_logprobs`` is the straightforward one-sequence-per-forward computation it must match.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.model_io import forward_logprobs


BRANCH_FACTOR = 1.5


@dataclass
class Branch:
    attach: int  # trunk tokens this branch continues (>= 1)
    ids: list[int]


@torch.no_grad()
def tree_logprobs(model, trunk: list[int], branches: list[Branch], token_budget: int = 8192,
                  stats: dict | None = None) -> list[np.ndarray]:
    """Per-token log-probs of every branch (see the module docstring): each trunk token goes through
    the model once, each branch token (but its last) once.

    The trunk (up to the last attach point) runs in chunks of at most ``token_budget`` tokens that
    extend one KV cache, under the plain causal mask (attention's fast path); a chunk keeps logits
    only where a branch's first token is predicted. The branches whose prefix the chunk completed
    then run from the cache, packed up to the budget per forward, each attending to the trunk up to
    its attach point and causally to itself; their entries are cut from the cache afterwards, so it
    only ever holds the trunk. (One forward with the chunk and its branches under a single 4D mask
    puts the same tokens through the model but was ~1.1-1.2x slower on CPU: a custom mask leaves
    the causal fast path.)"""
    from transformers import DynamicCache  # transformers on use

    for b in branches:
        if not 1 <= b.attach <= len(trunk):
            raise ValueError(f"branch attach point {b.attach} is outside the trunk (length {len(trunk)})")
        if not b.ids:
            raise ValueError("empty branch")
    if token_budget < 1:
        raise ValueError("token_budget must be at least 1")
    result: list[np.ndarray] = [np.zeros(len(b.ids), np.float32) for b in branches]
    order = sorted(range(len(branches)), key=lambda i: branches[i].attach)
    t = branches[order[-1]].attach if branches else 0
    cache = DynamicCache(config=model.config)
    done, nxt = 0, 0  # trunk tokens in the cache; next branch (in ``order``) to score
    while done < t:
        end = min(t, done + token_budget)
        ready = [i for i in order[nxt:] if branches[i].attach <= end]  # their prefix is complete after this chunk
        nxt += len(ready)
        _forward(model, cache, done, trunk[done:end], branches, ready, [], result, stats)  # plain causal: fast path
        done = end
        # a forward of q branch tokens attends over done + q keys under a dense mask, so branch tokens
        # cost ~(done + q) each: forwards of about the trunk's length (BRANCH_FACTOR x) keep that near
        # 2 x done rather than done + budget (a short shared prompt with many long memory blocks)
        longest = max((len(branches[i].ids) for i in ready), default=1)
        per_forward = min(token_budget, max(int(BRANCH_FACTOR * done), longest))
        for group in _branch_groups([i for i in ready if len(branches[i].ids) > 1], branches, per_forward):
            _forward(model, cache, done, [], branches, [], group, result, stats)
    return result


def _branch_groups(order: list[int], branches: list[Branch], budget: int) -> list[list[int]]:
    """Branches (in ``order``) cut into forwards of at most ``budget`` tokens (one branch at least)."""
    groups, cur, used = [], [], 0
    for i in order:
        n = len(branches[i].ids) - 1
        if cur and used + n > budget:
            groups.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    return groups + ([cur] if cur else [])


def _forward(model, cache, done: int, chunk: list[int], branches: list[Branch], first: list[int], group: list[int],
             result: list[np.ndarray], stats: dict | None) -> None:
    """One forward of either a trunk ``chunk`` (tokens ``done..done+len(chunk)``, kept in the cache,
    under the model's own causal mask) or the branches of ``group`` (all tokens but their last, at
    positions ``attach + j``, each seeing ``cache[:attach]`` and itself; cut from the cache
    afterwards). Writes token 0 of every branch in ``first`` (predicted by trunk token attach - 1, in
    the chunk) and tokens 1.. of every branch in ``group`` into ``result``."""
    assert not (chunk and group), "a forward holds a trunk chunk or branches, not both"
    p = next(model.parameters())
    device, dtype = p.device, p.dtype
    c = len(chunk)
    lengths = [len(branches[i].ids) - 1 for i in group]
    q = c + sum(lengths)
    if q == 0:
        return
    mask = None  # a trunk chunk: plain causal (attention's fast path)
    ids, pos, off = list(chunk), list(range(done, done + c)), 0
    if group:
        neg = torch.finfo(dtype).min
        mask = torch.full((q, done + q), neg, dtype=dtype)
        causal = torch.full((max(lengths), max(lengths)), neg, dtype=dtype).triu_(1)  # 0 on and below the diagonal
        for i, n in zip(group, lengths):
            b = branches[i]
            mask[off:off + n, :b.attach] = 0  # the cached trunk up to the attach point
            mask[off:off + n, done + off:done + off + n] = causal[:n, :n]
            ids += b.ids[:-1]
            pos += range(b.attach, b.attach + n)
            off += n
    keep = [branches[i].attach - 1 - done for i in first] + list(range(c, q))
    targets = [branches[i].ids[0] for i in first] + [x for i in group for x in branches[i].ids[1:]]
    # the output head runs over the kept positions only, a chunk at a time (services/common/model_io.py);
    # a trunk chunk that predicts no branch token only fills the cache
    lp = forward_logprobs(model, torch.tensor(targets, dtype=torch.long, device=device),
                          torch.tensor(keep, dtype=torch.long, device=device),
                          input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device),
                          attention_mask=None if mask is None else mask[None, None].to(device), past_key_values=cache,
                          use_cache=True).cpu().numpy()
    if q > c:
        cache.crop(-(q - c))  # the branches leave the cache; the trunk stays
    if stats is not None:
        stats["forwards"] = stats.get("forwards", 0) + 1
        stats["tokens"] = stats.get("tokens", 0) + q
    if not keep:
        return
    for k, i in enumerate(first):
        result[i][0] = lp[k]
    off = len(first)
    for i, n in zip(group, lengths):
        result[i][1:] = lp[off:off + n]
        off += n


@torch.no_grad()
def naive_logprobs(model, context: list[int], continuation: list[int], stats: dict | None = None) -> np.ndarray:
    """log p(continuation[j] | context + continuation[:j]) with one plain forward of the sequence."""
    device = next(model.parameters()).device
    ids = torch.tensor([context + continuation], device=device)
    keep = torch.arange(len(context) - 1, ids.shape[1] - 1, device=device)
    lp = forward_logprobs(model, torch.tensor(continuation, device=device), keep, input_ids=ids, use_cache=False)
    if stats is not None:
        stats["forwards"] = stats.get("forwards", 0) + 1
        stats["tokens"] = stats.get("tokens", 0) + ids.shape[1]
    return lp.cpu().numpy()
