"""A small SentencePiece tokenizer with a Llama-2 chat template, trained in a second, for tests that
must hold for any tokenizer: "▁" pieces, <0xNN> byte fallback, a dummy prefix, ``[INST]`` turns.

    tok = sentencepiece_tokenizer(tmp_path)     # a transformers LlamaTokenizer (not ChatML)
"""

from __future__ import annotations

import io
from pathlib import Path

# Llama-2-chat's template (as published with the model): system folded into the first user turn.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)

CORPUS = [
    "<mem>\nAda Brenn was born in Kalton.\n</mem>\n<think>\nNow the country.\n</think>\n<search> Kalton country </search>",
    "<think>\nI have found everything the question needs.\n</think>\n<answer> Reed College </answer>",
    "<information>\nDoc 1 (Title: Kalton) Kalton is a town in Vestria. The Eiffel Tower is in Paris.\n</information>",
    "Answer the question. Steve Jobs attended Reed College in Portland, Oregon, in 1972.",
    "Who directed the film? Kathryn Bigelow directed it; she was born in 1951.",
]


def sentencepiece_tokenizer(folder: Path, vocab_size: int = 420):
    """Train a BPE SentencePiece model with byte fallback (as Llama's) into ``folder``, convert it to a
    transformers LlamaTokenizer with the Llama-2 chat template, save that there and load it back."""
    import sentencepiece as spm
    from transformers import AutoTokenizer, LlamaTokenizer

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 20), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, split_digits=True, add_dummy_prefix=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", minloglevel=2)
    (folder / "tokenizer.model").write_bytes(buf.getvalue())
    tok = LlamaTokenizer.from_pretrained(str(folder))
    tok.chat_template = LLAMA2_CHAT_TEMPLATE
    tok.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))
