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
               decoder layer or two, per model. With LoRA (``learner.lora``): the frozen base in fp32
               (4 bytes a parameter: it is loaded as the trainable policy is), the adapters' 16 bytes a
               parameter, and no reference copy (the KL term's reference is the base, adapters off)
  activations  what the backward keeps per token: every decoder layer's intermediates (about
               ``ACT_H`` x hidden + ``ACT_I`` x MLP width values a token a layer), or with activation
               checkpointing each layer's input plus the layer being recomputed and its backward's
               transients (``AC_LAYERS`` layers' worth: measured peaks grow ~5x one layer's activations)
  head         the chunked log-probs: ``logit_chunk_tokens`` x vocabulary fp32 logits, a few copies
  slack        what the allocator keeps beyond the live tensors (freed activations, fragments): 10%
  runtime      torch, transformers and the process itself

On CPU the resident memory is not the live tensors': under glibc's default mmap threshold (which
rises to 32 MiB after the first large frees) freed activations stay in the heap, and LoRA's smaller
states do not lower the high-water; with the threshold fixed (``learner.cpu_mmap_threshold_mib``) they
do, and every step is slower by the page faults of fresh pages (bench/README.md has both). So a CPU rank
under the default (``heap_kept``) counts LoRA as full fine-tuning with a reference; on GPU (the caching
allocator reuses its blocks) or with the threshold fixed, LoRA counts its own states.

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
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)


def model_shape(hf) -> dict:
    """Sizes of a decoder-only model from its Hugging Face config: parameters, a layer's, its linear layers."""
    h, layers, vocab = hf.hidden_size, hf.num_hidden_layers, hf.vocab_size
    inter = getattr(hf, "intermediate_size", 4 * h)
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    layer = h * head_dim * (heads + 2 * kv) + heads * head_dim * h + 3 * h * inter + 2 * h
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    root = vocab * h * (1 if tied else 2) + h
    # (inputs, outputs) of each linear layer of a decoder layer, by peft's module names (Llama, Qwen2, Mistral)
    linears = {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
               "o_proj": (heads * head_dim, h), "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    return {"h": h, "layers": layers, "vocab": vocab, "inter": inter, "layer": layer, "root": root,
            "params": root + layers * layer, "linears": linears}


def adapter_params(s: dict, lora) -> int:
    """Parameters of rank-r LoRA adapters (A: r x in, B: out x r) on the targeted linear layers of every
    decoder layer; a name outside the Llama family's counts as an MLP projection (hidden + MLP width)."""
    names = s["linears"] if lora.target_modules == "all-linear" else lora.target_modules
    return s["layers"] * lora.rank * sum(sum(s["linears"].get(n, (s["h"], s["inter"]))) for n in names)


def estimate_peak(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, budget: int | None = None,
                  activation_checkpointing: bool | None = None, heap_kept: bool = False) -> dict:
    """Estimated peak bytes of one learner rank (module docstring), by part, and their ``total``.
    ``budget`` and ``activation_checkpointing`` default to ``lc``'s. ``heap_kept``: a CPU rank under glibc's
    default mmap threshold (:func:`heap_kept`), whose resident memory holds freed activations."""
    s = model_shape(hf)
    budget = lc.micro_token_budget if budget is None else budget
    ac = lc.activation_checkpointing if activation_checkpointing is None else activation_checkpointing
    cbytes = torch.finfo(dtype).bits // 8  # compute (and reference) bytes per value
    gathered = s["root"] + 2 * s["layer"]  # unsharded copies alive at once, per model
    states = gathered * cbytes * (2 if cbytes < 4 else 1)
    if lc.lora.rank > 0 and not heap_kept:  # the base frozen in fp32, AdamW over the adapters, no reference copy
        states += (s["params"] * 4 + adapter_params(s, lc.lora) * 16) / world
    else:
        states += s["params"] * 16 / world
        if with_ref or lc.lora.rank > 0:  # LoRA with the heap kept: as full fine-tuning (module docstring)
            states += s["params"] * cbytes / world + gathered * cbytes
    per_layer = (ACT_H * s["h"] + ACT_I * s["inter"]) * cbytes  # bytes a token a layer
    act = budget * (s["layers"] * s["h"] * cbytes + AC_LAYERS * per_layer if ac else s["layers"] * per_layer)
    act += budget * s["h"] * 4 * 3  # final hidden states, the gathered loss rows, their gradient
    head = min(lc.logit_chunk_tokens, budget) * s["vocab"] * 4 * HEAD_COPIES
    parts = {"states": states, "activations": act, "head": head, "slack": SLACK * (states + act + head),
             "runtime": RUNTIME}
    return {**parts, "total": sum(parts.values()), "params": s["params"]}


