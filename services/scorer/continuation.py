"""The answer continuation scored after each context, and where its gold answer tokens are.

The continuation is assistant text from ``scorer.answer_template`` with ``{gold}`` replaced by the
gold answer (the first gold of each question, joined by ``scorer.gold_joiner`` when k > 1); each
question's answer keeps its own token span, so a rule over questions needs no rebuild. Its
answer tokens are located from exact character -> byte -> token offsets of the tokenised
continuation, never by assuming how many tokens the closing tags take (the reference's
``ans_mask[-(len(core)+4):-4]`` breaks with other tokenizers or when BPE merges across the
boundary). A token that straddles the boundary (e.g. ``">."`` for ``<answer>.NET``) contains answer
characters, so it counts as an answer token.

The gold is user text (services/common/model_io.py): a special-token string in it is ordinary
text, only the configured template may contribute control tokens. It is NFC-normalised first:
the tokenizers normalise to NFC, so a decomposed gold ("Cafe\u0301") would not decode back to the
text it was built from and its answer span could not be located.

A continuation follows the context's last token, so its ids are those of text that continues
earlier text: a SentencePiece tokenizer (Llama, Mistral) puts a dummy-prefix "▁" before the start
of what it encodes, a space the continuation does not have (token_text.py's leading-space rule);
the text is then encoded after a one-token anchor whose ids are dropped (``continuation_ids``).

    cont = build_continuation(tokenizer, cfg.scorer.answer_template, "Reed College")
    cont.ids[cont.answer_start:cont.answer_end]   # the tokens of "Reed College"
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from services.common.model_io import CONTINUATION_ANCHORS, mixed_ids
from services.common.token_text import TokenText


@dataclass
class Continuation:
    text: str
    ids: list[int]
    answer_start: int  # token span of the gold answer in ``ids`` (all questions' answers and their joiners)
    answer_end: int
    spans: list[tuple[int, int]] | None = None  # each question's answer, token spans in ``ids`` (None: one)

    @property
    def answer_ids(self) -> list[int]:
        return self.ids[self.answer_start:self.answer_end]

    def question_spans(self) -> list[tuple[int, int]]:
        """Each question's answer as a token span relative to the answer span (``answer_ids``), in order."""
        spans = self.spans or [(self.answer_start, self.answer_end)]
        return [(a - self.answer_start, b - self.answer_start) for a, b in spans]


def gold_answers(golds: list[list[str]]) -> list[str]:
    """The scored answers: the first gold answer of each question."""
    if not golds or any(not g for g in golds):
        raise ValueError("every question needs at least one gold answer")
    return [str(g[0]) for g in golds]


def gold_text(golds: list[list[str]], joiner: str = "; ") -> str:
    """The scored answer as one string: the first gold answer of each question, joined."""
    return joiner.join(gold_answers(golds))


def continuation_ids(tokenizer, parts: list[tuple[str, bool]], tt: TokenText) -> list[int]:
    """``mixed_ids`` of ``parts`` as a continuation of earlier tokens: when the tokenizer adds a
    dummy-prefix space, the ids of the parts behind an anchor whose ids are a prefix of them, that
    prefix dropped; the ids are kept only when they decode (``TokenText``) to exactly the text."""
    text = "".join(t for t, _ in parts)
    ids = mixed_ids(tokenizer, parts)
    if tt.decode(ids)[0] == text:
        return ids
    for anchor in CONTINUATION_ANCHORS:
        head = mixed_ids(tokenizer, [(anchor, False)])
        full = mixed_ids(tokenizer, [(anchor, False)] + list(parts))
        if full[:len(head)] == head and tt.decode(full[len(head):])[0] == text:
            return full[len(head):]
    return ids


def build_continuation(tokenizer, template: str, gold: str | list[str], token_text: TokenText | None = None,
                       joiner: str = "; ") -> Continuation:
    """``template`` with ``{gold}`` replaced by the gold answer; a list of answers (one per question) is
    joined with ``joiner`` and each keeps its own token span (``Continuation.spans``)."""
    if template.count("{gold}") != 1:
        raise ValueError("scorer.answer_template must contain {gold} exactly once")
    parts = [unicodedata.normalize("NFC", g) for g in ([gold] if isinstance(gold, str) else gold)]
    if not parts or any(not g.strip() for g in parts):
        raise ValueError("the gold answer is empty")
    gold = joiner.join(parts)
    before, after = template.split("{gold}")
    text, start = before + gold + after, len(before)
    tt = token_text or TokenText(tokenizer)
    ids = continuation_ids(tokenizer, [(before, True), (gold, False), (after, True)], tt)
    decoded, ends = tt.decode(ids)
    if decoded != text:
        raise ValueError("the tokenizer does not round-trip the continuation text; cannot locate the answer")
    ts, te = tt.token_span(text, ends, start, start + len(gold))
    spans, at = [], start
    for g in parts:  # a token straddling a joiner counts for the answer whose characters it holds
        spans.append(tt.token_span(text, ends, at, at + len(g)))
        at += len(g) + len(joiner)
    return Continuation(text, ids, ts, te, spans)
