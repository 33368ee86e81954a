"""Training samples: every turn is its own (context, response) sample, trained under the context it
was generated with (memory mode makes a rollout a list of short samples, not one long sequence).

    batch = training_batch(trajectory_batch, advantages)      # -> TrainingBatch (packed, no padding)
    batch = pack(samples, policy_version, step)               # the one constructor: RL and SFT samples
    micro = micro_batches(batch, token_budget=8192, rank=0, world=2)   # this rank's padded micro-batches

Loss counts only generated tokens (``loss_mask``); observations, prompts and padding get none.
Micro-batches are length-sorted and filled up to ``token_budget`` padded tokens; rank r of W takes
every W-th micro-batch, so the ranks together see each sample exactly once. Every rank gets the same
number of micro-batches (FSDP's collectives need it): a rank short of one runs a copy of another
with its loss mask zeroed, which changes no gradient. With ``by_group`` (learner.noise_scale) no
micro-batch mixes prompt groups and each group ends with a round of the ranks' micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common.messages import TrainingBatch, TrajectoryBatch
from services.algorithm.advantages import Advantages


@dataclass
class Sample:
    """One (context, response) sample. Loss counts the response tokens; the per-response-token
    arrays default to zeros (SFT has no advantages and no sampler log-probs)."""

    context_ids: np.ndarray
    response_ids: np.ndarray
    advantages: np.ndarray | None = None  # per response token
    logprobs: np.ndarray | None = None  # the sampler's, per response token
    mem_span: tuple[int, int] = (-1, -1)  # the <mem> block's tokens in the response, [start, end)
    group: int = 0  # the prompt group it came from
    version: int = -1  # the policy version that sampled it; -1 = the batch's (SFT: not sampled)


def pack(samples: list[Sample], policy_version: int = 0, step: int = 0) -> TrainingBatch:
    """The one TrainingBatch constructor (RL steps and SFT alike): samples back to back, no padding."""
    ids, loss, advs, lps, mems = [], [], [], [], []
    for s in samples:
        n_ctx, n_resp = len(s.context_ids), len(s.response_ids)
        ctx_zeros, resp_zeros = np.zeros(n_ctx, np.float32), np.zeros(n_resp, np.float32)
        ids.append(np.concatenate([s.context_ids, s.response_ids]))
        loss.append(np.r_[np.zeros(n_ctx, bool), np.ones(n_resp, bool)])
        advs.append(np.r_[ctx_zeros, resp_zeros if s.advantages is None else s.advantages])
        lps.append(np.r_[ctx_zeros, resp_zeros if s.logprobs is None else s.logprobs])
        mem = np.zeros(n_ctx + n_resp, bool)
        if s.mem_span[0] >= 0:
            mem[n_ctx + s.mem_span[0]:n_ctx + s.mem_span[1]] = True
        mems.append(mem)
    cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
    lengths = [len(x) for x in ids]
    versions = np.asarray([policy_version if s.version < 0 else s.version for s in samples], np.int32)
    return TrainingBatch(input_ids=cat(ids, np.int32), cu_seqlens=np.r_[0, np.cumsum(lengths)].astype(np.int64),
                         loss_mask=cat(loss, bool), advantages=cat(advs, np.float32),
                         rollout_logprobs=cat(lps, np.float32), mem_mask=cat(mems, bool),
                         group_ids=np.asarray([s.group for s in samples], np.int32), policy_version=policy_version,
                         step=step, sample_versions=versions)


def turn_samples(batch: TrajectoryBatch, adv: Advantages, first_group: int = 0) -> list[Sample]:
    """Every turn with a response, under its own context; groups numbered from ``first_group``."""
    out = []
    for g, group in enumerate(batch.groups):
        for e, ep in enumerate(group.episodes):
            for t, turn in enumerate(ep.turns):
                if len(turn.response_ids):
                    out.append(Sample(turn.context_ids, turn.response_ids, adv.token_advantages[(g, e, t)],
                                      turn.response_logprobs, (turn.mem_start, turn.mem_end), first_group + g,
                                      turn.policy_version))
    return out


def training_batch(batch: TrajectoryBatch, adv: Advantages) -> TrainingBatch:
    return pack(turn_samples(batch, adv), batch.policy_version, batch.step)


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] on the *target* positions (token t predicted from t-1)
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    samples: list[int]  # sample indices in the TrainingBatch
    lag: torch.Tensor = None  # [B, T] policy versions between the sampler and the learner (0 = on-policy)
    group_end: bool = False  # by-group plans only: this round completes a prompt group (learner.noise_scale)

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def _slice(arr: np.ndarray, cu: np.ndarray, i: int) -> np.ndarray:
    return arr[cu[i]:cu[i + 1]]


def sample_lags(batch: TrainingBatch) -> np.ndarray:
    """Per sample: how many versions older than the learner's its sampling policy was."""
    n = len(batch.cu_seqlens) - 1
    if len(batch.sample_versions) == 0:
        return np.zeros(n, np.int64)
    if len(batch.sample_versions) != n:
        raise ValueError(f"sample_versions has {len(batch.sample_versions)} entries for {n} samples")
    return batch.policy_version - batch.sample_versions.astype(np.int64)


