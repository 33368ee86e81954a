"""The policy loss (docs/algorithm.md, section 6): PPO clip with dual clip, KL to a reference, aggregation.

All functions take padded [batch, time] tensors and a 0/1 ``mask`` of the tokens that count
(generated tokens; observations and padding are 0). Each row is one (context, response) turn.

    loss, m = policy_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0,
                          agg="seq-mean-token-mean")
    loss = loss + kl_coef * aggregate(kl_penalty(logp, ref_logp, "low_var_kl"), mask, agg)
"""

from __future__ import annotations

import torch


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: str, total_tokens: float | None = None,
              total_rows: float | None = None) -> torch.Tensor:
    """``token-mean``: mean over every counted token of the batch. ``seq-mean-token-mean``: mean
    over tokens within each row, then over rows that have any counted token (the paper's).
    With ``total_tokens`` / ``total_rows`` (counts over the whole batch, of which this is a micro-
    batch or one rank's share) it returns this part's contribution, so the parts sum to the mean."""
    keep = mask > 0
    mask = mask.to(values.dtype)
    # where, not values * mask: a masked NaN or inf (0 * inf = NaN) must not reach the sum
    weighted = torch.where(keep, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))
    if agg == "token-mean":
        denom = mask.sum().clamp(min=1.0) if total_tokens is None else max(total_tokens, 1.0)
        return weighted.sum() / denom
    if agg == "seq-mean-token-mean":
        per_row = mask.sum(-1)
        rows = per_row > 0
        seq = weighted.sum(-1)[rows] / per_row[rows]
        denom = seq.numel() if total_rows is None else total_rows
        return seq.sum() / max(denom, 1) if seq.numel() else weighted.sum() * 0.0
    raise ValueError(f"unknown loss aggregation {agg!r}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip_c: float = 3.0,
                agg: str = "seq-mean-token-mean", total_tokens: float | None = None,
                total_rows: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip on ratio = exp(logp - old_logp); for negative advantages the loss is also capped at
    -adv * c (dual clip), so one very unlikely token cannot dominate.

    Today the learner takes one optimizer step per batch and uses that step's own forward
    (detached) as the "old" log-probs, so the PPO ratio is 1 and the clip is inert; it becomes
    active only when rollouts are off-policy (an asynchronous pipeline is planned)."""
    keep = mask > 0
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    # Masked positions are zeroed before any arithmetic, so neither their loss nor their gradient can
    # be NaN (a where after the fact still back-propagates 0 * inf). The log-ratio is clamped to
    # [-20, 20] before exp, as verl does, so an extreme or -inf log-prob cannot overflow the ratio.
    log_ratio = torch.clamp(torch.where(keep, logp, zero) - torch.where(keep, old_logp, zero), min=-20.0, max=20.0)
    adv = torch.where(keep, adv, zero)
    ratio = torch.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    clipped = torch.maximum(pg1, pg2)
    dual = torch.minimum(clipped, -adv * dual_clip_c)
    pg = torch.where(adv < 0, dual, clipped)
    m = keep.to(logp.dtype)
    n = m.sum().clamp(min=1.0)
    with torch.no_grad():
        metrics = {
            "clip_frac": float(((pg2 > pg1).to(m.dtype) * m).sum() / n),
            "dual_clip_frac": float((((clipped > -adv * dual_clip_c) & (adv < 0)).to(m.dtype) * m).sum() / n),
            "ratio_mean": float((ratio * m).sum() / n),
            "approx_kl_old": float((-log_ratio * m).sum() / n),
        }
    return aggregate(pg, mask, agg, total_tokens, total_rows), metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimates from sampled tokens: k1 = log r, k2 = (log r)^2 / 2,
    low_var_kl (k3) = exp(-log r) - 1 + log r, clamped to [-10, 10] as in verl."""
    log_ratio = logp - ref_logp
    if kind == "low_var_kl":  # as verl: exp(-log r) must not overflow for an extreme log-prob
        log_ratio = torch.clamp(log_ratio, min=-20.0, max=20.0)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        return torch.clamp(torch.exp(-log_ratio) - 1.0 + log_ratio, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL estimator {kind!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the categorical distribution (a metric, not a loss term)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
