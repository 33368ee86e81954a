"""LoRA adapters of the policy (``learner.lora``), with peft's LoRA layers: trained by the learner, served
by the rollout engine and the scorer when ``learner.lora.publish`` is ``adapter``.

    add_adapters(model, cfg.learner.lora)     # in place (learner: before fully_shard): peft's LoRA layers, base frozen
    with adapters_off(model): ...             # the base policy: the KL term's reference, no second copy
    merged = merge_state(full_state, lora)    # rank 0: the base weights with the adapters folded in (HF keys)
    to_peft_folder(full_state, source, lora, out)   # a folder PeftModel.from_pretrained(base, out) loads
    adapters = adapter_state(full_state)      # the adapter tensors only: what ``publish: adapter`` sends
    check_adapters(adapters, adapter_shapes(source, lora), lora)   # a replica's check before loading them

The adapters are peft's (``get_peft_model``); the model keeps its Hugging Face class, so sharding
(services/learner/shard.py) and the chunked log-probs (services/learner/logprobs.py) see the same
modules, each targeted linear layer now a ``lora.Linear`` holding ``base_layer`` and
``lora_A``/``lora_B``. Dropout is 0: the learner's log-probs are the served policy's. ``B`` starts at
zero (peft's init), so step 0 is the base policy exactly.

A merged weight is peft's own definition, ``W + (alpha / r) * B @ A`` (no rsLoRA, no DoRA, linear
layers only): tests/learner/test_lora.py checks it against peft's ``merge_and_unload``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

ADAPTER = "default"  # peft's name of the one adapter
_LORA_KEY = re.compile(r"^(?P<mod>.+)\.lora_(?P<ab>[AB])\." + ADAPTER + r"\.weight$")


def peft_config(lora):
    """peft's LoraConfig of ``learner.lora``."""
    from peft import LoraConfig  # peft on use (the learner)

    targets = lora.target_modules if lora.target_modules == "all-linear" else list(lora.target_modules)
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")


def linear_names(model) -> list[str]:
    """The leaf names of the model's linear layers that can take an adapter (the output head excluded)."""
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and m is not head})


def check_targets(model, lora) -> None:
    """A clear error for a target module the model does not have, naming the ones it has."""
    if lora.target_modules == "all-linear":
        return
    have = linear_names(model)
    missing = [t for t in lora.target_modules if t not in have]
    if missing or not lora.target_modules:
        raise ValueError(f"learner.lora.target_modules={list(lora.target_modules)}: "
                         f"{'the model has no linear layer named ' + ', '.join(missing) if missing else 'empty'}; "
                         f"its linear layers are {have} (or use all-linear)")


def add_adapters(model, lora):
    """Put peft's LoRA layers on ``model`` in place (base frozen, adapters trainable); returns ``model``."""
    from peft import get_peft_model  # peft on use (the learner)

    check_targets(model, lora)
    peft_model = get_peft_model(model, peft_config(lora))
    inner = peft_model.base_model.model
    assert inner is model, "peft wrapped a copy of the model"
    return model


def is_adapter(name: str) -> bool:
    """A parameter or state-dict key of an adapter (``...lora_A.default.weight``)."""
    return _LORA_KEY.match(name) is not None


