"""LoRA on the learner's policy (services/common/lora.py), without FSDP: peft's layers on the world's
tiny model, the merge against peft's own ``merge_and_unload``, the PEFT folder read back by peft, the
adapters switched off giving the base, and the error for a target the model lacks."""

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from services.config import load_config
from services.common import lora as L


def _lora(**kw):
    over = [f"learner.lora.{k}={v}" for k, v in {"rank": 4, "alpha": 8, **kw}.items()]
    return load_config("deploy/configs/tiny.yaml", over).learner.lora


def _with_adapters(world, lora, seed=0):
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    L.add_adapters(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B starts at zero: give every adapter a real update
        for name, p in model.named_parameters():
            if L.is_adapter(name) and ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_only_adapters_train_and_switched_off_they_give_the_base(world):
    base = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    model = _with_adapters(world, _lora())
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(L.is_adapter(n) for n in trainable)
    assert {n.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for n in trainable} == set(L.linear_names(base))
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    assert (_logits(model, ids) - _logits(base, ids)).abs().max() > 1e-3
    with L.adapters_off(model):
        torch.testing.assert_close(_logits(model, ids), _logits(base, ids), rtol=0, atol=1e-5)
    assert (_logits(model, ids) - _logits(base, ids)).abs().max() > 1e-3  # back on


def test_the_merge_is_peft_merge_and_unload(world):
    lora = _lora(target_modules="[q_proj,v_proj,down_proj]")
    model = _with_adapters(world, lora, seed=3)
    merged = L.merge_state(model.state_dict(), lora)
    # peft's own merge of the same adapters
    from peft import get_peft_model

    ref = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    peft_model = get_peft_model(ref, L.peft_config(lora))
    peft_model.base_model.model.load_state_dict(model.state_dict())
    expected = peft_model.merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for k in expected:
        torch.testing.assert_close(merged[k], expected[k], rtol=0, atol=1e-6)


def test_the_peft_folder_loads_in_peft_and_gives_the_merged_policy(world, tmp_path):
    lora = _lora()
    model = _with_adapters(world, lora, seed=5)
    out = L.to_peft_folder(model.state_dict(), str(world / "model"), lora, str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32), out)
    plain = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    plain.load_state_dict(L.merge_state(model.state_dict(), lora))
    ids = torch.randint(0, plain.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    lp_peft = torch.log_softmax(_logits(loaded, ids), -1)
    lp_merged = torch.log_softmax(_logits(plain, ids), -1)
    assert (lp_peft - lp_merged).abs().max() < 1e-4


def test_a_target_the_model_lacks_is_an_error_naming_its_linear_layers(world):
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"learner.lora.target_modules=\['c_attn'\].*q_proj"):
        L.add_adapters(model, _lora(target_modules="[c_attn]"))


def test_model_path_naming_an_adapter_folder_serves_it_merged_into_its_base(world, tmp_path, monkeypatch):
    """model.path (or --policy) may name a LoRA run's policy/adapter: the engines and the scorer load its
    base with the adapter merged in, made once and reused; an adapter whose base is not here is named."""
    import json

    from services.common.paths import is_adapter_folder, model_path

    lora = _lora()
    model = _with_adapters(world, lora, seed=6)
    adapter = L.to_peft_folder(model.state_dict(), str(world / "model"), lora, str(tmp_path / "adapter"))
    monkeypatch.chdir(tmp_path)  # the merged folder goes under ./.cache/models/merged
    assert is_adapter_folder(adapter)
    cfg = load_config(None, [f"model.path={adapter}"])
    merged = model_path(cfg)
    assert merged.parent.resolve() == tmp_path / ".cache/models/merged" and (merged / "tokenizer.json").is_file()
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert model_path(cfg) == merged and (merged / "model.safetensors").stat().st_mtime_ns == stamp  # reused
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    loaded = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert (torch.log_softmax(_logits(loaded, ids), -1) - torch.log_softmax(_logits(model, ids), -1)).abs().max() < 1e-4

    meta = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    (tmp_path / "adapter/adapter_config.json").write_text(json.dumps({**meta, "base_model_name_or_path": "/nowhere"}))
    with pytest.raises(FileNotFoundError, match=r"model.path=.*base_model_name_or_path='/nowhere'"):
        model_path(cfg)
