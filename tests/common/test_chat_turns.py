"""The observation turn derived from the model's own chat template: ChatML and Llama-2's [INST] format."""

import logging

import pytest
from transformers import AutoTokenizer

from services.common.chat_turns import (AUTO, CHATML_OBSERVATION_TEMPLATE, after_eos, observation_template,
                                        resolve_observation_template)
from services.rollout.settings import DEFAULT_OBSERVATION_TEMPLATE


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from tests.sp_tokenizer import sentencepiece_tokenizer

    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))


def test_chatml_models_get_the_chatml_turn(world, qwen_tokenizer):
    assert DEFAULT_OBSERVATION_TEMPLATE == AUTO
    assert observation_template(AutoTokenizer.from_pretrained(world / "model")) == CHATML_OBSERVATION_TEMPLATE
    assert observation_template(qwen_tokenizer) == CHATML_OBSERVATION_TEMPLATE


def test_llama2_turn_comes_from_its_template(sp_tok):
    template = observation_template(sp_tok)
    assert template == " </s><s>[INST] {observation} [/INST]"
    # the template continues a conversation exactly as the chat template renders the next turns
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    before = sp_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    after = sp_tok.apply_chat_template(msgs + [{"role": "assistant", "content": "X"}, {"role": "user", "content": "O"}],
                                       add_generation_prompt=True, tokenize=False)
    assert after == before + " X" + template.format(observation="O")


def test_braces_in_a_template_are_escaped(sp_tok, tmp_path):
    tok = AutoTokenizer.from_pretrained(sp_tok.name_or_path)
    tok.chat_template = ("{% for m in messages %}{{ '{' + m['role'] + '}' + m['content'] + '{/}' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '{assistant}' }}{% endif %}")
    t = observation_template(tok)
    assert t.format(observation="O") == "{/}{user}O{/}{assistant}"


def test_resolve_warns_about_chatml_on_another_format(sp_tok, world, caplog):
    with caplog.at_level(logging.WARNING, logger="mempo.chat_turns"):
        assert resolve_observation_template(sp_tok, CHATML_OBSERVATION_TEMPLATE) == CHATML_OBSERVATION_TEMPLATE
    assert "not" in caplog.text and "[INST]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mempo.chat_turns"):
        world_tok = AutoTokenizer.from_pretrained(world / "model")
        assert resolve_observation_template(world_tok, CHATML_OBSERVATION_TEMPLATE) == CHATML_OBSERVATION_TEMPLATE
        assert resolve_observation_template(sp_tok, "custom {observation}") == "custom {observation}"
    assert not caplog.text
    assert resolve_observation_template(sp_tok, AUTO) == observation_template(sp_tok)


def test_no_chat_template_is_an_error(sp_tok):
    tok = AutoTokenizer.from_pretrained(sp_tok.name_or_path)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        observation_template(tok)


def test_after_eos_drops_the_closing_token_once():
    assert after_eos(CHATML_OBSERVATION_TEMPLATE, "<|im_end|>").startswith("\n<|im_start|>user\n")
    assert after_eos(" </s><s>[INST] o [/INST]", "</s>") == "<s>[INST] o [/INST]"
    assert after_eos("<s>[INST] o </s>", "</s>") == "<s>[INST] o </s>"  # not the closing token: kept
    assert after_eos("x", "") == "x"
