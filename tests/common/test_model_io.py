"""target_logprobs: the one log-softmax-and-gather of the learner, the scorer and the benches."""

import torch

from services.common.model_io import target_logprobs


def test_target_logprobs_is_log_softmax_at_the_targets_in_float32():
    logits = torch.randn(2, 5, 11, dtype=torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    lp = target_logprobs(logits, targets)
    ref = logits.float() - torch.logsumexp(logits.float(), -1, keepdim=True)
    assert lp.dtype == torch.float32 and lp.shape == (2, 5)
    torch.testing.assert_close(lp, ref.gather(-1, targets[..., None])[..., 0])
    assert target_logprobs(logits[0, 0], targets[0, 0]).shape == ()


def test_forward_logprobs_chunks_the_head_and_matches_the_full_logits():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.common.model_io import forward_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=3000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 3000, (1, 30))
    keep = torch.tensor([0, 3, 4, 17, 28])
    targets = ids[0, keep + 1]
    with torch.no_grad():
        full = target_logprobs(model(input_ids=ids).logits[0, keep], targets)
    for chunk in (1, 2, 1024):
        lp = forward_logprobs(model, targets, keep, chunk_tokens=chunk, input_ids=ids)
        torch.testing.assert_close(lp, full, rtol=0, atol=1e-5)
    every = forward_logprobs(model, ids[0, 1:], chunk_tokens=7, input_ids=ids[:, :-1])
    assert every.shape == (29,) and torch.allclose(every[keep], full, atol=1e-5)
    assert forward_logprobs(model, targets[:0], keep[:0], input_ids=ids).shape == (0,)
