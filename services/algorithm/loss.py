"""The policy loss (docs/algorithm.md, section 6): PPO clip with dual clip, KL to a reference, aggregation.

All functions take padded [batch, time] tensors and a 0/1 ``mask`` of the tokens that count
(generated tokens; observations and padding are 0). Each row is one (context, response) turn.

    w, wm = behaviour_weights(old_logp, rollout_logp, stale, mask, cap=2.0)   # off-policy correction
    loss, m = policy_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0,
                          agg="seq-mean-token-mean", is_weight=w)
    loss = loss + kl_coef * aggregate(kl_penalty(logp, ref_logp, "low_var_kl"), mask, agg)

Off-policy correction (docs/algorithm.md, section 6) follows AReaL's decoupled PPO (Fu et al., 2025,
"AReaL: a large-scale asynchronous reinforcement learning system"): the PPO ratio is taken against
the *proximal* policy (the learner's pre-update weights, ``old_logp``) and the gap between that policy
and the *behaviour* policy that sampled the tokens (vLLM's log-probs of an older version) is a
separate importance weight, truncated at ``cap`` as in verl's rollout importance sampling (token-level
TIS). With no stale token the weight is 1 everywhere and the loss is exactly the on-policy one.
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
                total_rows: float | None = None, is_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO-clip on ratio = exp(logp - old_logp); for negative advantages the loss is also capped at
    -adv * c (dual clip), so one very unlikely token cannot dominate. ``is_weight`` (no gradient)
    multiplies each token's clipped term: the behaviour importance weight of ``behaviour_weights``.

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
    if is_weight is not None:
        pg = pg * torch.where(keep, is_weight.detach(), zero)
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


def behaviour_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, stale: torch.Tensor, mask: torch.Tensor,
                      cap: float = 2.0, mode: str = "stale") -> tuple[torch.Tensor, dict]:
    """Truncated importance weights min(pi_old / pi_behaviour, cap) per token, and their metrics.

    ``stale`` marks tokens sampled by an older policy version than the learner's pre-update one.
    ``mode``: "stale" weights only those (a token of the current version was sampled by these very
    weights; its vLLM/learner log-prob gap is numerics, left alone, so a synchronous run's loss is
    unchanged); "all" weights every token (verl's TIS: also corrects the sampler/trainer mismatch);
    "off" gives 1 everywhere, and so does "mask" (the learner has already taken stale tokens out of the
    loss mask: services/learner/samples.py ``mask_stale``). Weights are 1 on masked positions; the log-ratio is clamped to
    [-20, 20] first, so no weight is inf or NaN."""
    keep = mask > 0
    if mode in ("off", "mask"):
        return torch.ones_like(old_logp), {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_truncated_share": 0.0,
                                           "is_tokens": 0.0}
    if mode not in ("stale", "all"):
        raise ValueError(f"unknown importance-weight mode {mode!r}; choose stale, all, mask or off")
    zero = torch.zeros((), dtype=old_logp.dtype, device=old_logp.device)
    weighted = keep & (stale > 0) if mode == "stale" else keep
    log_w = torch.clamp(torch.where(weighted, old_logp.detach(), zero) - torch.where(weighted, rollout_logp, zero),
                        min=-20.0, max=20.0)
    raw = torch.exp(log_w)
    w = torch.where(weighted, torch.clamp(raw, max=cap), torch.ones_like(raw))
    n = int(weighted.sum())
    metrics = {"is_weight_mean": float(w[weighted].mean()) if n else 1.0,
               "is_weight_max": float(w[weighted].max()) if n else 1.0,
               "is_truncated_share": float((raw[weighted] > cap).float().mean()) if n else 0.0,
               "is_tokens": float(n)}
    return w, metrics


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
