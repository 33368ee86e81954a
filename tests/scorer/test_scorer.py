"""MemoryScorer on oracle episodes: every value equals a straightforward per-sequence computation."""

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.messages import TrajectoryBatch
from services.scorer.continuation import build_continuation, gold_answers
from services.algorithm.memory_reward import memory_reward
from services.scorer.packing import naive_logprobs
from services.scorer.scorer import MemoryScorer
from services.world.oracle_records import oracle_group


@pytest.fixture(scope="module")
def setup(world, tiny_cfg):
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32).eval()
    rows = pd.read_parquet(world / "train.parquet").to_dict("records")
    rows = [r for r in rows if r["extra_info"]["k"] == 2][:2]
    groups = [oracle_group(tiny_cfg, world, r, n=4, tokenizer=tok, seed=i) for i, r in enumerate(rows)]
    return tok, model, TrajectoryBatch(groups=groups, policy_version=5)


def naive_check(model, tok, cfg, batch, out):
    for s in out.scores:
        group = batch.groups[s.group]
        ep, turn = group.episodes[s.episode], group.episodes[s.episode].turns[s.turn]
        cont = build_continuation(tok, cfg.scorer.answer_template, gold_answers(group.prompt.golds), None,
                                  cfg.scorer.gold_joiner)
        a0, a1 = cont.answer_start, cont.answer_end
        full = naive_logprobs(model, ep.full_ids[: turn.full_prefix_len].tolist(), cont.ids)[a0:a1]
        mem_ctx = ep.prompt_ids.tolist() + turn.response_ids[turn.mem_start : turn.mem_end].tolist()
        mem = naive_logprobs(model, mem_ctx, cont.ids)[a0:a1]
        np.testing.assert_allclose(s.full_logp, full, atol=1e-4)
        np.testing.assert_allclose(s.mem_logp, mem, atol=1e-4)
        c = cfg.scorer
        r = memory_reward(full, mem, c.tau, c.filter_mode, c.mean_eps, c.average, cont.question_spans(), c.logp_floor)
        assert s.full_keep.tolist() == r.full_keep.tolist() and s.mem_keep.tolist() == r.mem_keep.tolist()
        assert s.p_full == pytest.approx(r.p_full, abs=1e-4) and s.p_mem == pytest.approx(r.p_mem, abs=1e-4)
        assert s.r_mem == pytest.approx(r.r_mem, abs=1e-4)
        assert s.answer_ids.tolist() == cont.answer_ids


def test_every_block_is_scored_like_the_naive_computation(setup, tiny_cfg):
    tok, model, batch = setup
    out = MemoryScorer(model, tok, tiny_cfg).score_trajectories(batch, version=5)
    expected = [(g, e, t) for g, grp in enumerate(batch.groups) for e, ep in enumerate(grp.episodes)
                for t, turn in enumerate(ep.turns) if turn.mem_start >= 0 and turn.turn >= 2]
    assert [(s.group, s.episode, s.turn) for s in out.scores] == expected and expected
    assert out.policy_version == 5 and out.filter_mode == "none"
    naive_check(model, tok, tiny_cfg, batch, out)
    # prefix sharing: fewer tokens through the model than two separate sequences per block
    cont_len = {g: len(build_continuation(tok, tiny_cfg.scorer.answer_template,
                                          gold_answers(grp.prompt.golds)).ids) for g, grp in enumerate(batch.groups)}
    naive_tokens = 0
    for g, e, t in expected:
        ep, turn = batch.groups[g].episodes[e], batch.groups[g].episodes[e].turns[t]
        naive_tokens += turn.full_prefix_len + len(ep.prompt_ids) + (turn.mem_end - turn.mem_start) + 2 * cont_len[g]
    assert 0 < out.metrics["model_tokens"] < naive_tokens / 2


def test_turn_one_and_unclosed_blocks_are_not_scored(setup, tiny_cfg):
    tok, model, batch = setup
    out = MemoryScorer(model, tok, tiny_cfg).score_trajectories(batch, version=5)
    for s in out.scores:
        turn = batch.groups[s.group].episodes[s.episode].turns[s.turn]
        assert turn.turn >= 2 and turn.mem_start >= 0


def test_a_gold_without_a_continuation_skips_its_group_not_the_batch(setup, tiny_cfg):
    import copy

    tok, model, batch = setup
    batch = copy.deepcopy(batch)
    batch.groups[0].prompt.golds = [[], ["x"]]                                     # no gold to score
    batch.groups[1].prompt.golds = [["Cafe\u0301"] + g[1:] for g in batch.groups[1].prompt.golds]  # NFD
    out = MemoryScorer(model, tok, tiny_cfg).score_trajectories(batch, version=5)
    assert out.metrics["golds_skipped"] == 1.0
    assert out.scores and {s.group for s in out.scores} == {1}
    assert tok.decode(out.scores[0].answer_ids).strip().startswith("Caf\u00e9")


