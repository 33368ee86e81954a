"""Where a config's files are: the embedded world's cache folder and the paths that may say 'world'.

    world_dir(cfg)              # {world.dir}/{world_key(cfg)}: the world this config builds
    model_path(cfg)             # the policy model directory
    data_path(cfg, "train")     # train / test prompts, SFT trajectories
    corpus_path(cfg)            # the search corpus; index_dir(cfg) its index
    cfg = resolved(cfg)         # the same config with every 'world' replaced by a concrete path
    check_no_silent_world(cfg, ("search.corpus", "eval.data"))  # own data: every path a command uses is given

A path field set to ``world`` (``model.path``, ``search.corpus``, ``train.data``, ``train.sft_data``,
``eval.data``) names a file of the embedded world. This module only looks paths up; it never
builds anything: the pipeline builds the world once (``services/world/build.py``) and deploys
``resolved(cfg)``, so the replicas only ever see concrete paths. A lookup into a world that is
not built raises FileNotFoundError saying how to build it.

The world's key hashes every setting that changes the world and the source of the code that
generates it (``GENERATOR_MODULES``), so a changed config or generator builds a new world and an
unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.config_fields import ConfigError

if TYPE_CHECKING:  # the composed config lives above common (services/config.py)
    from services.config import MempoConfig

FORMAT_VERSION = 1  # bump when the layout of a built world changes
# The code that generates a world's content: editing any of it gives a new key (a rebuild).
GENERATOR_MODULES = ("services/world/entities.py", "services/world/relations.py", "services/world/corpus.py",
                     "services/world/questions.py", "services/world/oracle.py", "services/world/tokenizer.py",
                     "services/world/tiny_model.py", "services/world/pretrain.py", "services/search_tool/bm25_index.py",
                     "services/common/passage_format.py", "services/common/turn_format.py")
WORLD = "world"  # the value of a path field that names the embedded world's file
_ROOT = Path(__file__).resolve().parents[2]


def _generator_digest() -> str:
    h = hashlib.sha256()
    for rel in GENERATOR_MODULES:
        h.update((_ROOT / rel).read_bytes())
    return h.hexdigest()


def world_key(cfg: MempoConfig) -> str:
    """Hash of everything that shapes the built world."""
    shape = {
        "format": FORMAT_VERSION,
        "code": _generator_digest(),
        "world": cfg.world.model_dump(exclude={"dir"}),
        "model": cfg.model.model_dump(exclude={"path", "dtype"}),
        "system_prompt": cfg.rollout.system_prompt,
        "topk": cfg.search.topk,
        "doc_format": cfg.search.doc_format,
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]


def world_dir(cfg: MempoConfig) -> Path:
    return Path(cfg.world.dir) / world_key(cfg)


def is_built(path: Path) -> bool:
    return (path / "manifest.json").is_file()


# The paths of a question set and its corpus. A command that uses several of them takes them all from
# the world or all from the user: questions from one place and a corpus or held-out set from the other
# is almost always a forgotten setting (the synthetic world's files, silently built and used beside
# the user's). A model of the user's own with the world's data is a recipe of its own
# (deploy/configs/smollm2.yaml), so there the data paths must be *given*, as files or as 'world' on
# purpose, never left at their default.
DATA_PATHS = ("search.corpus", "train.data", "eval.data", "train.sft_data")


def _path_value(cfg: MempoConfig, key: str) -> str:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _given(cfg: MempoConfig, key: str) -> bool:
    """Whether the config file or an override set ``key`` (a default is not given)."""
    section, name = key.split(".")
    return name in getattr(cfg, section).model_fields_set


def check_no_silent_world(cfg: MempoConfig, needs: tuple[str, ...] | list[str]) -> None:
    """Stop with the list of settings to give, before anything is built, when the synthetic world
    would silently fill a path the command ``needs`` (of ``DATA_PATHS``): when another data path names
    the user's own file and this one still says 'world' (a world file used on purpose is given by its
    path: `mempo world path CONFIG` prints the folder), or when ``model.path`` is the user's own model
    and this one was left at its default (write 'world' to use the embedded world's data on purpose)."""
    needs = [k for k in needs if k in DATA_PATHS]
    own = [k for k in DATA_PATHS if _path_value(cfg, k) != WORLD]
    missing = [k for k in needs if _path_value(cfg, k) == WORLD]
    if own and missing:
        given = ", ".join(f"{k}={_path_value(cfg, k)}" for k in own)
        raise ConfigError(f"{given} names your own data, but this command also reads {', '.join(missing)}, still "
                          f"'world' (the synthetic world's files, which would be built and used beside yours): set "
                          f"{' and '.join(f'{k}=FILE' for k in missing)} (docs/data.md), or give a world file by its "
                          f"path (`mempo world path CONFIG` prints the folder)")
    unset = [k for k in needs if _path_value(cfg, k) == WORLD and not _given(cfg, k)]
    if cfg.model.path != WORLD and unset:
        raise ConfigError(f"model.path={cfg.model.path} is your own model, but this command also reads "
                          f"{', '.join(unset)}, left unset (the synthetic world's files by default): set "
                          f"{' and '.join(f'{k}=FILE' for k in unset)} (docs/data.md), or "
                          f"{' '.join(f'{k}=world' for k in unset)} to use the embedded world's on purpose")


def corpus_needed(cfg: MempoConfig) -> tuple[str, ...]:
    """("search.corpus",) unless the rollout calls an external search server (search.url)."""
    return () if cfg.search.url else ("search.corpus",)


def uses_world(cfg: MempoConfig) -> bool:
    """Whether any model, corpus or data path of ``cfg`` names the embedded world."""
    return WORLD in (cfg.model.path, cfg.search.corpus, cfg.train.data, cfg.train.sft_data, cfg.eval.data)


def _in_world(cfg: MempoConfig, name: str) -> Path:
    path = world_dir(cfg)
    if not is_built(path):
        raise FileNotFoundError(f"no built world at {path} (a path of the config is 'world'): run `make world` "
                                f"(mempo world build) with this config, or start the pipeline, which builds it")
    return path / name


def is_adapter_folder(path) -> bool:
    """A PEFT adapter folder (adapter_config.json, no config.json of its own), as a LoRA run exports."""
    p = Path(path)
    return (p / "adapter_config.json").is_file() and not (p / "config.json").is_file()


def model_path(cfg: MempoConfig) -> Path:
    """The policy model directory: the world's tiny model unless ``model.path`` names another. A folder
    that ``mempo model`` writes (under .cache/models/) and that is missing is named with the command. A
    PEFT LoRA adapter folder (a LoRA run's ``policy/adapter``) gives its base with the adapter merged in
    (made once, under .cache/models/merged/)."""
    if cfg.model.path == WORLD:
        return _in_world(cfg, "model")
    path = Path(cfg.model.path)
    if is_adapter_folder(path):
        from services.common.lora import merged_policy  # torch, peft on use

        return merged_policy(path)
    if path.parts[:2] == (".cache", "models") and not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path} is not there yet: `make model` writes SmolLM2-135M-Instruct "
                                f"to .cache/models/ (`mempo model from-gguf FILE.gguf DIR` any GGUF file)")
    return path


