"""Log-probs of the target tokens without the whole vocabulary's logits at once.

A plain ``model(ids).logits`` holds [B, T, V] logits (and their fp32 copy, the log-softmax and, in the
backward, its gradient): at an 8,192-token micro-batch and V = 49,152 that is 1.6 GB a copy. Here the
decoder body runs once (hidden states [B, T, H]), then the output head runs over the positions that
are asked for (``rows``, the loss positions by default) in chunks of ``chunk_tokens``: logits of one
chunk at a time, each chunk under ``torch.utils.checkpoint`` when gradients are on, so the backward
recomputes one chunk's logits at a time instead of keeping every chunk's.

    lp, ent = token_logprobs(model, mb, with_entropy=True, chunk_tokens=1024)   # [B, T] each

Under FSDP2 the embedding, final norm and (tied) output head are the root module's parameters, which
``fully_shard`` all-gathers in the root's forward hooks only. ``install`` registers the chunked
computation as an FSDP forward method of the root (``register_fsdp_forward_method``), so it runs
between the root's pre- and post-forward hooks like ``model.forward`` does: parameters unsharded,
mixed-precision casts applied, pre-backward hooks on its outputs (the root re-gathers its parameters
before the chunks' recomputation in the backward). A model without ``install`` (no FSDP: tests,
benches) runs the same computation directly.
"""

from __future__ import annotations

import types

import torch
from torch.utils.checkpoint import checkpoint

from services.common.model_io import target_logprobs
from services.algorithm.loss import entropy_from_logits

METHOD = "mempo_token_logprobs"


def install(model) -> None:
    """Register the chunked computation as one of ``model``'s FSDP2 forward methods (after ``fully_shard``)."""
    from torch.distributed.fsdp import register_fsdp_forward_method  # torch.distributed on use (the FSDP ranks)

    setattr(model, METHOD, types.MethodType(_chunked, model))
    register_fsdp_forward_method(model, METHOD)


def token_logprobs(model, mb, with_entropy: bool = False, chunk_tokens: int = 1024,
                   rows: torch.Tensor | None = None, temperature: float = 1.0):
    """[B, T] log p(input_ids[:, t] | input_ids[:, :t]) at the target positions ``rows`` ([B, T] bool on
    target positions, default: ``mb.loss_mask > 0``), 0 elsewhere (column 0 always: nothing predicts
    it). With ``with_entropy`` also [B, T] entropies of the distribution predicting token t at those
    positions (a metric, no gradient), else None. ``temperature`` divides the logits first (the
    distribution a rollout sampled at that temperature; learner.tempered_logprobs)."""
    if not temperature > 0:
        raise ValueError(f"log-probs need a temperature above 0, got {temperature}")
    device = next(model.parameters()).device
    rows = (mb.loss_mask > 0) if rows is None else rows.bool()
    fn = getattr(model, METHOD, None) or types.MethodType(_chunked, model)
    lp, ent = fn(mb.input_ids.to(device), mb.attention_mask.to(device), rows[:, 1:].to(device),
                 int(chunk_tokens), bool(with_entropy), float(temperature))
    lp = torch.nn.functional.pad(lp, (1, 0))
    return lp, (torch.nn.functional.pad(ent, (1, 0)) if with_entropy else None)


def _head(head, hidden: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float = 1.0):
    """One chunk: (log-probs of ``targets`` in fp32 [n], entropies [n] or an empty tensor), of the logits
    divided by ``temperature``."""
    logits = head(hidden)
    if temperature != 1.0:
        logits = logits.float() / temperature
    lp = target_logprobs(logits, targets)
    if not with_entropy:
        return lp, lp.new_zeros(0)
    with torch.no_grad():
        return lp, entropy_from_logits(logits.detach())


def _chunked(model, input_ids, attention_mask, rows, chunk_tokens: int, with_entropy: bool, temperature: float = 1.0):
    """The body once, the head in chunks of ``chunk_tokens`` positions: ([B, T-1] log-probs, [B, T-1]
    entropies or None), over target positions (``rows`` [B, T-1] bool)."""
    if getattr(model.config, "final_logit_softcapping", None) or getattr(model.config, "logit_scale", None):
        raise NotImplementedError("chunked log-probs assume logits = lm_head(hidden) (no softcapping or scaling)")
    if chunk_tokens < 1:
        raise ValueError(f"learner.logit_chunk_tokens must be at least 1, got {chunk_tokens}")
    body, head = model.get_decoder(), model.get_output_embeddings()
    hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    h = hidden[:, :-1][rows]  # [N, H]: only the asked positions go through the head
    targets = input_ids[:, 1:][rows]
    filler = h.shape[0] == 0
    if filler:  # a rank's filler micro-batch (no loss tokens, services/learner/samples.py): the head still runs,
        # on one position, and the result enters times 0, so this rank's backward reaches every parameter and
        # its FSDP reduce-scatters match the other ranks' (a backward without a graph would fail, and hang them)
        h, targets = hidden.reshape(-1, hidden.shape[-1])[:1], input_ids.reshape(-1)[:1]
    grad = torch.is_grad_enabled() and h.requires_grad
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        args = (head, h[s:s + chunk_tokens], targets[s:s + chunk_tokens], with_entropy, temperature)
        lp, ent = checkpoint(_head, *args, use_reentrant=False) if grad else _head(*args)
        lps.append(lp)
        ents.append(ent)
    shape = rows.shape
    zeros = torch.zeros(shape, dtype=torch.float32, device=h.device)
    if filler:
        return zeros + 0.0 * torch.cat(lps).sum(), (zeros if with_entropy else None)
    lp = zeros.masked_scatter(rows, torch.cat(lps)) if lps else zeros
    ent = None
    if with_entropy:
        ent = zeros.masked_scatter(rows, torch.cat(ents)) if ents else zeros
    return lp, ent
