"""The embedded policy: a tiny Qwen2-architecture causal LM, randomly initialised from a seed.

Shapes come from ``ModelConfig`` (head_dim 64 by default: vLLM's CPU attention rejects head
dims below 32). Saved with ``save_pretrained`` (safetensors, fp32) together with the world's
tokenizer, so vLLM, transformers and the learner all load it from one local directory.

    save_tiny_model(model_cfg, tokenizer, out_dir)
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from services.config import ModelConfig


def tiny_config(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    if cfg.hidden_size != cfg.num_attention_heads * cfg.head_dim:
        raise ValueError(f"model.hidden_size ({cfg.hidden_size}) must equal num_attention_heads x head_dim "
                         f"({cfg.num_attention_heads} x {cfg.head_dim})")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError("model.num_attention_heads must be a multiple of model.num_key_value_heads")
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        rope_theta=10000.0,
        torch_dtype="float32",
    )


def save_tiny_model(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, out_dir: Path) -> Path:
    """Create the model from ``cfg.seed`` and save model + tokenizer to ``out_dir``."""
    config = tiny_config(cfg, tokenizer)
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    GenerationConfig(eos_token_id=eos, pad_token_id=eos[1], bos_token_id=eos[1]).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