def mask_stale(batch: TrainingBatch) -> int:
    """``learner.behaviour_is=mask``: the loss mask of every sample an older policy version sampled set
    to 0 in place (slime's masking of off-policy tokens: they carry no gradient and leave the loss's
    denominators). Returns how many loss tokens it masked."""
    stale = sample_lags(batch) > 0
    if not stale.any():
        return 0
    cu = batch.cu_seqlens
    before = int(batch.loss_mask.sum())
    mask = batch.loss_mask.copy()
    for i in np.flatnonzero(stale):
        mask[cu[i]:cu[i + 1]] = False
    batch.loss_mask = mask
    return before - int(mask.sum())


def _pack(order: list[int], cu: np.ndarray, token_budget: int) -> list[list[int]]:
    """Length-sorted samples (``order``) into micro-batches of at most ``token_budget`` padded tokens."""
    packs, cur = [], []
    for i in order:
        length = int(cu[i + 1] - cu[i])
        if cur and length * (len(cur) + 1) > token_budget:  # sorted: this sample is the longest so far
            packs.append(cur)
            cur = []
        cur.append(i)
    if cur:
        packs.append(cur)
    return packs


def _rounds(batch: TrainingBatch, token_budget: int, world: int, by_group: bool) -> list[tuple[list, bool]]:
    """The whole batch's plan, the same on every rank: rounds of ``world`` micro-batches (rank r runs
    ``round[r]``; [] where it has none), each with whether it completes a prompt group. ``by_group``:
    every micro-batch holds one group's samples, a group's samples are split over the ranks and the
    group ends with a round, so the gradient added by its rounds is that group's alone."""
    cu = batch.cu_seqlens
    n = len(cu) - 1
    key = (lambda i: (int(cu[i + 1] - cu[i]), i))
    if not by_group:
        packs = _pack(sorted(range(n), key=key), cu, token_budget)
        return [(packs[j:j + world] + [[]] * (world - len(packs[j:j + world])), False)
                for j in range(0, len(packs), world)]
    if len(batch.group_ids) != n:
        raise ValueError(f"a by-group plan needs one group id per sample: {len(batch.group_ids)} for {n} samples")
    by_id: dict[int, list[int]] = {}
    for i in range(n):
        by_id.setdefault(int(batch.group_ids[i]), []).append(i)
    rounds = []
    for g in sorted(by_id):
        members = sorted(by_id[g], key=key)
        per_rank = [_pack(members[r::world], cu, token_budget) for r in range(world)]
        depth = max(len(p) for p in per_rank)
        rounds += [([p[j] if j < len(p) else [] for p in per_rank], j == depth - 1) for j in range(depth)]
    return rounds


def micro_batches(batch: TrainingBatch, token_budget: int, rank: int = 0, world: int = 1,
                  by_group: bool = False) -> list[MicroBatch]:
    """This rank's micro-batches, padded; every rank gets as many (a rank with none in a round runs a
    copy of another micro-batch with its loss mask zeroed). ``by_group`` keeps prompt groups apart and
    marks the micro-batch that completes each (``MicroBatch.group_end``; learner.noise_scale)."""
    cu = batch.cu_seqlens
    lags = sample_lags(batch)
    rounds = _rounds(batch, token_budget, world, by_group)
    filler = next((p for r, _ in rounds for p in r if p), [])
    out = []
    for parts, group_end in rounds:
        idx = parts[rank]
        rows = idx or filler
        length = max(int(cu[i + 1] - cu[i]) for i in rows)
        shape = (len(rows), length)
        ids, att = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
        lm, adv, lp, lag = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
        for r, i in enumerate(rows):
            k = int(cu[i + 1] - cu[i])
            ids[r, :k] = torch.from_numpy(_slice(batch.input_ids, cu, i).astype(np.int64))
            att[r, :k] = 1
            lm[r, :k] = torch.from_numpy(_slice(batch.loss_mask, cu, i).astype(np.float32))
            adv[r, :k] = torch.from_numpy(_slice(batch.advantages, cu, i).copy())
            lp[r, :k] = torch.from_numpy(_slice(batch.rollout_logprobs, cu, i).copy())
            lag[r, :k] = float(lags[i])
        if not idx:
            lm.zero_()
        out.append(MicroBatch(ids, att, lm, adv, lp, list(idx), lag, group_end))
    return out


def global_counts(batch: TrainingBatch) -> tuple[float, float]:
    """(loss tokens, samples with any loss token) over the whole batch: the denominators that make
    a rank's partial loss sum to the full-batch loss."""
    cu = batch.cu_seqlens
    per_sample = np.add.reduceat(batch.loss_mask.astype(np.int64), cu[:-1]) if len(cu) > 1 else np.zeros(0)
    return float(batch.loss_mask.sum()), float((per_sample > 0).sum())