@contextlib.contextmanager
def adapters_off(model):
    """The base policy for the duration: every LoRA layer of ``model`` computes its base layer only."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # peft on use (the learner)

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield model
    finally:
        for m in layers:
            m.enable_adapters(True)


def merge_state(state: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """The full state dict of a model with adapters, as the plain model's: each ``X.base_layer.*`` becomes
    ``X.*`` with the adapter folded into the weight, ``W + (alpha / r) * B @ A`` (computed in fp32, cast
    back to W's dtype). The base may also come under the plain model's keys (``X.weight`` beside the
    adapters: a model folder's tensors plus published adapters). Raises if an adapter's A or B is missing."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = _LORA_KEY.match(k)
        if m:
            pairs.setdefault(m["mod"], {})[m["ab"]] = v
        elif ".base_layer." in k:
            out[k.replace(".base_layer.", ".")] = v
        else:
            out[k] = v
    scale = lora.alpha / lora.rank
    for mod, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise KeyError(f"{mod}: adapter incomplete (has {sorted(ab)})")
        key = f"{mod}.weight"
        w = out[key]
        out[key] = (w.float() + scale * (ab["B"].float() @ ab["A"].float())).to(w.dtype)
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of a state dict of the model with adapters (peft's keys, ``...lora_A.default.weight``)."""
    return {k: v for k, v in state.items() if is_adapter(k)}


def _peft_on_meta(source_dir: str, lora, dtype: torch.dtype | None = None):
    """peft's model of ``lora`` on the model of ``source_dir``, on the meta device (only the config is read)."""
    from peft import get_peft_model  # peft on use
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers on use

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source_dir), dtype=dtype)
        check_targets(base, lora)
        return get_peft_model(base, peft_config(lora))


def adapter_shapes(source_dir: str, lora) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the adapter tensors ``lora`` makes on the model of ``source_dir``."""
    model = _peft_on_meta(source_dir, lora).base_model.model
    return {k: tuple(p.shape) for k, p in model.named_parameters() if is_adapter(k)}


def check_adapters(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], lora) -> None:
    """Reject an adapter set a replica cannot load as the policy: other modules than ``learner.lora`` makes
    on this model, or another rank (an adapter trained with other settings than this replica was started
    with). The error names the settings."""
    missing, unknown = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"adapter tensors differ from what learner.lora (target_modules={lora.target_modules}) "
                         f"makes on this model: missing {missing[:3]}, unknown {unknown[:3]}")
    for k, t in tensors.items():
        if tuple(t.shape) != expected[k]:
            raise ValueError(f"{k}: shape {tuple(t.shape)}, this replica serves learner.lora.rank={lora.rank} "
                             f"(shape {expected[k]}): the learner and the replicas must run one config")


def to_peft_folder(state: dict[str, torch.Tensor], source_dir: str, lora, out_dir: str) -> str:
    """Write the adapters of ``state`` (a full state dict of the model with adapters) as a PEFT folder
    (adapter_config.json, adapter_model.safetensors) whose base is ``source_dir``: what
    ``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source_dir), out_dir)`` loads."""
    adapters = adapter_state(state)
    dtype = next(iter(adapters.values())).dtype if adapters else torch.float32
    source = str(Path(source_dir).resolve())  # the adapter's base_model_name_or_path: absolute, wherever it is read
    peft_model = _peft_on_meta(source, lora, dtype)
    missing = [k for k, p in peft_model.base_model.model.named_parameters() if is_adapter(k) and k not in adapters]
    if missing:
        raise KeyError(f"the state dict lacks adapters the config makes: {missing[:3]}")
    peft_model.base_model.model.load_state_dict(adapters, strict=False, assign=True)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def merged_policy(adapter_dir, setting: str = "model.path", cache_dir: str = ".cache/models/merged") -> Path:
    """The Hugging Face folder of a PEFT LoRA adapter folded into its base (``base_model_name_or_path``), made
    once per adapter and base (under ``cache_dir``, keyed by their bytes and path) and reused: what the
    engines and the scorer load when ``setting`` names an adapter folder. Errors name ``setting``."""
    adapter_dir = Path(adapter_dir)
    try:
        meta = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{setting}={adapter_dir}: adapter_config.json is not readable JSON ({e})") from None
    if meta.get("peft_type") != "LORA":
        raise ValueError(f"{setting}={adapter_dir}: a {meta.get('peft_type')!r} adapter; only LoRA adapters are served")
    base = Path(str(meta.get("base_model_name_or_path") or ""))
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{setting}={adapter_dir}: its base (adapter_config.json base_model_name_or_path="
                                f"{str(base)!r}) is not a model folder on this machine; set base_model_name_or_path "
                                "to the folder of the model it was trained on")
    weights = sorted(adapter_dir.glob("adapter_model.*"))
    if not weights:
        raise FileNotFoundError(f"{setting}={adapter_dir}: no adapter_model.safetensors")
    h = hashlib.sha256(str(base.resolve()).encode())
    for f in [adapter_dir / "adapter_config.json", *weights]:
        h.update(f.read_bytes())
    out = Path(cache_dir) / h.hexdigest()[:16]
    if (out / "config.json").is_file():
        return out
    from peft import PeftModel  # peft on use
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers on use

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    try:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as e:  # shapes or module names of another model
        raise ValueError(f"{setting}={adapter_dir}: the adapter does not fit its base {base} ({e})") from None
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    try:
        tmp.rename(out)  # atomic: another process merging the same adapter meanwhile made the same folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
