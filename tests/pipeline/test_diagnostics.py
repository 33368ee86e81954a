"""Eval diagnostics on hand-made episodes, and the bootstrap CIs on cases with known answers."""

import json
import math

import numpy as np
import pytest

from services.common.messages import ChatMessage, Episode, Prompt, TurnRecord
from services.pipeline.diagnostics import answer_seen, episode_row, first_search_hit, prompt_entities
from services.pipeline.stats import bootstrap_ci, paired_bootstrap_diff

PROMPT = Prompt(uid="test-1", messages=[ChatMessage("system", "S"), ChatMessage("user", "Where is Sudryl Dynamics based?")],
                golds=[["Kalton"]], extra={"k": 1, "entities": "Sudryl Dynamics"})


def _turn(action: str, text: str, obs: str = "", ok: bool = True) -> TurnRecord:
    return TurnRecord(turn=1, context_ids=np.zeros(3, np.int32), response_ids=np.zeros(2, np.int32),
                      response_logprobs=np.zeros(2, np.float32), action=action, action_text=text, format_ok=ok,
                      observation_ids=np.asarray([ord(c) for c in obs], np.int32))


def _episode(turns, answer=None) -> Episode:
    return Episode(uid="test-1/0", sample=0, prompt_ids=np.zeros(3, np.int32), full_ids=np.zeros(3, np.int32),
                   turns=turns, answer=answer, finish_reason="answer" if answer is not None else "max_turns",
                   total_tokens=10, peak_tokens=5)


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_first_search_hit_looks_at_the_first_query_only():
    hit = _episode([_turn("search", "sudryl dynamics headquartered"), _turn("search", "Gogrerk Media")])
    miss = _episode([_turn("search", "Gogrerk Media headquartered"), _turn("search", "Sudryl Dynamics")])
    assert first_search_hit(hit, ["Sudryl Dynamics"]) == 1.0
    assert first_search_hit(miss, ["Sudryl Dynamics"]) == 0.0
    assert first_search_hit(_episode([_turn("answer", "Kalton")], "Kalton"), ["Sudryl Dynamics"]) == 0.0
    assert math.isnan(first_search_hit(hit, []))
    assert prompt_entities(PROMPT) == ["Sudryl Dynamics"]
    assert prompt_entities(Prompt(uid="x", messages=[], golds=[["a"]])) == []


def test_answer_seen_is_the_share_of_questions_whose_gold_was_observed():
    obs = ['<information>Doc 1 (Title: "Sudryl Dynamics") Sudryl Dynamics is based in Kalton.</information>']
    assert answer_seen(obs, [["Kalton"]]) == 1.0
    assert answer_seen(obs, [["Kalton"], ["Brenvia"]]) == 0.5
    assert answer_seen(obs, [["Kalt"]]) == 0.0  # whole words only
    assert answer_seen([], [["Kalton"]]) == 0.0
    assert answer_seen(obs, [["the Kalton"]]) == 1.0  # SQuAD normalisation drops articles


def test_episode_row_well_formed_answered_and_em():
    good = _episode([_turn("search", "Sudryl Dynamics", obs="Sudryl Dynamics is based in Kalton."),
                     _turn("answer", "Kalton")], answer="Kalton")
    row = episode_row(good, PROMPT, _decode)
    assert row["em"] == 1.0 and row["well_formed"] == 1.0 and row["answered"] == 1.0
    assert row["first_search_hit"] == 1.0 and row["answer_seen"] == 1.0 and row["turns"] == 2.0
    sloppy = _episode([_turn("search", "Sudryl Dynamics", obs="nothing here", ok=False), _turn("answer", "Kalton")],
                      answer="Kalton")
    row = episode_row(sloppy, PROMPT, _decode)
    assert row["well_formed"] == 0.0 and row["em"] == 0.0 and row["answered"] == 1.0 and row["answer_seen"] == 0.0
    never = episode_row(_episode([_turn("search", "Gogrerk")]), PROMPT, _decode)
    assert never["answered"] == 0.0 and never["well_formed"] == 0.0 and never["first_search_hit"] == 0.0


def test_bootstrap_ci_known_cases():
    assert bootstrap_ci([0.3] * 50) == pytest.approx((0.3, 0.3))
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    x = np.r_[np.ones(500), np.zeros(500)]  # mean 0.5, standard error sqrt(0.25 / 1000)
    lo, hi = bootstrap_ci(x)
    half = 1.96 * math.sqrt(0.25 / 1000)
    assert lo == pytest.approx(0.5 - half, abs=0.006) and hi == pytest.approx(0.5 + half, abs=0.006)


def test_paired_bootstrap_diff_known_cases():
    before = np.r_[np.zeros(100), np.ones(100)]
    d, lo, hi = paired_bootstrap_diff(before, before)
    assert (d, lo, hi) == (0.0, 0.0, 0.0)  # identical answers: no difference, no uncertainty
    after = before.copy()
    after[:30] = 1.0  # 30 of 200 prompts flipped to correct, none lost
    d, lo, hi = paired_bootstrap_diff(before, after)
    assert d == pytest.approx(0.15) and 0.0 < lo < 0.15 < hi
    # the same marginal rates, unpaired (gains and losses cancel), give a CI around 0
    mixed = before.copy()
    mixed[:30], mixed[100:130] = 1.0, 0.0
    d, lo, hi = paired_bootstrap_diff(before, mixed)
    assert d == 0.0 and lo < 0.0 < hi
    with pytest.raises(ValueError):
        paired_bootstrap_diff([1.0], [1.0, 0.0])


