"""Small model-side helpers every service shares: dtype choice, chat prompt ids, weight checks.

    model_dtype("auto")                 # bfloat16 with CUDA, float32 on CPU
    chat_ids(tokenizer, messages)       # chat-template ids + the assistant generation prompt
    tensors = validate_weights(tensors, checkpoint_shapes(model_dir))   # before loading an update
"""

from __future__ import annotations

from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dtype(name: str) -> torch.dtype:
    """The config's ``model.dtype``; "auto" is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return _DTYPES[name]


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids of ``messages`` plus the assistant generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a saved HF checkpoint (read from safetensors headers)."""
    from safetensors import safe_open

    shapes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return shapes


def validate_weights(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Reject a state dict that would break a model half-way through loading it; returns the
    tensors to load (a tied ``lm_head.weight`` that ``expected`` does not list is dropped)."""
    if "lm_head.weight" in tensors and "lm_head.weight" not in expected:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"weight names differ from the checkpoint: missing {missing[:5]}, unknown {unknown[:5]}")
    for k, t in tensors.items():
        if tuple(t.shape) != expected[k]:
            raise ValueError(f"{k}: shape {tuple(t.shape)}, the checkpoint has {expected[k]}")
    return tensors
