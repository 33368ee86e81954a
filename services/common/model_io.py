"""Small model-side helpers every service shares: dtype choice, chat prompt ids, weight checks.

    model_dtype("auto")                 # bfloat16 with CUDA, float32 on CPU
    chat_ids(tokenizer, messages)       # chat-template ids + the assistant generation prompt
    text_ids(tokenizer, text)           # user text: "<|im_end|>" in it is several ordinary tokens
    mixed_ids(tokenizer, [(template_part, True), (user_text, False), ...])
    tensors = validate_weights(tensors, checkpoint_shapes(model_dir))   # before loading an update
    lp = target_logprobs(logits, targets)   # log p(target) at each position: learner, scorer, benches
    lp = forward_logprobs(model, targets, keep, input_ids=ids)   # the same from a forward, logits in chunks

User text is text: a special-token string such as ``<|im_end|>`` inside a message's content, a
memory or a gold answer is encoded as the ordinary tokens of its characters, never as the control
token (a caller could otherwise inject chat structure). Only the chat template (and other
configured templates) may contribute control tokens. For text without special-token strings the
ids are exactly those of tokenising the whole rendered string: the tokenizer itself cuts its input
at special tokens before pre-tokenising, which is what ``mixed_ids`` does, with only the trusted
parts' special tokens as cut points.
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[..., target] at every position, in float32: logits [..., V], targets [...]
    (moved to the logits' device). The one place the learner, the scorer and the benches turn a
    forward's logits into the log-probs of given tokens."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.to(logits.device)[..., None])[..., 0]


HEAD_CHUNK = 1024  # positions whose vocabulary logits ``forward_logprobs`` holds at once


@torch.no_grad()
def forward_logprobs(model, targets: torch.Tensor, keep: torch.Tensor | None = None, chunk_tokens: int = HEAD_CHUNK,
                     **inputs) -> torch.Tensor:
    """fp32 [K] log p(targets[j]) under the distribution predicted at position ``keep[j]`` of a batch-1
    forward of ``inputs`` (every position when ``keep`` is None), no gradient. The decoder body runs
    once; the output head runs over the kept positions ``chunk_tokens`` at a time, so the [K, V]
    logits (and their fp32 log-softmax) are never held whole: 1.6 GB a copy at 8,192 positions of
    a 49,152-token vocabulary. ``inputs`` are the decoder's (input_ids, position_ids, attention_mask,
    past_key_values, use_cache, ...); a model without ``get_decoder``/``get_output_embeddings`` runs
    its plain forward."""
    targets = torch.as_tensor(targets, dtype=torch.long).reshape(-1)
    decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    if decoder is None or head is None or softcap:
        logits = model(**inputs).logits[0]
        return target_logprobs(logits if keep is None else logits[keep], targets)
    hidden = decoder()(**inputs).last_hidden_state[0]
    hidden = hidden if keep is None else hidden[keep]
    return torch.cat([target_logprobs(head(hidden[s:s + chunk_tokens]), targets[s:s + chunk_tokens])
                      for s in range(0, hidden.shape[0], chunk_tokens)] or [hidden.new_zeros(0, dtype=torch.float32)])


def model_dtype(name: str) -> torch.dtype:
    """The config's ``model.dtype``; "auto" is bf16 on GPU and fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return _DTYPES[name]


def text_ids(tokenizer, text: str) -> list[int]:
    """Token ids of user text, special-token strings included as ordinary text."""
    return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


def _special_pattern(tokenizer) -> re.Pattern | None:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {t.content for t in added.values() if t.special} | set(tokenizer.all_special_tokens)
    specials = sorted((t for t in specials if t), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, specials)) + ")") if specials else None