def qwen_tokenizer_path(cfg: MempoConfig) -> Path:
    """The real Qwen2.5 tokenizer (for tests and GPU recipes), built offline beside the worlds."""
    return Path(cfg.world.dir) / "qwen2.5-tokenizer"


def corpus_path(cfg: MempoConfig) -> Path:
    return _in_world(cfg, "corpus.jsonl") if cfg.search.corpus == WORLD else Path(cfg.search.corpus)


def index_dir(cfg: MempoConfig) -> Path:
    """``search.index_dir``; empty = the world's index, or ``<corpus>.<backend>`` beside another corpus."""
    s = cfg.search
    if s.index_dir:
        return Path(s.index_dir)
    if s.corpus == WORLD:
        return _in_world(cfg, "index") / s.backend
    return Path(f"{s.corpus}.{s.backend}")


def data_path(cfg: MempoConfig, which: str) -> Path:
    """train / test prompts and SFT trajectories: the world's files unless the config names others."""
    value, name = {"train": (cfg.train.data, "train.parquet"), "test": (cfg.eval.data, "test.parquet"),
                   "sft": (cfg.train.sft_data, "oracle.jsonl")}[which]
    return _in_world(cfg, name) if value == WORLD else Path(value)


def resolved(cfg: MempoConfig) -> MempoConfig:
    """A copy of ``cfg`` whose path fields are concrete (what the pipeline hands its replicas).
    Needs the world built when a path says 'world'; ``cfg`` itself when none does."""
    if not uses_world(cfg):
        return cfg
    out = cfg.model_copy(deep=True)
    out.search.index_dir = str(index_dir(cfg))
    out.model.path, out.search.corpus = str(model_path(cfg)), str(corpus_path(cfg))
    out.train.data, out.eval.data, out.train.sft_data = (str(data_path(cfg, w)) for w in ("train", "test", "sft"))
    return out
