"""Prefix-shared packed scoring equals one plain forward per sequence (fp32, within 1e-4)."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from services.scorer.packing import Branch, naive_logprobs, tree_logprobs


@pytest.fixture(scope="module")
def model(world):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32).eval()


@pytest.mark.parametrize("budget", [100000, 64])
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
    if budget == 64:
        assert stats["forwards"] > 1  # split under the budget, still exact
    else:
        assert stats["forwards"] == 1 and stats["tokens"] == 90 + 12 + 7 + 5 + 9 + 1


def test_bad_branches(model):
    with pytest.raises(ValueError, match="outside the trunk"):
        tree_logprobs(model, [5, 6], [Branch(attach=3, ids=[7])])
    with pytest.raises(ValueError, match="empty"):
        tree_logprobs(model, [5, 6], [Branch(attach=1, ids=[])])
