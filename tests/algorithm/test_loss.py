"""Policy loss pieces with hand-computed values."""

import math

import pytest
import torch

from services.algorithm.loss import aggregate, behaviour_weights, entropy_from_logits, kl_penalty, policy_loss


def t(x):
    return torch.tensor(x, dtype=torch.float64)


def test_ppo_clip_and_dual_clip_hand_values():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logp = t([[math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)]])  # ratios 1.5, 0.5, 1.1, 5.0
    adv = t([[1.0, 1.0, -2.0, -1.0]])
    mask = t([[1, 1, 1, 1]])
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    # token 1: A>0, r=1.5 -> max(-1.5, -1.2) = -1.2 ; token 2: A>0, r=0.5 -> max(-0.5, -0.8) = -0.5
    # token 3: A<0, r=1.1 -> max(2.2, 2.2) = 2.2, min(2.2, 6) = 2.2 ; token 4: A<0, r=5 -> max(5, 1.2) = 5, min(5, 3) = 3
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 2.2 + 3.0) / 4)
    assert m["dual_clip_frac"] == pytest.approx(0.25)
    assert m["clip_frac"] == pytest.approx(0.25)  # only token 1 is clipped by the ratio clip


def test_aggregations_differ_as_defined():
    values = t([[1.0, 3.0, 0.0], [10.0, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    assert aggregate(values, mask, "token-mean").item() == pytest.approx((1 + 3 + 10) / 3)
    assert aggregate(values, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 10) / 2)
    empty = aggregate(values, torch.zeros_like(mask), "seq-mean-token-mean")
    assert empty.item() == 0.0 and not torch.isnan(empty)
    with pytest.raises(ValueError):
        aggregate(values, mask, "bogus")


def test_kl_estimators():
    logp, ref = t([math.log(0.5)]), t([math.log(0.25)])  # log r = log 2
    lr = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(lr)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * lr * lr)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(0.5 - 1 + lr)
    assert kl_penalty(ref, ref, "low_var_kl").item() == 0.0
    assert kl_penalty(t([0.0]), t([-100.0]), "low_var_kl").item() <= 10.0


def test_entropy():
    uniform = torch.zeros(1, 4)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(4))
    assert entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)


def test_gradient_flows_only_through_counted_tokens():
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 3, dtype=torch.float64), t([[1.0, 1.0, 1.0]]), t([[1, 0, 1]]))
    loss.backward()
    assert logp.grad[0, 1].item() == 0.0 and logp.grad[0, 0].item() != 0.0


BAD = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("bad", BAD)
def test_masked_positions_never_contribute_nan(agg, bad):
    mask = t([[1, 0, 1], [0, 0, 1]])
    clean = policy_loss(t([[-1.0, -2.0, -0.5], [-1.0, -1.0, -0.3]]), t([[-1.1, -2.0, -0.4], [-1.0, -1.0, -0.2]]),
                        t([[1.0, 1.0, -1.0], [1.0, 1.0, 0.5]]), mask, agg=agg)[0]
    # garbage at every masked position: in logp, old log-probs and advantages alike
    logp = torch.tensor([[-1.0, bad, -0.5], [bad, bad, -0.3]], dtype=torch.float64, requires_grad=True)
    loss, m = policy_loss(logp, t([[-1.1, bad, -0.4], [bad, -1.0, -0.2]]), t([[1.0, bad, -1.0], [bad, 1.0, 0.5]]),
                          mask, agg=agg)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(clean.item())
    assert all(math.isfinite(v) for v in m.values())
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0 and logp.grad[1, 0] == 0
    assert torch.isfinite(aggregate(t([[1.0, bad]]), t([[1, 0]]), agg))
    if not math.isnan(bad):  # the KL estimate of an infinite or huge log-ratio is clamped, as verl's
        assert torch.isfinite(kl_penalty(t([bad]), t([0.0]))).all()


@pytest.mark.parametrize("logp_value,old_value", [(-float("inf"), -1.0), (-1e30, -1.0), (0.0, -1e30), (-1.0, -float("inf"))])
def test_extreme_log_probs_at_counted_tokens_stay_finite(logp_value, old_value):
    """The log-ratio is clamped to [-20, 20] before exp (as verl), so the ratio never overflows."""
    logp = torch.tensor([[logp_value, -1.0]], dtype=torch.float64, requires_grad=True)
    for adv in (1.0, -1.0):
        loss, m = policy_loss(logp, t([[old_value, -1.0]]), t([[adv, adv]]), t([[1, 1]]), 0.2, 0.2, 3.0, "token-mean")
        assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
        loss.backward()
        assert torch.isfinite(logp.grad).all()
        logp.grad = None
    ratio = math.exp(max(-20.0, min(20.0, logp_value - old_value)))
    assert m["ratio_mean"] == pytest.approx((ratio + 1.0) / 2)
    assert torch.isfinite(kl_penalty(t([logp_value]), t([old_value]), "low_var_kl")).all()