def mixed_ids(tokenizer, parts: list[tuple[str, bool]]) -> list[int]:
    """Ids of the concatenated ``parts`` (text, trusted): special-token strings count as control tokens
    only inside trusted parts; in the others they are ordinary text."""
    pattern = _special_pattern(tokenizer)
    pieces: list[tuple[str, bool]] = []  # (text, is_special_token)
    for text, trusted in parts:
        cuts = pattern.split(text) if trusted and pattern else [text]
        for j, piece in enumerate(cuts):
            if j % 2:
                pieces.append((piece, True))
            elif pieces and not pieces[-1][1]:
                pieces[-1] = (pieces[-1][0] + piece, False)
            elif piece:
                pieces.append((piece, False))
    ids: list[int] = []
    after_special = False
    for piece, special in pieces:
        if special:
            ids.append(int(tokenizer.convert_tokens_to_ids(piece)))
        elif after_special and _no_prefix_after_special(tokenizer):
            ids += _continuation_ids(tokenizer, piece)
        else:
            ids += text_ids(tokenizer, piece)
        after_special = special
    return ids


_PREFIX_RULE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _no_prefix_after_special(tokenizer) -> bool:
    """Whether the tokenizer, encoding a whole string, starts the text after a control token without
    the dummy-prefix space it puts before every text it encodes on its own (SentencePiece tokenizers
    with ``legacy=False``, e.g. Llama-2's or Mistral's as transformers loads them). Then text after a
    control token must be encoded as a continuation to give the whole string's ids."""
    try:
        return _PREFIX_RULE[tokenizer]
    except (KeyError, TypeError):
        pass
    special = next((t for t in (tokenizer.eos_token, tokenizer.bos_token) if t), None)
    rule = False
    if special is not None:
        probe = "Ab c"
        whole = list(tokenizer.encode(special + probe, add_special_tokens=False))
        rule = whole != [int(tokenizer.convert_tokens_to_ids(special))] + text_ids(tokenizer, probe)
    try:
        _PREFIX_RULE[tokenizer] = rule
    except TypeError:  # a tokenizer that cannot be weakly referenced: probe again next time
        pass
    return rule


CONTINUATION_ANCHORS = ("\n", ".", "a")  # one-character texts put before a continuation, their ids dropped


def _continuation_ids(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` encoded as a continuation: behind a one-character anchor whose ids are a prefix
    of the result, those ids dropped (the dummy-prefix space goes to the anchor)."""
    for anchor in CONTINUATION_ANCHORS:
        head, full = text_ids(tokenizer, anchor), text_ids(tokenizer, anchor + text)
        if full[:len(head)] == head:
            return full[len(head):]
    return text_ids(tokenizer, text)


_MARK = "\ue000{}\ue001"  # private-use characters: stand-ins for the contents while the template renders
_MARKS = re.compile("\ue000(\\d+)\ue001")


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat-template token ids of ``messages`` plus the assistant generation prompt; the messages'
    contents are user text (see the module docstring), the template's own tokens are control tokens."""
    marked = [{**m, "content": _MARK.format(i)} for i, m in enumerate(messages)]
    cuts = _MARKS.split(tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False))
    parts = [(messages[int(c)]["content"], False) if j % 2 else (c, True) for j, c in enumerate(cuts)]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if "".join(t for t, _ in parts) != rendered:  # the template rewrites contents: it cannot be cut this way
        pattern = _special_pattern(tokenizer)
        if pattern and any(pattern.search(str(m.get("content", ""))) for m in messages):
            raise ValueError("the chat template rewrites message contents, so special-token strings in them "
                             "cannot be kept as text")
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(i) for i in (ids if isinstance(ids, list) else ids["input_ids"])]
    return mixed_ids(tokenizer, parts)


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a saved HF checkpoint (read from safetensors headers)."""
    from safetensors import safe_open  # safetensors (torch) on use

    shapes = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                shapes[k] = tuple(st.get_slice(k).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return shapes


def validate_weights(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Reject a state dict that would break a model half-way through loading it; returns the
    tensors to load (a tied ``lm_head.weight`` that ``expected`` does not list is dropped)."""
    if "lm_head.weight" in tensors and "lm_head.weight" not in expected:
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if missing or unknown:
        raise ValueError(f"weight names differ from the checkpoint: missing {missing[:5]}, unknown {unknown[:5]}")
    for k, t in tensors.items():
        if tuple(t.shape) != expected[k]:
            raise ValueError(f"{k}: shape {tuple(t.shape)}, the checkpoint has {expected[k]}")
    return tensors
