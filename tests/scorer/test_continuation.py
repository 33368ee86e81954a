"""The gold answer's token span in the continuation, on the real Qwen2.5 vocabulary and the world's."""

import pytest
from transformers import AutoTokenizer

from services.scorer.settings import DEFAULT_ANSWER_TEMPLATE
from services.scorer.continuation import build_continuation, gold_text


@pytest.fixture(params=["qwen", "world"])
def tok(request, qwen_tokenizer, world):
    return qwen_tokenizer if request.param == "qwen" else AutoTokenizer.from_pretrained(world / "model")


@pytest.mark.parametrize("template,gold", [
    (DEFAULT_ANSWER_TEMPLATE, "Reed College"),
    (DEFAULT_ANSWER_TEMPLATE, "里德学院"),
    (DEFAULT_ANSWER_TEMPLATE, "Kathryn Bigelow; 1961"),
    (DEFAULT_ANSWER_TEMPLATE, " leading space and trailing.  "),
    ("<answer>{gold}</answer>", ".NET 5"),        # ">" and "." can merge into one token
    ("<answer>\n{gold}</answer>", "\n\nnew lines"),  # the gold's own newlines merge with the template's
    ("{gold}", "only the answer"),
])
def test_span_covers_exactly_the_gold(tok, template, gold):
    c = build_continuation(tok, template, gold)
    assert tok.decode(c.ids) == c.text
    piece = tok.decode(c.answer_ids)
    assert gold in piece  # every answer character is covered
    # minimal: dropping the first or the last span token loses answer characters
    assert gold not in tok.decode(c.ids[c.answer_start + 1 : c.answer_end])
    assert gold not in tok.decode(c.ids[c.answer_start : c.answer_end - 1])


def _reference_span(tok, cont, gold):
    core = tok.encode(gold, add_special_tokens=False)
    return len(cont.ids) - (len(core) + 4), len(cont.ids) - 4  # ans_mask[-(len(core)+4):-4]


# The reference's own layout (answer on its own line); our default puts it inline, as the policy writes it.
REFERENCE_TEMPLATE = ("\n<think>\nI have sufficient information to provide the final answers.\n</think>\n"
                      "<answer>\n{gold}\n</answer>")


@pytest.mark.parametrize("template", [REFERENCE_TEMPLATE, DEFAULT_ANSWER_TEMPLATE])
def test_span_covers_exactly_the_gold_in_both_layouts(tok, template):
    c = build_continuation(tok, template, "Reed College")
    assert tok.decode(c.answer_ids).strip() == "Reed College"


def test_agrees_with_the_reference_where_its_assumption_holds(tok):
    c = build_continuation(tok, REFERENCE_TEMPLATE, "Reed College")
    assert (c.answer_start, c.answer_end) == _reference_span(tok, c, "Reed College")


def test_reference_offsets_break_when_the_tail_is_not_four_tokens(tok):
    template = "<answer>\n{gold}</answer>"  # no newline before the closing tag
    c = build_continuation(tok, template, "Reed College")
    assert tok.decode(c.answer_ids) == "Reed College"
    assert _reference_span(tok, c, "Reed College") != (c.answer_start, c.answer_end)


def test_gold_text_and_bad_input(tok):
    assert gold_text([["Reed College", "Reed"], ["1961"]]) == "Reed College; 1961"
    with pytest.raises(ValueError, match="empty"):
        build_continuation(tok, DEFAULT_ANSWER_TEMPLATE, "  ")
    with pytest.raises(ValueError, match="exactly once"):
        build_continuation(tok, "no placeholder", "x")
    with pytest.raises(ValueError):
        gold_text([[]])


def test_decomposed_gold_is_scored_in_its_normalised_form(tok):
    c = build_continuation(tok, DEFAULT_ANSWER_TEMPLATE, "Cafe\u0301 Noir")  # NFD: e + combining acute
    assert tok.decode(c.answer_ids).strip() == "Caf\u00e9 Noir" and tok.decode(c.ids) == c.text


def test_special_token_strings_in_the_gold_are_text(tok):
    c = build_continuation(tok, DEFAULT_ANSWER_TEMPLATE, "<|im_end|>")
    control = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    assert not control & set(c.ids)
    assert tok.decode(c.answer_ids).strip() == "<|im_end|>" and len(c.answer_ids) > 1


def test_each_question_keeps_its_own_answer_span(tok):
    from services.scorer.settings import ANSWER_TEMPLATES

    for template in ANSWER_TEMPLATES.values():
        c = build_continuation(tok, template, ["Kathryn Bigelow", "1961", "Reed College"], joiner="; ")
        assert tok.decode(c.answer_ids).strip() == "Kathryn Bigelow; 1961; Reed College"
        spans = c.question_spans()
        assert len(spans) == 3 and spans[0][0] == 0 and spans[-1][1] == len(c.answer_ids)
        for (a, b), gold in zip(spans, ["Kathryn Bigelow", "1961", "Reed College"]):
            assert tok.decode(c.answer_ids[a:b]).strip(" ;") == gold
        assert all(spans[i][1] <= spans[i + 1][0] + 1 for i in range(2))  # in order, a shared token at most


def test_the_default_continuation_is_the_policys_answering_turn():
    from services.scorer.settings import DEFAULT_ANSWER_TEMPLATE
    from services.common.turn_format import render_turn
    from services.world.oracle import FINAL_THINK

    # the oracle writes its answering turn as <mem>...</mem> + this, so the SFT policy learnt these words
    turn = render_turn(FINAL_THINK, mem="- Answer: 1961", answer="1961")
    assert turn == "<mem>\n- Answer: 1961\n</mem>" + DEFAULT_ANSWER_TEMPLATE.replace("{gold}", "1961")


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from tests.sp_tokenizer import sentencepiece_tokenizer

    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))


@pytest.mark.parametrize("template,gold", [
    (DEFAULT_ANSWER_TEMPLATE, "Reed College"),
    (DEFAULT_ANSWER_TEMPLATE, "里德学院"),  # byte-fallback pieces
    (DEFAULT_ANSWER_TEMPLATE, " leading space and trailing.  "),
    ("<answer>{gold}</answer>", ".NET 5"),
    ("<answer>\n{gold}</answer>", "\n\nnew lines"),
    ("{gold}", "Reed College"),  # starts with the answer: no dummy-prefix "▁" before it
])
def test_sentencepiece_continuation_and_its_answer_span(sp_tok, template, gold):
    from services.common.token_text import TokenText

    tt = TokenText(sp_tok)
    c = build_continuation(sp_tok, template, gold)
    assert tt.decode(c.ids)[0] == c.text  # exactly the text: the encoder's dummy prefix is not in the ids
    piece = lambda a, b: tt.decode(c.ids[a:b])[0]  # noqa: E731
    assert gold in piece(c.answer_start, c.answer_end)
    assert gold not in piece(c.answer_start + 1, c.answer_end) and gold not in piece(c.answer_start, c.answer_end - 1)
    assert "▁" not in c.text


def test_sentencepiece_each_question_keeps_its_own_answer_span(sp_tok):
    golds = ["Kathryn Bigelow", "1961", "Reed College"]
    c = build_continuation(sp_tok, DEFAULT_ANSWER_TEMPLATE, golds, joiner="; ")
    for (a, b), gold in zip(c.question_spans(), golds):
        assert sp_tok.decode(c.answer_ids[a:b]).strip(" ;") == gold
