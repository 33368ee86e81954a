"""Text <-> token positions from token bytes, on the world's tokenizer and the real Qwen2.5 vocabulary."""

import pytest
from transformers import AutoTokenizer

from services.rollout.parser import parse_turn
from services.rollout.token_text import TokenText, clean

TEXTS = [
    "<mem>\nAda Brenn was born in Kalton.\n</mem>\n<think>\nNow the country.\n</think>\n<search>\nKalton country\n</search>",
    "<mem>\n乔布斯曾就读于里德学院 (Reed College)。\n</mem>\n<think>\n够了\n</think>\n<answer>\n里德学院\n</answer>",
    "<mem>\n- Kathryn Bigelow directed it.\n</mem><think>x</think><answer>\nKathryn Bigelow; 1961\n</answer>\n",
]


@pytest.fixture(params=["world", "qwen"])
def tok(request, world, qwen_tokenizer):
    return AutoTokenizer.from_pretrained(world / "model") if request.param == "world" else qwen_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_tokenizer_and_spans_land_on_tags(tok, text):
    tt = TokenText(tok)
    ids = tok.encode(text, add_special_tokens=False)
    decoded, ends = tt.decode(ids)
    assert decoded == text == tok.decode(ids)
    assert ends[-1] == len(text.encode())
    p = parse_turn(decoded, 2)
    for block in (p.mem, p.action_block):
        ts, te = tt.token_span(decoded, ends, block.start, block.end)
        piece = tok.decode(ids[ts:te])
        tag = decoded[block.start : block.end]
        assert tag in piece  # covers the whole block
        # and is minimal: dropping either end token loses part of the block
        assert tag not in tok.decode(ids[ts + 1 : te]) and tag not in tok.decode(ids[ts : te - 1])


def test_cut_inside_a_multibyte_character_keeps_offsets(qwen_tokenizer):
    tt = TokenText(qwen_tokenizer)
    ids = qwen_tokenizer.encode("<answer>里德学院</answer>", add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        text, ends = tt.decode(ids[:cut])
        assert len(text.encode("utf-8", "surrogateescape")) == ends[-1]
        assert isinstance(clean(text), str)
        clean(text).encode("utf-8")  # no lone surrogates left


def test_special_tokens_decode_as_their_text(qwen_tokenizer):
    tt = TokenText(qwen_tokenizer)
    assert tt.decode([151645, 198])[0] == "<|im_end|>\n"
    with pytest.raises(ValueError):
        tt.token_span("abc", [1, 2, 3], 2, 1)