def heap_kept(lc, device: str) -> bool:
    """Whether a rank's resident memory holds freed activations: on CPU under glibc's default mmap
    threshold (``learner.cpu_mmap_threshold_mib`` 0)."""
    return device == "cpu" and lc.cpu_mmap_threshold_mib == 0


def fitting_budget(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, available: float,
                   activation_checkpointing: bool, kept: bool = False) -> int | None:
    """The largest power-of-two budget (>= 64) whose estimate fits in ``available`` bytes, or None."""
    best, b = None, 64
    while b <= max(lc.micro_token_budget, 64):
        if estimate_peak(hf, lc, world, dtype, with_ref, b, activation_checkpointing, kept)["total"] <= available:
            best = b
        b *= 2
    return best


def budget_advice(hf, lc, world: int, dtype: torch.dtype, with_ref: bool, available: float,
                  kept: bool = False) -> str | None:
    """None when the estimated peak fits in ``available`` bytes; else a sentence naming the settings
    and values that fit (a smaller ``learner.micro_token_budget``, activation checkpointing).
    ``kept``: :func:`heap_kept` of the rank."""
    est = estimate_peak(hf, lc, world, dtype, with_ref, heap_kept=kept)
    if est["total"] <= available:
        return None
    ways = []
    b = fitting_budget(hf, lc, world, dtype, with_ref, available, lc.activation_checkpointing, kept)
    if b is not None:
        ways.append(f"learner.micro_token_budget={b}")
    if not lc.activation_checkpointing:
        ac = estimate_peak(hf, lc, world, dtype, with_ref, activation_checkpointing=True, heap_kept=kept)["total"]
        if ac <= available:
            ways.append(f"learner.activation_checkpointing=true (about {ac / GIB:.1f} GiB)")
        else:
            b = fitting_budget(hf, lc, world, dtype, with_ref, available, True, kept)
            if b is not None:
                ways.append(f"learner.activation_checkpointing=true with learner.micro_token_budget={b}")
    if world == 1:
        ways.append("more learner ranks (learner.world_size) to shard the weights and optimizer")
    parts = ", ".join(f"{k} {est[k] / GIB:.1f}" for k in ("states", "activations", "head", "slack", "runtime"))
    return (f"learner.micro_token_budget={lc.micro_token_budget} needs about {est['total'] / GIB:.1f} GiB per learner "
            f"rank ({parts} GiB; {est['params'] / 1e6:.0f}M parameters), {available / GIB:.1f} GiB available: "
            f"set {' or '.join(ways) if ways else 'a smaller model'}")


def fix_mmap_threshold(mib: int) -> bool:
    """Fix glibc's mmap threshold of this process at ``mib`` MiB (``mallopt(M_MMAP_THRESHOLD)``), which
    also stops glibc raising it: every freed allocation above it is unmapped at once, so the process's
    resident memory follows its live tensors. False where there is no glibc (or ``mib`` is 0)."""
    import ctypes  # glibc's mallopt, on CPU ranks only

    if mib <= 0:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mib * 2**20))


def available_bytes(device: str) -> float:
    """Memory a rank may use: free GPU memory on CUDA, else the machine's available memory."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    import psutil  # not a dependency of ours (vLLM's): on use, on CPU ranks only

    return float(psutil.virtual_memory().available)
