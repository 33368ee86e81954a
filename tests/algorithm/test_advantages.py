"""Advantages with hand-computed values, degenerate groups, and the mem-span-only property."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.config import AlgorithmConfig
from services.common.messages import (
    ChatMessage,
    Episode,
    MemoryScore,
    MemoryScoreBatch,
    Prompt,
    RolloutGroup,
    TrajectoryBatch,
    TurnRecord,
)
from services.common.rewards import exact_match, multi_objective_em, normalize_answer
from services.algorithm.advantages import compute_advantages, format_valid, outcome_reward
from services.algorithm.memory_advantage import pool_key, token_advantage
from services.algorithm.outcome import normalize

I32 = np.int32


def _turn(t, n=10, mem=(-1, -1), ok=True, action="search"):
    return TurnRecord(turn=t, context_ids=np.zeros(3, I32), response_ids=np.arange(n, dtype=I32),
                      response_logprobs=np.zeros(n, np.float32), mem_start=mem[0], mem_end=mem[1], format_ok=ok,
                      action=action)


def _episode(answer, turns, finish="answer"):
    return Episode(uid="u", sample=0, prompt_ids=np.zeros(3, I32), full_ids=np.zeros(3, I32), turns=turns,
                   answer=answer, finish_reason=finish)


def _group(answers, golds=(("Kroumia",),)):
    eps = [_episode(a, [_turn(1), _turn(2, mem=(0, 4)), _turn(3, mem=(1, 5), action="answer")],
                    "answer" if a is not None else "max_turns") for a in answers]
    return RolloutGroup(prompt=Prompt(uid="p", messages=[ChatMessage("user", "q")], golds=[list(g) for g in golds]),
                        episodes=eps)


def _scores(blocks):
    """A MemoryScoreBatch of group 0 with the given (episode, turn, R_mem) blocks."""
    return MemoryScoreBatch(scores=[MemoryScore(group=0, episode=e, turn=t, answer_ids=np.zeros(1, I32),
                                                full_logp=np.zeros(1, np.float32), mem_logp=np.zeros(1, np.float32),
                                                full_keep=np.ones(1, bool), mem_keep=np.ones(1, bool), r_mem=v)
                                    for (e, t, v) in blocks],
                            policy_version=0, tau=-0.69, filter_mode="independent")


def test_squad_normalisation_and_multi_objective():
    assert normalize_answer("The  Reed College!") == "reed college"
    assert exact_match("the reed college", ["Reed College"]) == 1.0
    assert multi_objective_em("Kroumia; 1961", [["Kroumia"], ["1962"]]) == 0.5
    assert multi_objective_em("Kroumia", [["Kroumia"], ["1961"]]) == 0.5  # missing part scores 0
    assert multi_objective_em(None, [["x"]]) == 0.0


def test_outcome_reward_zero_when_format_invalid():
    good = _episode("Kroumia", [_turn(1), _turn(2, action="answer")])
    assert format_valid(good) and outcome_reward(good, [["Kroumia"]]) == (1.0, 1.0)
    broken = _episode("Kroumia", [_turn(1, ok=False), _turn(2, action="answer")])
    assert outcome_reward(broken, [["Kroumia"]]) == (0.0, 0.0)
    unanswered = _episode(None, [_turn(1)], finish="max_turns")
    assert outcome_reward(unanswered, [["Kroumia"]]) == (0.0, 0.0)


def test_grpo_hand_computed():
    # rewards [1, 0, 1, 1]: mean 0.75, unbiased std 0.5
    a = normalize([1, 0, 1, 1], 1e-6)
    np.testing.assert_allclose(a, [0.25 / 0.500001, -0.75 / 0.500001, 0.25 / 0.500001, 0.25 / 0.500001], rtol=1e-6)


def test_std_floor_shrinks_a_pool_of_near_equal_values_and_leaves_a_wide_one():
    near = [0.95, 0.96, 0.94, 0.95]  # std 0.0082: plain normalisation makes unit-scale advantages of it
    plain, floored = normalize(near, 1e-6), normalize(near, 1e-6, std_floor=0.1)
    np.testing.assert_allclose(floored, (np.array(near) - np.mean(near)) / (0.1 + 1e-6), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(floored, plain * np.std(near, ddof=1) / 0.1, rtol=1e-3)
    wide = [0.0, 0.5, 1.0]  # std 0.5 > floor: unchanged
    np.testing.assert_allclose(normalize(wide, 1e-6, std_floor=0.1), normalize(wide, 1e-6))
    assert (normalize([0.3, 0.3], 1e-6, std_floor=0.1) == 0).all()


def test_memory_spread_metrics():
    group = _group(["Kroumia", "x"])
    batch = TrajectoryBatch(groups=[group], policy_version=0)
    scores = _scores([(0, 1, 0.01), (1, 1, -0.01), (0, 2, 0.0), (1, 2, 0.0)])
    plain = compute_advantages(batch, scores, AlgorithmConfig())
    floored = compute_advantages(batch, scores, AlgorithmConfig(mem_std_floor=0.1))
    std = np.std([0.01, -0.01, 0.0, 0.0], ddof=1)
    for adv in (plain, floored):
        assert adv.metrics["mem_pool_std_mean"] == pytest.approx(std) == adv.metrics["mem_pool_std_max"]
    assert plain.metrics["mem_adv_abs_mean"] == pytest.approx(0.5 * 0.01 / std, rel=1e-3)  # noise at unit scale
    assert floored.metrics["mem_adv_abs_mean"] == pytest.approx(0.5 * 0.01 / 0.1, rel=1e-4)


@pytest.mark.parametrize("values", [[1, 1, 1], [0.0], [], [0.3, 0.3]])
def test_degenerate_groups_give_zero_not_nan(values):
    a = normalize(values, 1e-6)
    assert a.shape == (len(values),) and not np.isnan(a).any() and (a == 0).all()


def test_compute_advantages_end_to_end_hand_values():
    cfg = AlgorithmConfig()
    group = _group(["Kroumia", "Lagav", "kroumia", None])
    batch = TrajectoryBatch(groups=[group], policy_version=0)
    # R_mem per block: episodes 0..3, turns 1 and 2 (indices), values chosen by hand
    r = {(0, 1): 0.4, (0, 2): 0.2, (1, 1): -0.1, (1, 2): 0.0, (2, 1): 0.1, (2, 2): 0.3, (3, 1): -0.5, (3, 2): 0.2}
    scores = MemoryScoreBatch(scores=[MemoryScore(group=0, episode=e, turn=t, answer_ids=np.zeros(1, I32),
                                                  full_logp=np.zeros(1, np.float32), mem_logp=np.zeros(1, np.float32),
                                                  full_keep=np.ones(1, bool), mem_keep=np.ones(1, bool),
                                                  r_mem=v) for (e, t), v in r.items()],
                              policy_version=0, tau=math.log(0.5), filter_mode="independent")
    adv = compute_advantages(batch, scores, cfg)
    assert [adv.rewards[(0, e)] for e in range(4)] == [1.0, 0.0, 1.0, 0.0]
    np.testing.assert_allclose([adv.a_out[(0, e)] for e in range(4)], normalize([1, 0, 1, 0], cfg.grpo_eps))
    vals = np.array(list(r.values()))
    expected = (vals - vals.mean()) / (vals.std(ddof=1) + cfg.mem_eps)
    np.testing.assert_allclose([adv.a_mem[(0, e, t)] for (e, t) in r], expected, rtol=1e-5)
    tok = adv.token_advantages[(0, 0, 1)]  # turn index 1 has mem span [0, 4)
    np.testing.assert_allclose(tok[:4], adv.a_out[(0, 0)] + expected[0], rtol=1e-5)
    np.testing.assert_allclose(tok[4:], adv.a_out[(0, 0)])
    np.testing.assert_allclose(adv.token_advantages[(0, 0, 0)], adv.a_out[(0, 0)])  # turn 1: no memory


def test_prompt_turn_pooling_and_no_memory_reward():
    group = _group(["Kroumia", "x"])
    batch = TrajectoryBatch(groups=[group], policy_version=0)
    scores = _scores([(0, 1, 0.5), (1, 1, -0.5), (0, 2, 0.9), (1, 2, 0.1)])
    per_turn = compute_advantages(batch, scores, AlgorithmConfig(mem_pooling="prompt_turn"))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # [0.5, -0.5]: deviation 0.5 over unbiased std sqrt(0.5)
    assert per_turn.a_mem[(0, 0, 1)] == pytest.approx(a, rel=1e-5) and per_turn.a_mem[(0, 1, 2)] == pytest.approx(-a, rel=1e-5)
    off = compute_advantages(batch, scores, AlgorithmConfig(use_memory_reward=False))
    assert off.a_mem == {} and all((v == off.a_out[k[:2]]).all() for k, v in off.token_advantages.items())


def test_prompt_seen_pooling_compares_memories_written_after_the_same_observations():
    group = _group(["Kroumia", "x", "Kroumia"])
    shown = [[7, 8], [7, 9], [7, 8]]  # episodes 0 and 2 retrieved the same passage at turn 1, episode 1 another
    for ep, obs in zip(group.episodes, shown):
        ep.turns[0].observation_ids = np.asarray(obs, I32)
        ep.turns[1].observation_ids = np.asarray([5], I32)  # turn 2's results: the same for every episode
    batch = TrajectoryBatch(groups=[group], policy_version=0)
    scores = _scores([(0, 1, 0.9), (1, 1, 0.0), (2, 1, 0.1), (0, 2, 0.3), (1, 2, 0.2), (2, 2, 0.7)])
    seen = compute_advantages(batch, scores, AlgorithmConfig(mem_pooling="prompt_seen"))
    a = 0.4 / (math.sqrt(0.32) + 1e-6)  # [0.9, 0.1]: deviation 0.4 over unbiased std sqrt(0.32)
    assert seen.a_mem[(0, 0, 1)] == pytest.approx(a, rel=1e-5) and seen.a_mem[(0, 2, 1)] == pytest.approx(-a, rel=1e-5)
    assert seen.a_mem[(0, 1, 1)] == 0.0  # no other memory followed its observations: nothing to compare with
    assert seen.a_mem[(0, 1, 2)] == 0.0  # turn 3 of episode 1 saw [7, 9] and [5]: alone again
    assert seen.a_mem[(0, 0, 2)] == pytest.approx(-a, rel=1e-5) and seen.a_mem[(0, 2, 2)] == pytest.approx(a, rel=1e-5)
    assert seen.metrics["mem_pools"] == 2.0  # pools of two or more blocks
    assert pool_key(group.episodes[0], 1, "prompt_seen") == pool_key(group.episodes[2], 1, "prompt_seen")
    with pytest.raises(ValueError, match="algorithm.mem_pooling: unknown choice 'episode'"):
        pool_key(group.episodes[0], 1, "episode")


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), a_out=st.floats(-5, 5), a_mem=st.floats(-5, 5), alpha=st.floats(0, 2),
       span=st.tuples(st.integers(-1, 40), st.integers(0, 40)))
def test_token_advantage_differs_from_a_out_only_on_the_mem_span(n, a_out, a_mem, alpha, span):
    start, end = (span[0], max(span[0], span[1])) if span[0] >= 0 else (-1, -1)
    adv = token_advantage(n, a_out, (start, end), a_mem, alpha)
    inside = np.zeros(n, bool)
    if start >= 0:
        inside[start:end] = True
    assert np.allclose(adv[~inside], np.float32(a_out))
    assert np.allclose(adv[inside], np.float32(a_out) + np.float32(alpha * a_mem), atol=1e-5)


def test_outcome_on_mem_off_leaves_the_mem_tokens_only_the_memory_advantage():
    adv = token_advantage(6, 0.8, (1, 4), a_mem=0.5, alpha=2.0, outcome_on_mem=False)
    assert adv.tolist() == pytest.approx([0.8, 1.0, 1.0, 1.0, 0.8, 0.8])  # 2 * 0.5 on <mem>, A_out elsewhere
    assert token_advantage(3, 0.8, (-1, -1), 0.5, 2.0, outcome_on_mem=False).tolist() == pytest.approx([0.8] * 3)


def test_share_of_groups_with_reward_variance():
    batch = TrajectoryBatch(groups=[_group(["Kroumia", "Lagav"]), _group(["Lagav", None]), _group(["Kroumia"] * 2)],
                            policy_version=0)
    adv = compute_advantages(batch, None, AlgorithmConfig())
    assert adv.metrics["groups_with_variance"] == 1 / 3  # only the first group has a correct and a wrong episode
    assert all(adv.a_out[(g, e)] == 0.0 for g in (1, 2) for e in (0, 1))


def test_a_steps_memory_spread_weights_each_batch_by_its_pools_and_blocks():
    from services.learner.service import memory_spread

    batches = [{"mem_pools": 1.0, "mem_pool_std_mean": 0.1, "mem_pool_std_max": 0.1, "mem_blocks": 8.0,
                "mem_adv_abs_mean": 1.0},
               {"mem_pools": 3.0, "mem_pool_std_mean": 0.5, "mem_pool_std_max": 0.9, "mem_blocks": 24.0,
                "mem_adv_abs_mean": 0.5},
               {"mem_pools": 0.0, "mem_pool_std_mean": 0.0, "mem_pool_std_max": 0.0, "mem_blocks": 0.0,
                "mem_adv_abs_mean": 0.0}]  # a batch without memory scores
    out = memory_spread(batches)
    assert out["mem_pool_std_mean"] == pytest.approx((0.1 + 3 * 0.5) / 4)
    assert out["mem_pool_std_max"] == 0.9
    assert out["mem_adv_abs_mean"] == pytest.approx((8 * 1.0 + 24 * 0.5) / 32)
    assert memory_spread([])["mem_adv_abs_mean"] == 0.0


def test_loss_only_credit_charges_what_a_memory_lost_and_credits_nothing_beyond_the_full_history():
    group = _group(["Kroumia", "x", "Kroumia"])
    batch = TrajectoryBatch(groups=[group], policy_version=0)
    # episode 0 wrote an answer it had not seen (+0.6 over the full history), 1 lost one (-0.4), 2 kept (0.0)
    scores = _scores([(0, 1, 0.6), (1, 1, -0.4), (2, 1, 0.0)])
    diff = compute_advantages(batch, scores, AlgorithmConfig())
    loss = compute_advantages(batch, scores, AlgorithmConfig(mem_credit="loss_only"))
    assert diff.a_mem[(0, 0, 1)] > diff.a_mem[(0, 2, 1)] > diff.a_mem[(0, 1, 1)]
    credited = np.array([0.0, -0.4, 0.0])
    expected = (credited - credited.mean()) / (credited.std(ddof=1) + 1e-6)
    np.testing.assert_allclose([loss.a_mem[(0, e, 1)] for e in range(3)], expected, rtol=1e-5)
    assert loss.a_mem[(0, 0, 1)] == loss.a_mem[(0, 2, 1)] > loss.a_mem[(0, 1, 1)]


def _question_scores(blocks):
    """Group 0's scores with per-question values: (episode, turn, [R_mem per question], [(start, end)])."""
    batch = _scores([(e, t, float(np.nanmean(r))) for e, t, r, _ in blocks])
    for s, (_, _, r, spans) in zip(batch.scores, blocks):
        s.question_r_mem = np.asarray(r, np.float32)
        s.question_spans = np.asarray(spans, I32).reshape(-1, 2)
    return batch