def test_shown_answers_only_scores_the_questions_the_history_had_shown(setup, tiny_cfg):
    from services.algorithm.retention import shown_answers
    from services.common.token_text import TokenText

    tok, model, batch = setup
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.scorer.scored_answers = "shown"
    every = MemoryScorer(model, tok, tiny_cfg).score_trajectories(batch, version=5)
    out = MemoryScorer(model, tok, cfg).score_trajectories(batch, version=5)
    assert out.scores and out.metrics["blocks_unshown"] > 0  # oracle episodes search before they find
    assert len(out.scores) + out.metrics["blocks_unshown"] == len(every.scores)
    partial = 0
    for s in out.scores:
        group = batch.groups[s.group]
        found = shown_answers(TokenText(tok), group, [(s.episode, s.turn)])[0]
        assert found  # a block with nothing shown gets no score
        cont = build_continuation(tok, cfg.scorer.answer_template, gold_answers(group.prompt.golds), None,
                                  cfg.scorer.gold_joiner)
        c = cfg.scorer
        r = memory_reward(s.full_logp, s.mem_logp, c.tau, c.filter_mode, c.mean_eps, c.average,
                          cont.question_spans(), c.logp_floor, sorted(found))
        assert s.r_mem == pytest.approx(r.r_mem, abs=1e-6) and s.mem_keep.tolist() == r.mem_keep.tolist()
        partial += len(found) < len(group.prompt.golds)
    assert partial  # some blocks had seen one answer of two: only that one counted


def test_each_block_carries_its_questions_own_reward_and_memory_sections(setup, tiny_cfg):
    from services.algorithm.retention import shown_answers
    from services.common.token_text import TokenText

    tok, model, batch = setup
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.scorer.scored_answers = "shown"
    out = MemoryScorer(model, tok, cfg).score_trajectories(batch, version=5)
    tt = TokenText(tok)
    sections = 0
    for s in out.scores:
        group = batch.groups[s.group]
        k = len(group.prompt.golds)
        turn = group.episodes[s.episode].turns[s.turn]
        found = shown_answers(tt, group, [(s.episode, s.turn)])[0]
        cont = build_continuation(tok, cfg.scorer.answer_template, gold_answers(group.prompt.golds), None,
                                  cfg.scorer.gold_joiner)
        c = cfg.scorer
        assert s.question_r_mem.shape == (k,) and s.question_spans.shape == (k, 2)
        for q in range(k):
            if q not in found:  # not scored: no value of its own
                assert np.isnan(s.question_r_mem[q])
                continue
            alone = memory_reward(s.full_logp, s.mem_logp, c.tau, c.filter_mode, c.mean_eps, c.average,
                                  cont.question_spans(), c.logp_floor, [q])
            assert s.question_r_mem[q] == pytest.approx(alone.r_mem, abs=1e-6)
        starts = []
        for q, (a, b) in enumerate(s.question_spans.tolist()):
            assert turn.mem_start <= a < b <= turn.mem_end  # the oracle's memories name every question
            text = tt.decode(turn.response_ids[a:b].tolist())[0]
            assert text.lstrip("\n").startswith(f"Q{q + 1}: ") and "</mem>" not in text
            starts.append(a)
            sections += 1
        ends = [b for _, b in s.question_spans.tolist()]
        assert starts == sorted(starts) and all(e <= n for e, n in zip(ends, starts[1:]))  # disjoint, in order
    assert sections


def test_section_spans_on_odd_memories(setup):
    from services.common.model_io import text_ids
    from services.common.token_text import TokenText
    from services.scorer.scorer import section_spans

    tok, _, _ = setup
    tt = TokenText(tok)
    memory = "<mem>\nQ2: second?\n- Answer: Kroumia\nQ2: again?\n- x.\nQ9: none\n</mem>\nQ1: after the block"
    ids = np.asarray(text_ids(tok, memory), np.int32)
    end = len(ids)
    spans = section_spans(tt, ids, 0, end, 2)
    assert spans[0].tolist() == [-1, -1]  # no Q1 inside the memory (the one after </mem> does not count)
    a, b = spans[1].tolist()
    text = tt.decode(ids[a:b].tolist())[0]
    assert "Q2: second?" in text and "Answer: Kroumia" in text and "again" not in text  # the first Q2 only
    assert section_spans(tt, ids, 0, end, 0).shape == (0, 2)
