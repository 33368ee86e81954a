"""The memory reward math, pinned to the worked examples of docs/algorithm.md, section 4."""

import math

import numpy as np
import pytest

from services.algorithm.memory_reward import geometric_p, kept_masks, memory_reward

TAU = math.log(0.5)


def test_reed_college_example():
    """[Re, ed, College]: full keeps all three, mem drops "College"."""
    s = memory_reward([-0.2, -0.3, -0.1], [-0.5, -0.4, -1.5], TAU, "independent")
    assert s.full_keep.tolist() == [True, True, True] and s.mem_keep.tolist() == [True, True, False]
    assert s.p_full == pytest.approx(math.exp(-0.2), rel=1e-6)
    assert s.p_mem == pytest.approx(math.exp(-0.45), rel=1e-6)
    assert s.r_mem == pytest.approx(math.exp(-0.45) - math.exp(-0.2), rel=1e-6)


def test_kathryn_bigelow_example():
    """[Kath, ryn, Big, elow] with log-probs [-0.2, -3.5, -0.1, -2.8]: only Kath and Big are kept."""
    logp = np.array([-0.2, -3.5, -0.1, -2.8])
    full_keep, _ = kept_masks(logp, logp, TAU, "independent")
    assert full_keep.tolist() == [True, False, True, False]
    assert geometric_p(logp, full_keep) == pytest.approx(math.exp(-0.15), rel=1e-6)


def test_no_token_passes_gives_p_one():
    s = memory_reward([-8.0], [-9.0], TAU, "independent")
    assert s.p_full == pytest.approx(1.0) and s.p_mem == pytest.approx(1.0) and s.r_mem == pytest.approx(0.0)


def test_joint_and_none_modes():
    full, mem = [-0.2, -0.3, -0.1], [-0.5, -0.4, -1.5]
    j = memory_reward(full, mem, TAU, "joint")
    assert j.full_keep.tolist() == j.mem_keep.tolist() == [True, True, False]
    assert j.p_full == pytest.approx(math.exp(-0.25), rel=1e-6) and j.p_mem == pytest.approx(math.exp(-0.45), rel=1e-6)
    n = memory_reward(full, mem, TAU, "none")
    assert n.p_full == pytest.approx(math.exp(-0.2), rel=1e-6) and n.p_mem == pytest.approx(math.exp(-0.8), rel=1e-6)


def test_independent_filter_inflates_p_mem_relative_to_joint():
    """The bias docs/algorithm.md names: P_mem averaged over an easier subset."""
    full, mem = [-0.2, -0.3, -0.1], [-0.5, -0.4, -1.5]
    assert memory_reward(full, mem, TAU, "independent").r_mem > memory_reward(full, mem, TAU, "none").r_mem


def test_bad_input():
    with pytest.raises(ValueError, match="filter mode"):
        memory_reward([-0.1], [-0.1], TAU, "bogus")
    with pytest.raises(ValueError, match="shape"):
        memory_reward([-0.1, -0.2], [-0.1], TAU, "independent")


def test_per_question_average_makes_one_lost_answer_of_two_cost_half():
    # answer tokens [Reed, College, ;, 19, 61]: questions at [0, 2) and [3, 5); the joiner counts for neither
    kept = [-0.1, -0.1, -0.05, -0.2, -0.2]
    lost = [-0.1, -0.1, -0.05, -9.0, -9.0]  # the second answer gone from memory
    spans = [(0, 2), (3, 5)]
    a = memory_reward(kept, kept, TAU, "none", average="per_question", spans=spans)
    b = memory_reward(kept, lost, TAU, "none", average="per_question", spans=spans)
    assert a.p_mem == pytest.approx((math.exp(-0.1) + math.exp(-0.2)) / 2, rel=1e-6)
    assert b.p_mem == pytest.approx((math.exp(-0.1) + math.exp(-9.0)) / 2, rel=1e-6)
    assert a.r_mem == pytest.approx(0.0, abs=1e-9) and b.r_mem < -0.4  # about half of P lost
    # the reference rule drops exactly the lost tokens and scores the forgetful memory higher
    assert memory_reward(kept, lost, TAU, "independent").p_mem > memory_reward(kept, kept, TAU, "independent").p_mem