def test_report_pairs_policies_and_writes_samples(tmp_path):
    from services.pipeline.evaluate import EvalRun
    from services.pipeline.report import write_report

    def run(ems):
        r = EvalRun()
        for i, em in enumerate(ems):
            r.episodes[1].append({"uid": f"test-{i}", "em": em, "f1": em, "turns": 2.0, "tt": 100.0, "pt": 50.0,
                                  "tool_failures": 0.0, "answered": 1.0, "well_formed": 1.0,
                                  "first_search_hit": 1.0, "answer_seen": 1.0})
        r.samples[1].append({"uid": "test-0", "question": "Where is Sudryl Dynamics based?", "golds": [["Kalton"]],
                             "answer": "Kalton", "em": ems[0], "finish": "answer",
                             "turns": [{"response": "<think>\nx\n</think>\n<answer> Kalton </answer>",
                                        "observation": "", "problems": [],
                                        "memory_reward": {"p_mem": 0.9, "p_full": 0.8, "r_mem": 0.1, "retained": 0,
                                                          "tokens": [" Kal", "ton"], "mem_logp": [-0.1, -2.5],
                                                          "full_logp": [-0.2, -0.3], "mem_keep": [True, False],
                                                          "full_keep": [True, True]}}]})
        return r

    runs = {"sft": run([0.0] * 80 + [1.0] * 20), "rl": run([1.0] * 40 + [0.0] * 40 + [1.0] * 20)}
    control = {"sft": run([0.0] * 100).table()}
    paths = write_report(tmp_path, {n: r.table() for n, r in runs.items()}, runs=runs, controls=control)
    text = paths["report"].read_text()
    assert "| rl | 1 | +0.400 |" in text and "| rl | all | +0.400 |" in text  # paired: 40 prompts flipped
    assert "| sft | 1 | 0.200 [" in text and "| sft | 1 | 1.000 | 1.000 | 1.000 | 1.000 | 0.000 [0.000, 0.000] |" in text
    samples = paths["samples"].read_text()
    assert "## rl, k=1, test-0: EM 1.00" in samples and "R_mem +0.100" in samples and "<answer> Kalton </answer>" in samples
    # each block's answer tokens under both contexts, the ones its filter did not count in brackets
    assert ("after the memory: `Kal` -0.10 `ton` (-2.50); after the full history: `Kal` -0.20 `ton` -0.30 "
            "(memory lost a gold answer it had been shown)") in samples
    rows = [json.loads(line) for line in paths["episodes"].read_text().splitlines()]
    assert len(rows) == 200 and rows[0] == {"policy": "sft", "k": 1, "uid": "test-0", "em": 0.0, "f1": 0.0}


def test_pairs_table_differences_named_pairs_and_their_mean_per_prompt():
    from services.pipeline.eval_cli import parse_pairs
    from services.pipeline.evaluate import EvalRun
    from services.pipeline.report import pairs_table

    def run(ems):
        r = EvalRun()
        r.episodes[1] = [{"uid": f"p{i}", "em": em} for i, em in enumerate(ems)]
        return r

    runs = {"a0": run([0.0] * 10), "b0": run([1.0] * 4 + [0.0] * 6),  # seed 0: B wins 4 prompts of 10
            "a1": run([1.0] * 2 + [0.0] * 8), "b1": run([0.0] * 10)}  # seed 1: B loses 2
    text = pairs_table(runs, parse_pairs(["a0:b0,a1:b1", "a0:a1"], runs))
    assert "| b0 - a0 | 1 | +0.400 |" in text and "| b1 - a1 | all | -0.200 |" in text
    assert "| mean of b0 - a0 / b1 - a1 | all | +0.100 |" in text  # per prompt, averaged over the 2 seeds
    assert "| a1 - a0 | all | +0.200 |" in text and text.count("| mean of") == 2  # k=1 and pooled; none for a lone pair
    assert "over seeds" not in text  # two seeds: too few for an interval over them
    runs |= {"a2": run([0.0] * 10), "b2": run([1.0] * 3 + [0.0] * 7)}  # seed 2: B wins 3
    text = pairs_table(runs, parse_pairs(["a0:b0,a1:b1,a2:b2"], runs))
    # seeds as the units: differences +0.4, -0.2, +0.3 -> mean 0.1667, sd 0.3215, t(2) 4.303 -> +-0.799
    assert "| over seeds: b0 - a0 / b1 - a1 / b2 - a2 | all | +0.167 | [-0.632, +0.965] (t over seeds) | 3 seeds |" in text
    for bad in (["a0-b0"], ["a0:zz"], ["a0:a0"], ["a0:b0,"]):
        with pytest.raises(ValueError, match="--pair"):
            parse_pairs(bad, runs)
