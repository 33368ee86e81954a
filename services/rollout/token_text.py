"""Exact text <-> token-position mapping for generated token ids (tokens in, tokens out).

The parser reads text, but training data is token positions. For a byte-level BPE vocabulary
(Qwen2.5's and the embedded world's) every token id is a fixed byte string, so the text of a
response is the UTF-8 decoding of the concatenated bytes, and every character offset maps to a
byte offset and hence to a token index. Decoding uses ``surrogateescape`` so that even a response
cut in the middle of a multi-byte character keeps a one-to-one char <-> byte correspondence.

    tt = TokenText(tokenizer)
    text, ends = tt.decode(response_ids)          # ends[i] = byte offset after token i
    ts, te = tt.token_span(text, ends, cs, ce)    # smallest token range covering text[cs:ce]
"""

from __future__ import annotations

import bisect

from transformers import PreTrainedTokenizerBase


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


class TokenText:
    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._decoder = _byte_decoder()
        self._special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        b = self._cache.get(token_id)
        if b is None:
            piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
            if piece is None:
                raise ValueError(f"token id {token_id} is not in the vocabulary")
            if token_id in self._special or any(c not in self._decoder for c in piece):
                b = piece.encode("utf-8")  # added/special tokens are stored as plain text
            else:
                b = bytes(self._decoder[c] for c in piece)
            self._cache[token_id] = b
        return b

    def decode(self, ids) -> tuple[str, list[int]]:
        """(text, ends): ``ends[i]`` is the byte offset just after token i."""
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