def test_floor_bounds_what_one_token_can_cost_and_arithmetic_mean():
    s = memory_reward([-0.2, -20.0], [-0.2, -1.0], TAU, "floor", floor=-5.0)
    assert s.full_keep.all() and s.mem_keep.all()
    assert s.p_full == pytest.approx(math.exp((-0.2 - 5.0) / 2), rel=1e-6)
    assert s.p_mem == pytest.approx(math.exp(-0.6), rel=1e-6)
    a = memory_reward([-0.2, -20.0], [math.log(0.5), math.log(0.25)], TAU, "none", average="arithmetic")
    assert a.p_mem == pytest.approx(0.375, rel=1e-6)


def test_average_and_spans_are_checked():
    with pytest.raises(ValueError, match="average"):
        memory_reward([-0.1], [-0.1], TAU, "none", average="median")
    with pytest.raises(ValueError, match="spans"):
        memory_reward([-0.1, -0.2], [-0.1, -0.2], TAU, "none", average="per_question", spans=[(0, 3)])


def test_every_rule_is_a_config_choice_and_an_unknown_one_is_refused():
    from services.config import ConfigError, load_config
    from services.algorithm.memory_reward import AVERAGES, FILTERS

    for name in FILTERS:
        assert load_config(None, [f"scorer.filter_mode={name}"]).scorer.filter_mode == name
    for name in AVERAGES:
        assert load_config(None, [f"scorer.average={name}"]).scorer.average == name
    with pytest.raises(ConfigError, match="scorer.average: .*'median' is not one of geometric, per_question"):
        load_config(None, ["scorer.average=median"])
    from services.config import describe_fields

    helps = {k: h for k, _, h in describe_fields()}
    assert all(r.description in helps["scorer.filter_mode"] for r in FILTERS.values())  # the help lists every rule


def test_min_question_costs_a_lost_answer_all_of_p():
    """Two questions: the memory keeps the first answer (log-probs -0.1) and lost the second (-3.0)."""
    full = np.array([-0.1, -0.1, -0.1, -0.1])
    mem = np.array([-0.1, -0.1, -3.0, -3.0])
    spans = [(0, 2), (2, 4)]
    r = memory_reward(full, mem, mode="none", average="min_question", spans=spans)
    assert r.p_full == pytest.approx(math.exp(-0.1), rel=1e-6)
    assert r.p_mem == pytest.approx(math.exp(-3.0), rel=1e-6)  # per_question would give (e^-0.1 + e^-3) / 2
    assert memory_reward(full, mem, mode="none", average="per_question", spans=spans).p_mem > r.p_mem


def test_only_the_questions_named_are_scored_under_any_filter_and_average():
    # question 2's answer was never shown: a memory that guessed it right must gain nothing from it
    spans = [(0, 2), (3, 5)]
    full = [-0.1, -0.1, -0.05, -6.0, -6.0]
    guessed = [-0.1, -0.1, -0.05, -0.1, -0.1]
    assert memory_reward(full, guessed, TAU, "none", average="per_question", spans=spans).r_mem > 0.4
    for mode in ("none", "independent", "floor"):
        for average in ("per_question", "geometric", "arithmetic", "min_question"):
            r = memory_reward(full, guessed, TAU, mode, average=average, spans=spans, questions=[0])
            assert r.r_mem == pytest.approx(0.0, abs=1e-9), (mode, average)
            assert not r.mem_keep[2:].any() and not r.full_keep[2:].any()
    one = memory_reward(full, guessed, TAU, "none", average="geometric", spans=spans, questions=[1])
    assert one.p_mem == pytest.approx(math.exp(-0.1)) and one.p_full == pytest.approx(math.exp(-6.0))
    with pytest.raises(ValueError, match="do not index"):
        memory_reward(full, guessed, TAU, "none", spans=spans, questions=[2])
    with pytest.raises(ValueError, match="do not index"):
        memory_reward(full, guessed, TAU, "none", spans=spans, questions=[])
