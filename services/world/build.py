"""Build (or find cached) the embedded world: graph, corpus, index, questions, SFT data, tokenizer, model.

Everything is generated from the config's seeds (nothing is downloaded) into
``{world.dir}/{key}/`` where ``key`` hashes every setting and generator module that changes the
output (services/common/paths.py, which also looks the built files up), so a changed config
builds a new world and an unchanged one is reused. A build writes into a temporary folder
and renames it when complete, so a killed build never leaves a half world behind.

    python -m services.world build [deploy/configs/tiny.yaml] [world.seed=3 ...]
    python -m services.world show

Layout of a built world:
    manifest.json     counts, timings, config key, file sizes
    world.json        the entity graph
    corpus.jsonl      Search-R1 corpus rows {"id", "contents"}
    index/bm25/       the BM25 index over the corpus
    train.parquet     training prompts (verl / Search-R1 layout)
    test.parquet      held-out prompts, test_questions per k in world.test_objectives
    oracle.jsonl      oracle trajectories in the MemPO grammar (SFT cold start)
    model/            tiny Qwen2 model + tokenizer (save_pretrained), pretrained on the world's text
                      when world.pretrain_tokens > 0 (services/world/pretrain.py)
The real Qwen2.5 tokenizer (same for every config) is built once into ``{world.dir}/qwen2.5-tokenizer``.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from services.config import MempoConfig
from services.common.jsonl import write_jsonl
from services.common.paths import (FORMAT_VERSION, check_no_silent_world, is_built, qwen_tokenizer_path, resolved,
                                   uses_world, world_dir)
from services.search_tool.bm25_index import BM25Index
from services.world.corpus import build_corpus
from services.world.entities import generate_world
from services.world.oracle import BEHAVIOURS, OracleAgent
from services.world.questions import build_question_sets, questions_of

log = logging.getLogger("mempo.world")


def prepare_world(cfg: MempoConfig, progress: bool = True, needs: tuple[str, ...] = ()) -> MempoConfig:
    """Build the embedded world if any model, corpus or data path of ``cfg`` is 'world' (with a
    progress bar: a first build that pretrains the base model takes minutes) and return ``cfg``
    with those paths made concrete: what the pipeline deploys, so no replica builds or looks up.
    ``needs``: the data paths the calling command reads, checked first (paths.check_no_silent_world)."""
    check_no_silent_world(cfg, needs)
    if uses_world(cfg):
        build_world(cfg, progress=progress)
    return resolved(cfg)


def index_oracle(cfg: MempoConfig, index: BM25Index, max_turns: int) -> OracleAgent:
    """The oracle searching ``index`` with the config's search settings (top-k, passage format), as
    the SFT data, the oracle records and the episode-length table use it."""
    return OracleAgent(lambda qs, k: [[d for d, _ in hits] for hits in index.search(qs, k)], topk=cfg.search.topk,
                       doc_format=cfg.search.doc_format, max_turns=max_turns)


def _oracle_data(cfg: MempoConfig, train_rows: list[dict], index: BM25Index, progress: bool) -> list[dict]:
    rng = random.Random(cfg.world.seed + 3)
    agent = index_oracle(cfg, index, cfg.world.oracle_max_turns)
    out = []
    rows = train_rows[: cfg.world.oracle_trajectories]
    for row in tqdm(rows, desc="oracle trajectories", disable=not progress, leave=False):
        imperfect = rng.random() < cfg.world.oracle_imperfect_share
        behaviour = rng.choice(BEHAVIOURS[1:]) if imperfect else "perfect"
        traj = agent.solve(questions_of(row), cfg.rollout.system_prompt, behaviour, rng)
        out.append({"index": int(row["extra_info"]["index"]), "k": int(row["extra_info"]["k"]),
                    "behaviour": traj.behaviour, "em": traj.em, "finished": traj.finished,
                    "searches": traj.searches, "turns": traj.turns, "answer": traj.answer,
                    "golds": traj.golds, "messages": traj.messages})
    return out


class _Stages:
    """The build's progress bar and each stage's seconds (timings vary run to run, so they go to
    build_log.json, apart from the byte-deterministic outputs)."""

    def __init__(self, progress: bool):
        self.timings: dict[str, float] = {}
        self.bar = tqdm(total=7, desc="building world", disable=not progress)
        self.start = self.t = time.perf_counter()

    def done(self, name: str) -> None:
        self.timings[name] = round(time.perf_counter() - self.t, 3)
        self.bar.set_postfix_str(name)
        self.bar.update(1)
        self.t = time.perf_counter()


def build_world(cfg: MempoConfig, force: bool = False, progress: bool = True) -> Path:
    """Build the world for ``cfg`` unless an identical one is cached; returns its directory."""
    from services.world.qwen_tokenizer import build_qwen_tokenizer  # transformers: only when a world is built

    final = world_dir(cfg)
    build_qwen_tokenizer(qwen_tokenizer_path(cfg))  # config-independent; cached after the first build
    if is_built(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    stages = _Stages(progress)
    world, rows, train, test, oracle = _write_data(cfg, tmp, stages, progress)
    tokenizer, pretrain_stats = _write_model(cfg, tmp, rows, train, oracle, stages, progress)
    stages.bar.close()
    manifest = _manifest(cfg, final.name, world, rows, train, test, oracle, tokenizer, pretrain_stats)
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    build_log = {"timings_s": stages.timings, "build_s": round(time.perf_counter() - stages.start, 3),
                 "pretrain": pretrain_stats}
    (tmp / "build_log.json").write_text(json.dumps(build_log, indent=1))
    _publish(tmp, final)
    log.info("world %s built in %.1fs", final, build_log["build_s"])
    return final


def _write_data(cfg: MempoConfig, tmp: Path, stages: _Stages, progress: bool):
    """The world's data into ``tmp``: entity graph, corpus and its BM25 index, question sets, oracle
    trajectories; returns (world, corpus rows, train, test, oracle records)."""
    world = generate_world(cfg.world)
    (tmp / "world.json").write_text(json.dumps(world.to_dict(), indent=1))
    stages.done("graph")

    rows, page_ids = build_corpus(world, cfg.world)
    write_jsonl(rows, tmp / "corpus.jsonl")
    index = BM25Index.build(rows)
    index.save(tmp / "index" / "bm25")
    stages.done("corpus+index")

    train, test = build_question_sets(world, cfg.world, cfg.rollout.system_prompt, page_ids)
    train.to_parquet(tmp / "train.parquet", index=False)
    test.to_parquet(tmp / "test.parquet", index=False)
    stages.done("questions")

    oracle = _oracle_data(cfg, train.to_dict("records"), index, progress)
    with open(tmp / "oracle.jsonl", "w", encoding="utf-8") as f:
        for r in oracle:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    stages.done("oracle")
    return world, rows, train, test, oracle


def _write_model(cfg: MempoConfig, tmp: Path, rows: list[dict], train, oracle: list[dict], stages: _Stages,
                 progress: bool):
    """The world's model into ``tmp / "model"``: a BPE tokenizer trained on the world's text, the tiny
    Qwen2 model, and its pretraining on that text when ``world.pretrain_tokens > 0`` (the base the SFT
    cold start begins from, services/world/pretrain.py); returns (tokenizer, pretraining stats or None)."""
    # imported here: torch, transformers and tokenizers load only when a world is built
    from services.world.tiny_model import save_tiny_model
    from services.world.tokenizer import train_tokenizer

    texts = [r["contents"] for r in rows]
    texts += [cfg.rollout.system_prompt] + [m["content"] for p in train["prompt"] for m in p[1:]]
    texts += [m["content"] for r in oracle for m in r["messages"][1:]]
    tokenizer = train_tokenizer(texts, cfg.world.tokenizer_vocab_size)
    stages.done("tokenizer")

    save_tiny_model(cfg.model, tokenizer, tmp / "model")
    stages.done("model")

    pretrain_stats = None
    if cfg.world.pretrain_tokens > 0:
        from services.world.pretrain import pretrain

        docs = [r["contents"] for r in rows]
        docs += [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in oracle]
        pretrain_stats = pretrain(tmp / "model", docs, cfg.world, progress=progress)
    stages.done("pretrain")
    return tokenizer, pretrain_stats


def _manifest(cfg: MempoConfig, key: str, world, rows: list[dict], train, test, oracle: list[dict], tokenizer,
              pretrain_stats: dict | None) -> dict:
    """manifest.json: the world's key, format, seed, counts and oracle EM (no timings: byte-deterministic)."""
    return {
        "key": key,
        "format": FORMAT_VERSION,
        "seed": cfg.world.seed,
        "counts": {"countries": len(world.countries), "cities": len(world.cities),
                   "universities": len(world.universities), "people": len(world.people),
                   "companies": len(world.companies), "passages": len(rows), "train_prompts": len(train),
                   "test_prompts": len(test), "oracle_trajectories": len(oracle), "vocab_size": len(tokenizer)},
        "oracle_em": round(sum(r["em"] for r in oracle) / max(1, len(oracle)), 4),
        "pretrain_tokens": pretrain_stats["tokens"] if pretrain_stats else 0,
        "world_config": cfg.world.model_dump(exclude={"dir"}),
    }


def _publish(tmp: Path, final: Path) -> None:
    """Rename the complete build to its key's folder (replacing a forced rebuild's old one); a
    concurrent builder that finished first wins."""
    if final.exists():  # force rebuild (or a concurrent builder finished first)
        shutil.rmtree(final)
    try:
        tmp.rename(final)
    except OSError:
        if not is_built(final):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def load_manifest(path: Path) -> dict:
    """The manifest, plus the build timings when the build log is there."""
    if not is_built(path):
        raise FileNotFoundError(f"no built world at {path}; run `make world` (python -m services.world build)")
    manifest = json.loads((path / "manifest.json").read_text())
    log_file = path / "build_log.json"
    if log_file.is_file():
        manifest.update(json.loads(log_file.read_text()))
    return manifest
