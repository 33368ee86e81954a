"""Text <-> token positions from token bytes, on the world's tokenizer and the real Qwen2.5 vocabulary."""

import pytest
from transformers import AutoTokenizer

from services.common.token_text import TokenText, clean
from services.rollout.parser import parse_turn

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


# -- any tokenizer: the bytes of every token come from the tokenizer's own decoder ------------------------

def _gpt2_bytes(tok, token_id, table=__import__("services.common.token_text", fromlist=["_"])._byte_decoder()):
    """The byte-level rule as it was before token texts came from the decoder: the reference."""
    piece = tok.convert_ids_to_tokens(token_id)
    special = token_id in set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    return piece.encode() if special or any(c not in table for c in piece) else bytes(table[c] for c in piece)


def test_byte_level_token_bytes_are_unchanged(qwen_tokenizer):
    tt = TokenText(qwen_tokenizer)
    assert tt.kind == "pieces"
    for i in range(0, len(qwen_tokenizer), 3):  # every third id of 151,665, the added tokens included below
        assert tt.token_bytes(i) == _gpt2_bytes(qwen_tokenizer, i), i
    for i in qwen_tokenizer.added_tokens_decoder:
        assert tt.token_bytes(i) == _gpt2_bytes(qwen_tokenizer, i), i


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    pytest.importorskip("sentencepiece")
    from tests.sp_tokenizer import sentencepiece_tokenizer

    return sentencepiece_tokenizer(tmp_path_factory.mktemp("sp"))


def _after(tok, ids):
    """What tokenizer.decode adds for ``ids`` after an anchor token: the text of ids as a continuation."""
    anchor = tok.encode("a", add_special_tokens=False)
    assert len(anchor) == 1
    full = tok.decode(anchor + list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
    head = tok.decode(anchor, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert full.startswith(head)
    return full[len(head):]


def test_sentencepiece_every_token_is_its_decoded_text(sp_tok):
    tt = TokenText(sp_tok)
    pieces = sp_tok.convert_ids_to_tokens(list(range(len(sp_tok))))
    assert tt.kind == "pieces" and any(p.startswith("<0x") for p in pieces) and any("▁" in p for p in pieces)
    for i, piece in enumerate(pieces):
        b = tt.token_bytes(i)
        if piece.startswith("<0x") and piece.endswith(">"):
            assert b == bytes([int(piece[3:5], 16)])  # byte fallback
        else:
            assert b.decode() == _after(sp_tok, [i]) and "▁" not in b.decode()


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_decode_keeps_the_leading_space_and_spans_land_on_tags(sp_tok, text):
    tt = TokenText(sp_tok)
    ids = sp_tok.encode(text, add_special_tokens=False)
    assert sp_tok.convert_ids_to_tokens(ids[0]).startswith("▁")  # the encoder's dummy prefix
    decoded, ends = tt.decode(ids)
    # the leading-space rule: the text of the ids as a continuation; the tokenizer strips that one space
    assert decoded == " " + text == _after(sp_tok, ids)
    assert decoded[1:] == sp_tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert ends[-1] == len(decoded.encode()) and len(ends) == len(ids)
    assert b"".join(tt.token_bytes(i) for i in ids) == decoded.encode()
    p = parse_turn(decoded, 2)
    assert p.format_ok, p.problems  # the leading space is not stray text
    for block in (p.mem, p.action_block):
        ts, te = tt.token_span(decoded, ends, block.start, block.end)
        tag = decoded[block.start:block.end]
        assert tag in sp_tok.decode(ids[ts:te])
        assert tag not in sp_tok.decode(ids[ts + 1:te]) and tag not in sp_tok.decode(ids[ts:te - 1])


def test_sentencepiece_search_turn_parses_to_a_clean_query(sp_tok):
    tt = TokenText(sp_tok)
    turn = ("<mem>\nAda Brenn was born in Kalton.\n</mem>\n<think>\nWhere is the tower?\n</think>\n"
            "<search> Eiffel Tower </search>")
    ids = sp_tok.encode(turn, add_special_tokens=False)
    text, ends = tt.decode(ids)
    p = parse_turn(text, 2)
    assert p.action == "search" and p.argument == "Eiffel Tower" and p.format_ok
    ms, me = tt.token_span(text, ends, p.mem.start, p.mem.end)
    assert "<mem>\nAda Brenn was born in Kalton.\n</mem>" in sp_tok.decode(ids[ms:me])  # ">\n<" may be one token
    as_, ae = tt.token_span(text, ends, p.action_block.start, p.action_block.end)
    assert "<search> Eiffel Tower </search>" in sp_tok.decode(ids[as_:ae]) and ae == len(ids)
    assert not any("▁" in tt.decode([i])[0] for i in ids)


def test_sentencepiece_cut_inside_a_byte_fallback_character(sp_tok):
    tt = TokenText(sp_tok)
    ids = sp_tok.encode("<answer>里德学院</answer>", add_special_tokens=False)
    assert any(sp_tok.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    for cut in range(1, len(ids) + 1):
        text, ends = tt.decode(ids[:cut])
        assert len(text.encode("utf-8", "surrogateescape")) == ends[-1]
        clean(text).encode("utf-8")
    assert tt.decode(ids)[0] == " <answer>里德学院</answer>"


def test_sentencepiece_special_and_added_tokens(sp_tok):
    tt = TokenText(sp_tok)
    bos, eos = sp_tok.bos_token_id, sp_tok.eos_token_id
    ids = [eos, bos] + sp_tok.encode("[INST] hi", add_special_tokens=False)
    text, _ = tt.decode(ids)
    assert text == "</s><s>" + _after(sp_tok, ids[2:]) == sp_tok.decode(ids, skip_special_tokens=False)
    assert tt.decode([bos])[0] == "<s>"


def test_other_decoders_use_the_anchored_rule():
    """A WordPiece tokenizer (no byte pieces): each token's text is what decode appends after an anchor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "a", "the", "tower", "##s", "eiffel", "<", ">", "search", "/", "x"])}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tt = TokenText(tok)
    ids = tok.encode("<search> eiffel towers </search>", add_special_tokens=False)
    text, ends = tt.decode(ids)
    assert tt.kind == "anchored" and text == " " + tok.decode(ids, clean_up_tokenization_spaces=False)
    assert ends[-1] == len(text.encode())


def test_a_metaspace_decoder_without_byte_fallback(sp_tok, tmp_path):
    """Metaspace as the decoder (T5, older SentencePiece conversions): "▁" is a space, <0xNN> is text."""
    from tokenizers import decoders
    from transformers import AutoTokenizer

    sp_tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.backend_tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tt = TokenText(tok)
    for i in range(len(tok)):
        assert tt.token_bytes(i).decode() == _after(tok, [i]), (i, tok.convert_ids_to_tokens(i))
    ids = tok.encode(TEXTS[0], add_special_tokens=False)
    assert tt.decode(ids)[0] == " " + TEXTS[0] == " " + tok.decode(ids)
