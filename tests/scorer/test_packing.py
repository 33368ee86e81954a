"""Prefix-shared scoring (trunk once into a KV cache, branches from the cache) equals one plain
forward per sequence (fp32, within 1e-4), at any budget, and puts each token through the model once."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.scorer.packing import Branch, naive_logprobs, tree_logprobs


@pytest.fixture(scope="module")
def model(world):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [100000, 64, 7])
def test_tree_matches_naive(model, budget):
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    trunk = rng.integers(3, vocab, 90).tolist()
    branches = [Branch(attach=a, ids=rng.integers(3, vocab, n).tolist())
                for a, n in [(90, 12), (40, 7), (1, 5), (40, 9), (63, 1)]]
    stats = {}
    packed = tree_logprobs(model, trunk, branches, token_budget=budget, stats=stats)
    for b, lp in zip(branches, packed):
        ref = naive_logprobs(model, trunk[: b.attach], b.ids)
        np.testing.assert_allclose(lp, ref, atol=1e-4)
    # each trunk token once, each branch token but its last once (the last predicts nothing)
    assert stats["tokens"] == 90 + 11 + 6 + 4 + 8
    if budget == 100000:
        assert stats["forwards"] == 2  # the trunk, then every branch from its cache
    else:
        assert stats["forwards"] > 1  # split under the budget (a history longer than it), still exact


@pytest.mark.parametrize("budget", [2048, 256, 100])
def test_long_history_with_many_blocks_matches_naive(model, budget):
    """A 16-turn-like episode: a 1,500-token history, a block every ~90 tokens, each scoring the same
    25-token continuation; plus a mem-context tree (short shared prompt, long branches)."""
    rng = np.random.default_rng(1)
    vocab = model.config.vocab_size
    trunk = rng.integers(3, vocab, 1500).tolist()
    cont = rng.integers(3, vocab, 25).tolist()
    attaches = sorted(rng.choice(np.arange(50, 1501), 16, replace=False).tolist())
    branches = [Branch(attach=a, ids=cont) for a in attaches]
    stats = {}
    packed = tree_logprobs(model, trunk, branches, token_budget=budget, stats=stats)
    for b, lp in zip(branches, packed):
        np.testing.assert_allclose(lp, naive_logprobs(model, trunk[: b.attach], b.ids), atol=1e-4)
    assert stats["tokens"] == max(attaches) + 16 * 24  # unique tokens, whatever the budget
    prompt = trunk[:60]
    mems = [Branch(attach=60, ids=rng.integers(3, vocab, int(n)).tolist() + cont) for n in rng.integers(40, 120, 12)]
    stats = {}
    packed = tree_logprobs(model, prompt, mems, token_budget=budget, stats=stats)
    for b, lp in zip(mems, packed):
        np.testing.assert_allclose(lp, naive_logprobs(model, prompt, b.ids), atol=1e-4)
    assert stats["tokens"] == 60 + sum(len(b.ids) - 1 for b in mems)


def test_bad_branches(model):
    with pytest.raises(ValueError, match="outside the trunk"):
        tree_logprobs(model, [5, 6], [Branch(attach=3, ids=[7])])
    with pytest.raises(ValueError, match="empty"):
        tree_logprobs(model, [5, 6], [Branch(attach=1, ids=[])])