def test_question_scope_credits_each_section_with_its_own_question():
    nan = float("nan")
    batch = TrajectoryBatch(groups=[_group(["a", "b", "c"], golds=(("x",), ("y",)))], policy_version=0)
    # turn index 1's memory spans tokens [0, 4): sections Q1 = [1, 2), Q2 = [2, 4); episode 2 lacks Q2's section
    scores = _question_scores([(0, 1, [0.1, 0.6], [(1, 2), (2, 4)]),
                               (1, 1, [0.3, 0.2], [(1, 2), (2, 4)]),
                               (2, 1, [0.5, nan], [(1, 2), (-1, -1)])])  # Q2 not scored: it joins no pool
    cfg = AlgorithmConfig(mem_credit_scope="question", mem_alpha=2.0)
    adv = compute_advantages(batch, scores, cfg)
    q1 = normalize([0.1, 0.3, 0.5], cfg.mem_eps)
    q2 = normalize([0.6, 0.2], cfg.mem_eps)
    for e in range(3):
        got, a_out = adv.token_advantages[(0, e, 1)], adv.a_out[(0, e)]
        assert got[0] == pytest.approx(a_out) and got[4:] == pytest.approx(a_out)  # outside every section
        assert got[1] == pytest.approx(a_out + 2.0 * q1[e], abs=1e-5)
    assert adv.token_advantages[(0, 0, 1)][2:4] == pytest.approx(adv.a_out[(0, 0)] + 2.0 * q2[0], abs=1e-5)
    assert adv.token_advantages[(0, 1, 1)][2:4] == pytest.approx(adv.a_out[(0, 1)] + 2.0 * q2[1], abs=1e-5)
    assert adv.token_advantages[(0, 2, 1)][2:4] == pytest.approx(adv.a_out[(0, 2)])  # not scored on Q2
    assert adv.a_mem[(0, 0, 1)] == pytest.approx((q1[0] + q2[0]) / 2, abs=1e-5)  # the log: mean over questions
    # a scored question whose section the memory lacks is credited on the whole block
    scores = _question_scores([(0, 1, [0.1, 0.6], [(1, 2), (2, 4)]), (1, 1, [0.3, 0.2], [(1, 2), (-1, -1)])])
    adv = compute_advantages(batch, scores, cfg)
    q1, q2 = normalize([0.1, 0.3], cfg.mem_eps), normalize([0.6, 0.2], cfg.mem_eps)
    got = adv.token_advantages[(0, 1, 1)] - adv.a_out[(0, 1)]
    np.testing.assert_allclose(got[:4], [2 * q2[1], 2 * (q1[1] + q2[1]), 2 * q2[1], 2 * q2[1]], atol=1e-5)


