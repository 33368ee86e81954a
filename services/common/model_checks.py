"""Checks of a model folder and warnings for settings that would quietly hurt a real pretrained model,
each naming the setting and a value that works.

    check_model(model_dir)                                # before a stage starts: what cannot be served
    for line in lr_warnings(cfg, model_dir, sft=True):    # `mempo sft`: learner.sft_lr
        log.warning(line)

``check_model`` fails early, naming ``model.path`` (or the setting given), on a folder that is not a
Hugging Face causal LM with safetensors weights and a tokenizer, rather than deep inside a replica.

The embedded world's tiny model is trained from scratch at learning rates (3e-3 SFT, 1e-4 RL) that
overwrite what a pretrained model knows within a few steps. A model of at least ``PRETRAINED_PARAMS``
parameters is taken to be pretrained; above ``SAFE_LR`` for its phase the setting is named.
"""

from __future__ import annotations

import json
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.model_io import checkpoint_shapes

if TYPE_CHECKING:  # the composed config lives above common (services/config.py)
    from services.config import MempoConfig

PRETRAINED_PARAMS = 20_000_000
SAFE_LR = {"learner.sft_lr": 1e-4, "learner.lr": 2e-5}  # deploy/configs/smollm2.yaml stays below both


def param_count(model_dir: str | Path) -> int:
    """Parameters of a saved Hugging Face model, from its safetensors headers (nothing is loaded)."""
    return sum(prod(shape) for shape in checkpoint_shapes(Path(model_dir)).values())


def lr_warnings(cfg: MempoConfig, model_dir: str | Path, sft: bool) -> list[str]:
    """The learning-rate warning for this phase (SFT or RL) of a pretrained model, or none."""
    setting = "learner.sft_lr" if sft else "learner.lr"
    lr = cfg.learner.sft_lr if sft else cfg.learner.lr
    if cfg.learner.lora.rank > 0:  # the thresholds are full fine-tuning's; LoRA adapters train at higher rates
        return []
    try:
        n = param_count(model_dir)
    except FileNotFoundError:
        return []
    if n < PRETRAINED_PARAMS or lr <= SAFE_LR[setting]:
        return []
    return [f"{setting}={lr:g} is high for a pretrained model of {n / 1e6:.0f}M parameters ({model_dir}): a few "
            f"steps at this rate overwrite what it knows; use {SAFE_LR[setting]:g} or lower "
            f"(deploy/configs/smollm2.yaml: {setting} for SmolLM2-135M)"]


def _causal_lm_architectures() -> set[str]:
    """Class names of the causal LMs this transformers can build (the learner's and scorer's loader)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # a name table, no models

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def check_model(model_dir: str | Path, setting: str = "model.path") -> None:
    """Raise ``ValueError`` / ``FileNotFoundError`` naming ``setting`` when ``model_dir`` cannot be trained
    and served: no config.json, an architecture that is not a causal LM, no safetensors weights, no tokenizer."""
    d = Path(model_dir)
    fix = ("point it at a Hugging Face causal LM folder (`make model` writes SmolLM2-135M-Instruct to "
           ".cache/models/; `mempo model from-gguf FILE.gguf DIR` converts a GGUF file)")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{setting}={d}: no config.json there; {fix}")
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{setting}={d}: config.json is not readable JSON ({e}); {fix}") from None
    archs = config.get("architectures") or []
    known = _causal_lm_architectures()
    if not archs or not any(a in known for a in archs):
        raise ValueError(f"{setting}={d}: architecture {archs or config.get('model_type')!r} is not a causal LM "
                         f"this transformers can load (e.g. LlamaForCausalLM, Qwen2ForCausalLM, "
                         f"MistralForCausalLM); {fix}")
    if not list(d.glob("*.safetensors")):
        raise FileNotFoundError(f"{setting}={d}: no *.safetensors weights (only safetensors are loaded; "
                                f"re-save with save_pretrained(..., safe_serialization=True)); {fix}")
    if not ((d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()):
        raise FileNotFoundError(f"{setting}={d}: no tokenizer (tokenizer.json or tokenizer.model); save the "
                                f"model's tokenizer into the folder with tokenizer.save_pretrained")
