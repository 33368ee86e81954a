"""The embedded world's tokenizer: byte-level BPE trained on the world's own text, ChatML template.

Byte-level, so any string (Chinese included) encodes and decodes losslessly; special tokens
``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos) as in Qwen2.5; chat template:

    <|im_start|>{role}\\n{content}<|im_end|>\\n ... <|im_start|>assistant\\n   (generation prompt)

    tok = train_tokenizer(texts, vocab_size=2048)   # a transformers PreTrainedTokenizerFast
    tok.save_pretrained(model_dir)
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts`` (deterministic for the same texts and vocab size)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
