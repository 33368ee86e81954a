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
