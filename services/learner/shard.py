"""Loading and sharding the learner's models: precision, activation checkpointing, FSDP2 units.

Precision rule (``model.dtype``):
  * float32: parameters, gradients, AdamW state and compute in fp32 (CPU's "auto").
  * bfloat16 / float16: the policy is loaded in fp32 and ``fully_shard`` gets
    ``MixedPrecisionPolicy(param_dtype=<dtype>, reduce_dtype=float32)``: fp32 master weights and
    AdamW state (the sharded parameters), the forward and backward computed in <dtype> (the
    all-gathered parameters are cast), gradients reduced and accumulated in fp32. AdamW stepping
    bf16 parameters directly loses most small updates (at lr 1e-6 one step changed 2% of SmolLM2's
    weights; fp32 masters: all of them). Checkpoints hold the fp32 masters; the weights sent to
    vLLM and exported are cast to <dtype> (``LearnerWorker.full_state_dict``).
  * The frozen reference is loaded in <dtype> directly (no optimizer, no masters needed): the
    same values the policy computes with at step 0.

Activation checkpointing (``learner.activation_checkpointing``) is transformers' per-decoder-layer
gradient checkpointing (non-reentrant), enabled before ``fully_shard``: each layer keeps only its
input for the backward and recomputes the rest (the FSDP all-gather of the layer's parameters runs
again inside the recomputation).

    model = load_model(model_dir, dtype, mesh, device, frozen=False, activation_checkpointing=True)
"""

from __future__ import annotations

import torch

from services.learner.logprobs import install


def mixed_precision(dtype: torch.dtype):
    """FSDP2's policy for a compute dtype: None for fp32, else fp32 masters with ``dtype`` compute."""
    from torch.distributed.fsdp import MixedPrecisionPolicy  # torch.distributed on use (the FSDP ranks)

    if dtype == torch.float32:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def load_model(model_dir: str, dtype: torch.dtype, mesh, device: str, frozen: bool,
               activation_checkpointing: bool = False, lora=None):
    """A causal LM from ``model_dir``, sharded with ``fully_shard`` per decoder layer and then the
    root, with the chunked log-prob method installed (services/learner/logprobs.py). The trainable
    policy gets fp32 masters (module docstring); ``frozen`` loads in ``dtype``, without gradients.
    ``lora`` (``learner.lora`` with rank > 0): peft's LoRA layers are added before sharding and only
    they train (services/common/lora.py); each FSDP unit then holds frozen and trainable parameters."""
    from torch.distributed.fsdp import fully_shard  # torch.distributed on use (the FSDP ranks)
    from transformers import AutoModelForCausalLM  # transformers on use

    mp = None if frozen else mixed_precision(dtype)
    load_dtype = dtype if frozen or mp is None else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=load_dtype).to(device)
    if lora is not None and not frozen:
        from services.common.lora import add_adapters  # peft on use (the FSDP ranks)

        add_adapters(model, lora)
    if activation_checkpointing and not frozen:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # transformers checkpoints only in training mode (the configs' dropout is 0)
    kw = {"mesh": mesh, **({"mp_policy": mp} if mp is not None else {})}
    for layer in model.get_decoder().layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    install(model)
    if frozen:
        model.requires_grad_(False).eval()
    return model
