"""Exact text <-> token-position mapping for generated token ids (tokens in, tokens out).

The parser reads text, but training data is token positions. Every token id stands for a fixed byte
string, read from the tokenizer's own decoder (``tokenizer.backend_tokenizer.decoder``):

==========================================  ===================================================
decoder                                     bytes of one token
==========================================  ===================================================
``ByteLevel`` (GPT-2, Qwen2.5, SmolLM2,     each character of the piece is a stand-in for one
the embedded world)                         byte (GPT-2's ``bytes_to_unicode``)
SentencePiece style: ``Replace("▁", " ")``  ``<0xNN>`` pieces are the byte NN (``ByteFallback``),
/ ``Metaspace``, ``ByteFallback``, ``Fuse``, every other piece is its UTF-8 text with "▁" read as
``Strip`` (Llama, Mistral, Gemma)           a space
anything else (WordPiece, ...)              the text the tokenizer appends for the token after
                                            a fixed anchor token (``decode([a, id])`` minus
                                            ``decode([a])``): exact for whole characters
==========================================  ===================================================

Added and special tokens go through the same decoder, as the tokenizer's own ``decode`` sends them
(``<|im_end|>`` is its text; a special ``<0x41>`` under ``ByteFallback`` is "A").

**The leading-space rule.** A SentencePiece decoder strips one leading space from the *first*
token of whatever it decodes (``Strip(" ", 1, 0)`` after ``Fuse``, or ``Metaspace``'s
``prepend_scheme``): the dummy prefix that its encoder adds. ``TokenText`` never strips it: it
decodes ids as a *continuation* (what the tokenizer's ``decode`` adds after earlier tokens), because
a response continues its prompt and a leading "▁" the model sampled is a real space. So
``decode(ids)`` equals ``tokenizer.decode(ids, skip_special_tokens=False,
clean_up_tokenization_spaces=False)`` for valid UTF-8, except that it keeps that one leading
space; for byte-level BPE the two are always equal. Tokens' bytes concatenate to the whole, and
``ends`` are byte offsets.

Decoding uses ``surrogateescape`` so that even a response cut in the middle of a multi-byte
character keeps a one-to-one char <-> byte correspondence (``clean`` makes such text printable).

    tt = TokenText(tokenizer)
    text, ends = tt.decode(response_ids)          # ends[i] = byte offset after token i
    ts, te = tt.token_span(text, ends, cs, ce)    # smallest token range covering text[cs:ce]
"""

from __future__ import annotations

import bisect
import json
import re
from typing import Callable, Optional

from transformers import PreTrainedTokenizerBase

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_ANCHORS = ("a", "x", "e", "A", "0", ".")  # plain one-character tokens for the generic rule


def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable stand-in character of each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


def _steps(spec: dict) -> list[dict]:
    """A decoder spec (tokenizers' JSON) as a flat list of steps."""
    if spec.get("type") == "Sequence":
        return [s for d in spec.get("decoders", []) for s in _steps(d)]
    return [spec]


def piece_rule(steps: list[dict]) -> Optional[Callable[[str], bytes]]:
    """piece -> bytes for a decoder made of the steps this module knows, or None.

    ``ByteLevel`` maps every character to its byte (a piece with a character outside the map is its
    UTF-8, as the tokenizers library does); ``Replace`` with a plain-string pattern and ``Metaspace``
    replace in the piece; ``ByteFallback`` makes a ``<0xNN>`` piece the byte NN; ``Fuse`` only joins;
    ``Strip`` after ``Fuse`` only touches the first token's start (the leading-space rule keeps it)."""
    fused = False
    for s in steps:
        t = s.get("type")
        if t == "Fuse":
            fused = True
        elif t == "Strip":
            if not fused or s.get("stop", 0):
                return None  # per-token stripping or stripping the end: not a per-token constant
        elif t == "Replace":
            if "String" not in (s.get("pattern") or {}):
                return None
        elif t not in ("ByteLevel", "ByteFallback", "Metaspace"):
            return None

    def rule(piece: str) -> bytes:
        for s in steps:
            t = s["type"]
            if t == "ByteLevel":
                if all(c in _BYTES for c in piece):
                    return bytes(_BYTES[c] for c in piece)
                return piece.encode("utf-8")
            if t == "Replace":
                piece = piece.replace(s["pattern"]["String"], s["content"])
            elif t == "Metaspace":
                piece = piece.replace(s.get("replacement", "▁"), " ")
            elif t == "ByteFallback":
                m = _BYTE_PIECE.fullmatch(piece)
                if m:
                    return bytes([int(m.group(1), 16)])
        return piece.encode("utf-8")

    return rule


