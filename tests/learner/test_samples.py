"""pack: the one TrainingBatch constructor, for RL turns (turn_samples) and SFT samples alike."""

import numpy as np
import pandas as pd
from transformers import AutoTokenizer

from services.config import load_config
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages
from services.learner.samples import Sample, pack, turn_samples
from services.world.oracle_records import oracle_group


def test_turns_pack_under_their_own_context_with_their_arrays_aligned(world):
    cfg = load_config("deploy/configs/tiny.yaml")
    tok = AutoTokenizer.from_pretrained(world / "model")
    rows = pd.read_parquet(world / "train.parquet").to_dict("records")[:2]
    batch = TrajectoryBatch(groups=[oracle_group(cfg, world, r, n=2, tokenizer=tok, seed=i) for i, r in enumerate(rows)],
                            policy_version=3, step=3)
    adv = compute_advantages(batch, None, cfg.algorithm)
    first, second = turn_samples(batch, adv), turn_samples(batch, adv, first_group=2)
    tb = pack(first + second, policy_version=3, step=4)
    turns = [(g, e, t, turn) for g, grp in enumerate(batch.groups) for e, ep in enumerate(grp.episodes)
             for t, turn in enumerate(ep.turns) if len(turn.response_ids)]
    assert len(tb.cu_seqlens) - 1 == 2 * len(turns) and (tb.policy_version, tb.step) == (3, 4)
    assert tb.group_ids.tolist() == [g for g, *_ in turns] + [g + 2 for g, *_ in turns]
    cu = tb.cu_seqlens
    for i, (g, e, t, turn) in enumerate(turns):
        n_ctx = len(turn.context_ids)
        sl = slice(cu[i], cu[i + 1])
        np.testing.assert_array_equal(tb.input_ids[sl], np.r_[turn.context_ids, turn.response_ids])
        assert not tb.loss_mask[sl][:n_ctx].any() and tb.loss_mask[sl][n_ctx:].all()
        np.testing.assert_allclose(tb.advantages[sl][n_ctx:], adv.token_advantages[(g, e, t)])
        np.testing.assert_allclose(tb.rollout_logprobs[sl][n_ctx:], turn.response_logprobs, rtol=1e-6)
        assert not tb.advantages[sl][:n_ctx].any() and not tb.rollout_logprobs[sl][:n_ctx].any()
        mem = np.flatnonzero(tb.mem_mask[sl])
        assert mem.tolist() == (list(range(n_ctx + turn.mem_start, n_ctx + turn.mem_end)) if turn.mem_start >= 0 else [])


def test_sft_samples_have_zero_advantages_and_log_probs():
    tb = pack([Sample(np.array([1, 2, 3]), np.array([4, 5])), Sample(np.array([6]), np.array([7]), group=1)], step=2)
    assert tb.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and tb.cu_seqlens.tolist() == [0, 5, 7]
    assert tb.loss_mask.tolist() == [False, False, False, True, True, False, True]
    assert not tb.advantages.any() and not tb.rollout_logprobs.any() and not tb.mem_mask.any()
    assert tb.group_ids.tolist() == [0, 1] and tb.step == 2
    empty = pack([])
    assert len(empty.input_ids) == 0 and empty.cu_seqlens.tolist() == [0]


def test_sample_versions_give_each_token_its_lag():
    from services.common.codec import decode, encode
    from services.common.messages import TrainingBatch
    from services.learner.samples import micro_batches, sample_lags

    samples = [Sample(np.array([1, 2]), np.array([3]), version=5), Sample(np.array([4]), np.array([5, 6]), version=3),
               Sample(np.array([7]), np.array([8]))]  # no version: the batch's own
    tb = decode(encode(pack(samples, policy_version=5, step=5)), TrainingBatch)
    assert tb.sample_versions.tolist() == [5, 3, 5] and sample_lags(tb).tolist() == [0, 2, 0]
    lags = {}
    for mb in micro_batches(tb, token_budget=64):
        for row, i in enumerate(mb.samples):
            n = int(tb.cu_seqlens[i + 1] - tb.cu_seqlens[i])
            lags[i] = set(mb.lag[row, :n].tolist())
            assert not mb.lag[row, n:].any()  # padding: no lag
    assert lags == {0: {0.0}, 1: {2.0}, 2: {0.0}}
    legacy = pack(samples, policy_version=5)
    legacy.sample_versions = np.zeros(0, np.int32)  # a batch from before the field: every sample on-policy
    assert sample_lags(legacy).tolist() == [0, 0, 0]


def test_masking_stale_samples_takes_their_tokens_out_of_the_loss_and_its_gradient():
    """learner.behaviour_is=mask: a sample an older version sampled keeps no loss token, the denominators
    shrink with it, and its log-probs get no gradient; the fresh samples' loss is what it was alone."""
    import torch

    from services.algorithm.loss import policy_loss
    from services.learner.samples import global_counts, mask_stale, micro_batches

    samples = [Sample(np.array([1, 2]), np.array([3, 4]), version=5), Sample(np.array([4]), np.array([5, 6, 7]), version=3),
               Sample(np.array([7]), np.array([8]))]
    tb = pack(samples, policy_version=5, step=5)
    tb.advantages = np.linspace(-1.0, 1.0, len(tb.input_ids)).astype(np.float32)
    assert global_counts(tb) == (6.0, 3.0)
    assert mask_stale(tb) == 3 and global_counts(tb) == (3.0, 2.0)
    assert mask_stale(tb) == 0  # masked once: nothing stale is left in the loss
    for mb in micro_batches(tb, token_budget=64):
        logp = torch.zeros(mb.loss_mask.shape, dtype=torch.float32, requires_grad=True)
        loss, _ = policy_loss(logp, logp.detach(), mb.advantages, mb.loss_mask, agg="token-mean", total_tokens=3.0)
        loss.backward()
        for row, i in enumerate(mb.samples):
            n = int(tb.cu_seqlens[i + 1] - tb.cu_seqlens[i])
            assert (logp.grad[row, :n] != 0).any() == (i != 1), i  # the stale sample: no gradient at all
    fresh = pack([samples[0], samples[2]], policy_version=5, step=5)
    assert global_counts(fresh) == global_counts(tb)
