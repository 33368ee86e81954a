"""Chunked log-probs (services/learner/logprobs.py): the same numbers and gradients as the plain
full-vocabulary computation, with and without FSDP2, tied and untied heads, any chunk size."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen2Config, Qwen2ForCausalLM

from services.common.model_io import target_logprobs
from services.learner.logprobs import token_logprobs
from services.algorithm.loss import entropy_from_logits


def tiny(vocab: int, tied: bool = True, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied))


def micro(vocab: int, seed: int = 0) -> SimpleNamespace:
    """Three right-padded rows, a random loss mask (never on column 0 or padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 21), generator=g)
    att = torch.ones_like(ids)
    att[1, 15:] = 0
    att[2, 9:] = 0
    mask = (torch.rand(3, 21, generator=g) > 0.4).float() * att
    mask[:, 0] = 0
    return SimpleNamespace(input_ids=ids * att, attention_mask=att, loss_mask=mask)


def plain(model, mb):
    """The full computation: every position's fp32 logits at once."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
    lp = torch.nn.functional.pad(target_logprobs(logits, mb.input_ids[:, 1:]), (1, 0))
    ent = torch.nn.functional.pad(entropy_from_logits(logits.detach()), (1, 0))
    return lp, ent


def grads(model) -> dict:
    out = {}
    for n, p in model.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[n] = g.clone()
    return out


@pytest.mark.parametrize("vocab,tied,chunk", [(50, True, 1), (50, False, 7), (5000, True, 16), (5000, False, 4096)])
def test_chunked_logprobs_and_gradients_match_the_plain_computation(vocab, tied, chunk):
    mb = micro(vocab)
    ref_model, model = tiny(vocab, tied), tiny(vocab, tied)
    lp_ref, ent_ref = plain(ref_model, mb)
    (lp_ref * mb.loss_mask).sum().backward()
    lp, ent = token_logprobs(model, mb, with_entropy=True, chunk_tokens=chunk)
    (lp * mb.loss_mask).sum().backward()
    torch.testing.assert_close(lp, lp_ref * mb.loss_mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref * mb.loss_mask, rtol=0, atol=1e-5)
    assert (lp[mb.loss_mask == 0] == 0).all()
    g_ref, g = grads(ref_model), grads(model)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=1e-5, msg=n)


def test_chosen_rows_and_no_grad_mode():
    mb = micro(300)
    model = tiny(300)
    rows = mb.attention_mask.bool()
    rows[:, 0] = False
    with torch.no_grad():
        lp_ref, _ = plain(model, mb)
        lp, ent = token_logprobs(model, mb, rows=rows, chunk_tokens=5)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, lp_ref * rows, rtol=0, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_tempered_logprobs_are_those_of_the_logits_over_the_temperature(temperature):
    """learner.tempered_logprobs: log-probs, entropies and gradients of softmax(logits / T), the distribution
    a rollout sampled at temperature T (verl's actor); T = 1 is the untempered computation."""
    mb = micro(300, seed=2)
    ref_model, model = tiny(300), tiny(300)
    logits = ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float() / temperature
    lp_ref = torch.nn.functional.pad(target_logprobs(logits, mb.input_ids[:, 1:]), (1, 0))
    ent_ref = torch.nn.functional.pad(entropy_from_logits(logits.detach()), (1, 0))
    (lp_ref * mb.loss_mask).sum().backward()
    lp, ent = token_logprobs(model, mb, with_entropy=True, chunk_tokens=7, temperature=temperature)
    (lp * mb.loss_mask).sum().backward()
    torch.testing.assert_close(lp, lp_ref * mb.loss_mask, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref * mb.loss_mask, rtol=0, atol=1e-5)
    g_ref, g = grads(ref_model), grads(model)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=1e-5, msg=n)
    with torch.no_grad():
        untempered, _ = token_logprobs(model, mb)
        assert not torch.allclose(untempered, lp.detach(), atol=1e-3)
        torch.testing.assert_close(token_logprobs(model, mb, temperature=1.0)[0], untempered, rtol=0, atol=0)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="temperature above 0"):
            token_logprobs(model, mb, temperature=bad)


@pytest.mark.parametrize("tied", [True, False])
def test_a_filler_micro_batch_still_reaches_every_parameter(tied):
    """A rank's filler micro-batch has no loss tokens (services/learner/samples.py): its log-probs are 0
    but still a graph, and the backward gives every parameter a (zero) gradient, as FSDP's collectives
    need every rank to take part; no backward at all failed one rank and hung the others."""
    mb = micro(300)
    mb.loss_mask = torch.zeros_like(mb.loss_mask)
    model = tiny(300, tied)
    lp, ent = token_logprobs(model, mb, with_entropy=True, chunk_tokens=4)
    assert lp.requires_grad and not lp.detach().any() and not ent.any()
    lp.sum().backward()
    for name, g in grads(model).items():
        assert g is not None and not g.any(), name


def test_under_fsdp2_the_chunks_run_inside_the_roots_forward():
    """fully_shard per layer and the root (gloo, W=1) with the method installed: the tied head's
    parameters are the root's, all-gathered only in its forward; values and gradients (two
    accumulated backwards) are the plain model's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from services.learner.logprobs import METHOD, install

    mb = micro(700, seed=1)
    ref_model, model = tiny(700), tiny(700)
    lp_ref, _ = plain(ref_model, mb)
    (2 * (lp_ref * mb.loss_mask).sum()).backward()
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        install(model)
        assert hasattr(model, METHOD)
        for _ in range(2):
            lp, _ = token_logprobs(model, mb, chunk_tokens=6)
            (lp * mb.loss_mask).sum().backward()
            torch.testing.assert_close(lp.detach(), lp_ref.detach() * mb.loss_mask, rtol=0, atol=1e-5)
        g_ref, g = grads(ref_model), grads(model)
        for n in g_ref:
            torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=2e-5, msg=n)
    finally:
        if owned:
            dist.destroy_process_group()