def test_behaviour_weights_hand_values():
    """Stale tokens get min(pi_old / pi_behaviour, cap); fresh, masked and 'off' tokens get 1."""
    old = t([[math.log(0.6), math.log(0.5), math.log(0.9), math.log(0.3), 0.0]])
    behaviour = t([[math.log(0.3), math.log(0.5), math.log(0.3), math.log(0.6), float("-inf")]])
    stale = t([[1, 1, 1, 1, 1]])  # sampled one version ago
    mask = t([[1, 1, 1, 1, 0]])
    w, m = behaviour_weights(old, behaviour, stale, mask, cap=2.0)
    # 0.6/0.3 = 2 (not above the cap), 1, 0.9/0.3 = 3 -> truncated to 2, 0.3/0.6 = 0.5, masked -> 1
    assert w.tolist()[0] == pytest.approx([2.0, 1.0, 2.0, 0.5, 1.0])
    assert m["is_weight_mean"] == pytest.approx((2 + 1 + 2 + 0.5) / 4)
    assert m["is_weight_max"] == pytest.approx(2.0)
    assert m["is_truncated_share"] == pytest.approx(0.25)
    assert m["is_tokens"] == 4
    fresh, mf = behaviour_weights(old, behaviour, torch.zeros_like(stale), mask)
    assert fresh.tolist()[0] == [1.0] * 5 and mf["is_tokens"] == 0  # on-policy: no correction
    every, _ = behaviour_weights(old, behaviour, torch.zeros_like(stale), mask, mode="all")
    assert every.tolist()[0] == pytest.approx([2.0, 1.0, 2.0, 0.5, 1.0])
    off, _ = behaviour_weights(old, behaviour, stale, mask, mode="off")
    assert off.tolist()[0] == [1.0] * 5
    with pytest.raises(ValueError):
        behaviour_weights(old, behaviour, stale, mask, mode="bogus")


def test_behaviour_weights_stay_finite_for_extreme_log_probs():
    old = t([[0.0, -1e9, float("-inf")]])
    behaviour = t([[-1e9, 0.0, 0.0]])
    w, _ = behaviour_weights(old, behaviour, t([[2, 2, 2]]), t([[1, 1, 1]]), cap=2.0)
    assert torch.isfinite(w).all() and w.tolist()[0] == pytest.approx([2.0, math.exp(-20), math.exp(-20)])


def test_weighted_loss_scales_each_token_and_reduces_to_the_plain_loss():
    logp = t([[math.log(1.5), math.log(0.5), 0.0]]).requires_grad_()
    old, adv, mask = t([[0.0, 0.0, 0.0]]), t([[1.0, 1.0, -1.0]]), t([[1, 1, 1]])
    plain, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0, "token-mean")
    ones, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0, "token-mean", is_weight=torch.ones_like(old))
    assert ones.item() == plain.item()  # weight 1 everywhere: exactly today's loss
    w = t([[2.0, 0.5, 1.0]])
    weighted, _ = policy_loss(logp, old, adv, mask, 0.2, 0.2, 3.0, "token-mean", is_weight=w)
    # per token: -1.2 (clipped at 1.2), -0.5, +1.0 (ratio 1, A = -1), times the weights
    assert weighted.item() == pytest.approx((2.0 * -1.2 + 0.5 * -0.5 + 1.0 * 1.0) / 3)
    weighted.backward()
    assert logp.grad[0, 0].item() == 0.0  # clipped token: no gradient, whatever its weight


def test_token_entropy_only_at_loss_tokens_matches_the_full_pass():
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from services.learner.worker import token_logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 50, (3, 9))
    mask = (torch.rand(3, 9) > 0.5).float()
    mask[:, 0] = 0
    mb = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask)
    lp, ent = token_logprobs(model, mb, with_entropy=True)
    with torch.no_grad():
        full = torch.nn.functional.pad(entropy_from_logits(model(input_ids=ids).logits[:, :-1]), (1, 0))
    assert torch.allclose(ent, full * mask, atol=1e-6)
    assert torch.equal(lp, token_logprobs(model, mb)[0])
