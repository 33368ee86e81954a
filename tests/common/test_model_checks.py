"""Learning rates that would wreck a pretrained model are named, with a value that works; a folder that
cannot be served fails early, naming the setting."""

import pytest
import torch
from safetensors.torch import save_file

from services.config import load_config
from services.common.model_checks import PRETRAINED_PARAMS, lr_warnings, param_count


def _model(tmp_path, params: int):
    save_file({"w": torch.zeros(params // 1000, 1000)}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_a_high_learning_rate_on_a_pretrained_model_is_named(tmp_path):
    big = _model(tmp_path, PRETRAINED_PARAMS + 1000)
    assert param_count(big) == PRETRAINED_PARAMS + 1000
    cfg = load_config("deploy/configs/tiny.yaml")  # sft_lr 3e-3, lr 1e-4: the tiny model's rates
    [sft] = lr_warnings(cfg, big, sft=True)
    assert "learner.sft_lr=0.003" in sft and "use 0.0001 or lower" in sft
    [rl] = lr_warnings(cfg, big, sft=False)
    assert "learner.lr=0.0001" in rl and "use 2e-05 or lower" in rl
    gentle = load_config("deploy/configs/tiny.yaml", ["learner.sft_lr=2e-5", "learner.lr=1e-6"])
    assert lr_warnings(gentle, big, sft=True) == [] and lr_warnings(gentle, big, sft=False) == []


def test_the_tiny_model_and_a_missing_folder_are_left_alone(tmp_path, world):
    cfg = load_config("deploy/configs/tiny.yaml")
    assert lr_warnings(cfg, world / "model", sft=True) == []
    assert lr_warnings(cfg, tmp_path / "nothing", sft=False) == []


def test_check_model_names_the_setting_and_what_is_wrong(tmp_path, world):
    import json
    import shutil

    from services.common.model_checks import check_model

    good = tmp_path / "good"
    shutil.copytree(world / "model", good)
    check_model(good)  # the world's model passes
    with pytest.raises(FileNotFoundError, match=r"model.path=.*no config.json.*make model"):
        check_model(tmp_path / "missing")
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "architectures": ["BertForMaskedLM"]}))
    with pytest.raises(ValueError, match=r"--policy rl=.*BertForMaskedLM.*not a causal LM"):
        check_model(bad, "--policy rl")
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        check_model(bad)
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        check_model(bad)