def test_question_scope_without_per_question_values_is_an_error():
    batch = TrajectoryBatch(groups=[_group(["a", "b"])], policy_version=0)
    with pytest.raises(ValueError, match="per-question"):
        compute_advantages(batch, _scores([(0, 1, 0.1), (1, 1, 0.3)]), AlgorithmConfig(mem_credit_scope="question"))


def test_question_scope_keeps_a_sections_credit_inside_its_block():
    batch = TrajectoryBatch(groups=[_group(["a", "b"])], policy_version=0)
    # turn index 1's memory spans [0, 4): a span past it is cut to the block; one wholly outside it
    # (or empty) credits the whole block, as a missing section does
    scores = _question_scores([(0, 1, [0.1], [(2, 9)]), (1, 1, [0.3], [(6, 8)])])
    adv = compute_advantages(batch, scores, AlgorithmConfig(mem_credit_scope="question"))
    a = normalize([0.1, 0.3], 1e-6)
    np.testing.assert_allclose(adv.token_advantages[(0, 0, 1)] - adv.a_out[(0, 0)], [0, 0, a[0], a[0]] + [0] * 6, atol=1e-5)
    np.testing.assert_allclose(adv.token_advantages[(0, 1, 1)] - adv.a_out[(0, 1)], [a[1]] * 4 + [0] * 6, atol=1e-5)


