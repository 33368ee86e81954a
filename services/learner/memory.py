"""A learner rank's peak memory, estimated from the model's shape and the learner settings, and the
warning a rank logs at start when the micro-batch token budget will not fit.

    est = estimate_peak(hf_config, cfg.learner, world, dtype, with_ref=cfg.learner.kl_coef > 0)
    est["total"]                      # bytes; est also holds the parts ("states", "activations", ...)
    msg = budget_advice(hf_config, cfg.learner, world, dtype, with_ref, available_bytes)   # None if it fits

The estimate is a rule of thumb, fitted to measured peaks (``bench/learner_memory.py``: the tiny
model and SmolLM2-135M, CPU, fp32 and bf16, budgets 1,024-8,192: from 2% under to 20% over the
measured RSS high-water); it counts:

  states       fp32 master weights, gradients and AdamW's two moments of the policy (16 bytes a
               parameter, sharded over the W ranks), the frozen reference in ``model.dtype``, and the
               all-gathered (unsharded) copies FSDP2 keeps: the root unit (embeddings, head) and a
               decoder layer or two, per model. LoRA (``learner.lora``) is counted as full fine-tuning
               with a reference: its states should be 4 bytes a base parameter and 16 an adapter
               parameter, no reference copy, but the measured peaks of SmolLM2-135M at 4,096 tokens
               (bench/learner_memory.py: lora 11.5 GB against full 10.6 GB, lora_ac 5.4 against ac 5.6)
               show no such saving, and an estimate under the peak would not warn before an OOM kill
  activations  what the backward keeps per token: every decoder layer's intermediates (about
               ``ACT_H`` x hidden + ``ACT_I`` x MLP width values a token a layer), or with activation
               checkpointing each layer's input plus the layer being recomputed and its backward's
               transients (``AC_LAYERS`` layers' worth: measured peaks grow ~5x one layer's activations)
  head         the chunked log-probs: ``logit_chunk_tokens`` x vocabulary fp32 logits, a few copies
  slack        what the allocator keeps beyond the live tensors (freed activations, fragments): 10%
  runtime      torch, transformers and the process itself

A micro-batch is at most ``micro_token_budget`` padded tokens, except a single sample longer than the
budget, which runs alone: the estimate is for a full micro-batch.
"""

from __future__ import annotations

import torch

ACT_H, ACT_I = 12.0, 4.0  # values kept per token per decoder layer, in units of hidden and MLP width (fitted)
AC_LAYERS = 5.0  # activation checkpointing: the layer recomputed and its backward, in layers' worth (fitted)
SLACK = 0.1  # what the allocator holds beyond the live tensors (freed activations, fragments), a share of them
HEAD_COPIES = 4  # chunk x vocab fp32 tensors alive at once in a chunk's backward (logits, log-softmax, grads)
RUNTIME = 0.6 * 2**30  # bytes: the interpreter, torch, transformers, gloo (measured: the tiny model's rank)
GIB = 2**30


def _shape(hf) -> dict:
    h, layers, vocab = hf.hidden_size, hf.num_hidden_layers, hf.vocab_size
    inter = getattr(hf, "intermediate_size", 4 * h)
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * inter + 2 * h
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    root = vocab * h * (1 if tied else 2) + h
    return {"h": h, "layers": layers, "vocab": vocab, "inter": inter, "layer": layer, "root": root,
            "params": root + layers * layer}


def estimate_peak(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, budget: int | None = None,
                  activation_checkpointing: bool | None = None) -> dict:
    """Estimated peak bytes of one learner rank (module docstring), by part, and their ``total``.
    ``budget`` and ``activation_checkpointing`` default to ``lc``'s."""
    s = _shape(hf)
    budget = lc.micro_token_budget if budget is None else budget
    ac = lc.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    cbytes = torch.finfo(dtype).bits // 8  # compute (and reference) bytes per value
    gathered = s["root"] + 2 * s["layer"]  # unsharded copies alive at once, per model
    # LoRA is counted as full fine-tuning, reference included: an upper bound (module docstring)
    states = s["params"] * 16 / world + gathered * cbytes * (2 if cbytes < 4 else 1)
    if with_ref or lc.lora.rank > 0:
        states += s["params"] * cbytes / world + gathered * cbytes
    per_layer = (ACT_H * s["h"] + ACT_I * s["inter"]) * cbytes  # bytes a token a layer
    act = budget * (s["layers"] * s["h"] * cbytes + AC_LAYERS * per_layer if ac else s["layers"] * per_layer)
    act += budget * s["h"] * 4 * 3  # final hidden states, the gathered loss rows, their gradient
    head = min(lc.logit_chunk_tokens, budget) * s["vocab"] * 4 * HEAD_COPIES
    parts = {"states": states, "activations": act, "head": head, "slack": SLACK * (states + act + head),
             "runtime": RUNTIME}
    return {**parts, "total": sum(parts.values()), "params": s["params"]}


def fitting_budget(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, available: float,
                   activation_checkpointing: bool) -> int | None:
    """The largest power-of-two budget (>= 64) whose estimate fits in ``available`` bytes, or None."""
    best, b = None, 64
    while b <= max(lc.micro_token_budget, 64):
        if estimate_peak(hf, lc, world, dtype, with_ref, b, activation_checkpointing)["total"] <= available:
            best = b
        b *= 2
    return best


def budget_advice(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, available: float) -> str | None:
    """None when the estimated peak fits in ``available`` bytes; else a sentence naming the settings
    and values that fit (a smaller ``learner.micro_token_budget``, activation checkpointing)."""
    est = estimate_peak(hf, lc, world, dtype, with_ref)
    if est["total"] <= available:
        return None
    ways = []
    b = fitting_budget(hf, lc, world, dtype, with_ref, available, lc.activation_checkpointing)
    if b is not None:
        ways.append(f"learner.micro_token_budget={b}")
    if not lc.activation_checkpointing:
        ac = estimate_peak(hf, lc, world, dtype, with_ref, activation_checkpointing=True)["total"]
        if ac <= available:
            ways.append(f"learner.activation_checkpointing=true (about {ac / GIB:.1f} GiB)")
        else:
            b = fitting_budget(hf, lc, world, dtype, with_ref, available, True)
            if b is not None:
                ways.append(f"learner.activation_checkpointing=true with learner.micro_token_budget={b}")
    if world == 1:
        ways.append("more learner ranks (learner.world_size) to shard the weights and optimizer")
    parts = ", ".join(f"{k} {est[k] / GIB:.1f}" for k in ("states", "activations", "head", "slack", "runtime"))
    return (f"learner.micro_token_budget={lc.micro_token_budget} needs about {est['total'] / GIB:.1f} GiB per learner "
            f"rank ({parts} GiB; {est['params'] / 1e6:.0f}M parameters), {available / GIB:.1f} GiB available: "
            f"set {' or '.join(ways) if ways else 'a smaller model'}")


def available_bytes(device: str) -> float:
    """Memory a rank may use: free GPU memory on CUDA, else the machine's available memory."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    import psutil  # not a dependency of ours (vLLM's): on use, on CPU ranks only

    return float(psutil.virtual_memory().available)
