"""Warnings for settings that would quietly hurt a real pretrained model, each naming the setting and
a value that works.

    for line in lr_warnings(cfg, model_dir, sft=True):    # `mempo sft`: learner.sft_lr
        log.warning(line)

The embedded world's tiny model is trained from scratch at learning rates (3e-3 SFT, 1e-4 RL) that
overwrite what a pretrained model knows within a few steps. A model of at least ``PRETRAINED_PARAMS``
parameters is taken to be pretrained; above ``SAFE_LR`` for its phase the setting is named.
"""

from __future__ import annotations

from math import prod
from pathlib import Path

from services.common.config import MempoConfig
from services.common.model_io import checkpoint_shapes

PRETRAINED_PARAMS = 20_000_000
SAFE_LR = {"learner.sft_lr": 1e-4, "learner.lr": 2e-5}  # deploy/configs/smollm2.yaml stays below both


def param_count(model_dir: str | Path) -> int:
    """Parameters of a saved Hugging Face model, from its safetensors headers (nothing is loaded)."""
    return sum(prod(shape) for shape in checkpoint_shapes(Path(model_dir)).values())


def lr_warnings(cfg: MempoConfig, model_dir: str | Path, sft: bool) -> list[str]:
    """The learning-rate warning for this phase (SFT or RL) of a pretrained model, or none."""
    setting = "learner.sft_lr" if sft else "learner.lr"
    lr = cfg.learner.sft_lr if sft else cfg.learner.lr
    try:
        n = param_count(model_dir)
    except FileNotFoundError:
        return []
    if n < PRETRAINED_PARAMS or lr <= SAFE_LR[setting]:
        return []
    return [f"{setting}={lr:g} is high for a pretrained model of {n / 1e6:.0f}M parameters ({model_dir}): a few "
            f"steps at this rate overwrite what it knows; use {SAFE_LR[setting]:g} or lower "
            f"(deploy/configs/smollm2.yaml: {setting} for SmolLM2-135M)"]