def test_shuffled_rewards_land_the_same_advantages_on_other_episodes():
    """algorithm.shuffled_rewards (a null control): per group the outcome advantages and per pool the memory
    advantages are the real ones' values, permuted among the members, the same way on every call; the logged
    rewards stay the real ones."""
    golds = (("Kroumia",),)
    answers = ["Kroumia", "Lagav", "Lagav", None, "Kroumia", "x", "y", "z"]
    batch = TrajectoryBatch(groups=[_group(answers, golds) for _ in range(6)], policy_version=0, step=3)
    r_mem = [(e, t, 0.1 * e - 0.05 * t) for e in range(8) for t in (1, 2)]
    scores = _scores(r_mem)
    for g in range(1, 6):  # the same blocks in every group
        for s in _scores(r_mem).scores:
            s.group = g
            scores.scores.append(s)
    real = compute_advantages(batch, scores, AlgorithmConfig())
    cfg = AlgorithmConfig(shuffled_rewards=True)
    shuffled, again = compute_advantages(batch, scores, cfg), compute_advantages(batch, scores, cfg)
    assert shuffled.rewards == real.rewards and shuffled.metrics["reward_mean"] == real.metrics["reward_mean"]
    assert shuffled.a_out == again.a_out and shuffled.a_mem == again.a_mem
    moved = 0
    for g in range(6):
        out_real = [real.a_out[(g, e)] for e in range(8)]
        out_shuf = [shuffled.a_out[(g, e)] for e in range(8)]
        assert sorted(out_shuf) == pytest.approx(sorted(out_real))
        mem_real = [real.a_mem[(g, e, t)] for e in range(8) for t in (1, 2)]
        mem_shuf = [shuffled.a_mem[(g, e, t)] for e in range(8) for t in (1, 2)]
        assert sorted(mem_shuf) == pytest.approx(sorted(mem_real))
        moved += out_shuf != pytest.approx(out_real) and mem_shuf != pytest.approx(mem_real)
    assert moved >= 5  # six groups: a permutation that leaves one in place is possible, not five