def decoder_steps(tokenizer: PreTrainedTokenizerBase) -> Optional[list[dict]]:
    """The decoder of a tokenizers-backed tokenizer as steps; None when it has none to read."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None) if backend is not None else None
    if decoder is None:
        return None
    return _steps(json.loads(decoder.__getstate__()))


class TokenText:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._cache: dict[int, bytes] = {}
        steps = decoder_steps(tokenizer)
        self._rule = piece_rule(steps) if steps is not None else None
        if self._rule is None and steps is None and getattr(tokenizer, "byte_decoder", None):  # a Python GPT-2 tokenizer
            self._rule = piece_rule([{"type": "ByteLevel"}])
        self._sp = getattr(tokenizer, "sp_model", None) if self._rule is None and steps is None else None
        self.kind = "pieces" if self._rule else ("sentencepiece" if self._sp is not None else "anchored")
        self._anchor: Optional[tuple[int, str]] = None

    def _anchored(self, token_id: int) -> bytes:
        """The generic rule: what ``tokenizer.decode`` appends for the token after an anchor token."""
        if self._anchor is None:
            for a in _ANCHORS:
                ids = self.tokenizer.encode(a, add_special_tokens=False)
                if len(ids) == 1:
                    self._anchor = (ids[0], self.tokenizer.decode(ids, skip_special_tokens=False,
                                                                  clean_up_tokenization_spaces=False))
                    break
            else:
                raise ValueError("no one-character anchor token to read this tokenizer's token texts with")
        aid, atext = self._anchor
        text = self.tokenizer.decode([aid, token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if not text.startswith(atext):
            raise ValueError(f"token {token_id} changes the text before it; its text is not a constant")
        return text[len(atext):].encode("utf-8")

    def token_bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            token_id = int(token_id)
            if self._rule is None and self._sp is None:
                b = self._anchored(token_id)
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                if piece is None:
                    raise ValueError(f"token id {token_id} is not in the vocabulary")
                if self._rule is not None:
                    b = self._rule(piece)
                elif token_id < self._sp.get_piece_size() and self._sp.is_byte(token_id):
                    b = bytes([int(_BYTE_PIECE.fullmatch(piece).group(1), 16)])
                else:
                    b = piece.replace("▁", " ").encode("utf-8")
            self._cache[token_id] = b
        return b

    def decode(self, ids) -> tuple[str, list[int]]:
        """(text, ends): ``ends[i]`` is the byte offset just after token i (leading-space rule above)."""
        ends, total, chunks = [], 0, []
        for i in ids:
            b = self.token_bytes(int(i))
            chunks.append(b)
            total += len(b)
            ends.append(total)
        return b"".join(chunks).decode("utf-8", "surrogateescape"), ends

    @staticmethod
    def byte_offset(text: str, char_offset: int) -> int:
        return len(text[:char_offset].encode("utf-8", "surrogateescape"))

    def token_span(self, text: str, ends: list[int], char_start: int, char_end: int) -> tuple[int, int]:
        """Smallest [token_start, token_end) whose bytes cover ``text[char_start:char_end]``."""
        if not 0 <= char_start < char_end <= len(text):
            raise ValueError(f"bad character span [{char_start}, {char_end}) of a {len(text)}-char text")
        b0, b1 = self.byte_offset(text, char_start), self.byte_offset(text, char_end)
        # token i covers bytes [ends[i-1], ends[i]): first token ending after b0, first ending at/after b1
        return bisect.bisect_right(ends, b0), bisect.bisect_left(ends, b1) + 1


def clean(text: str) -> str:
    """A decoded string made safe for JSON/msgpack (lone surrogates from broken UTF-8 replaced)."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
