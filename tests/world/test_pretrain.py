"""Pretraining the embedded base model on the world's text: blocks, schedule, and that it learns."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.config import load_config
from services.common.jsonl import read_jsonl
from services.world.pretrain import lr_at, pack_blocks, pretrain
from services.world.tiny_model import save_tiny_model
from services.world.tokenizer import train_tokenizer


def test_pack_blocks_joins_documents_without_padding():
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    blocks = pack_blocks(docs, sep=0, seq_len=4, seed=0)
    assert blocks.shape == (3, 4)  # 12 tokens (9 + 3 separators) -> 3 blocks of 4
    flat = blocks.ravel().tolist()
    assert sorted(flat) == sorted([1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0])
    assert (pack_blocks(docs, 0, 4, seed=0) == blocks).all()  # same seed, same order
    with pytest.raises(ValueError, match="fewer than one block"):
        pack_blocks([[1]], sep=0, seq_len=8, seed=0)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


def test_pretraining_lowers_the_loss_on_world_text(world, tmp_path):
    cfg = load_config(None, ["world.pretrain_tokens=98304", "world.pretrain_seq_len=128",
                             "world.pretrain_batch_tokens=2048", "world.pretrain_lr=0.01"])
    texts = [r["contents"] for r in read_jsonl(world / "corpus.jsonl")][:300]
    tok = train_tokenizer(texts, 600)
    model_dir = save_tiny_model(cfg.model, tok, tmp_path / "model")
    probe = torch.tensor(tok(texts[0], add_special_tokens=False)["input_ids"][:64])[None]

    def loss() -> float:
        m = AutoModelForCausalLM.from_pretrained(model_dir)
        with torch.no_grad():
            return float(m(input_ids=probe, labels=probe).loss)

    before = loss()
    stats = pretrain(model_dir, texts, cfg.world, progress=False)
    assert stats["steps"] == 48 and stats["tokens"] == 48 * 2048
    assert stats["loss_last"] < stats["loss_first"] - 1.0, stats
    assert loss() < before - 1.0  # the saved model is the trained one
    assert np.isfinite(stats["tokens_per_s"])
