"""Choosing, building and loading the retrieval backend named by the config.

    index = load_backend(cfg)          # BM25Index or DenseIndex; both have .search(queries, topk)
    build_index(rows, "dense", out_dir, encoder_path="path/to/e5")   # what `mempo index` runs

``search.corpus: world`` with ``search.index_dir`` empty uses the embedded world's BM25 index
(which must be built: the pipeline builds the world before it deploys search). Another corpus gets
its index in ``search.index_dir`` (default ``<corpus>.<backend>/``), built on first use if missing.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Protocol, Union

from services.common.config import MempoConfig
from services.common.jsonl import read_jsonl
from services.common.paths import corpus_path, index_dir
from services.search_tool.bm25_index import BM25Index
from services.search_tool.dense_index import DenseIndex, TextEncoder

log = logging.getLogger("mempo.search")
SearchBackend = Union[BM25Index, DenseIndex]


class Searcher(Protocol):
    backend: str

    def search(self, queries: list[str], topk: int = 3) -> list[list[tuple[dict, float]]]: ...

    def __len__(self) -> int: ...


def _encoder(cfg: MempoConfig) -> TextEncoder:
    s = cfg.search
    if not s.embedding_model:
        raise ValueError("search.embedding_model must name a local encoder directory for the dense backend")
    return TextEncoder(s.embedding_model, query_prefix=s.query_prefix, passage_prefix=s.passage_prefix)


def build_index(rows: list[dict], backend: str, out: Path, encoder: TextEncoder | None = None,
                show_progress: bool = True) -> SearchBackend:
    """Index ``rows`` with ``backend`` and save it to ``out``."""
    if backend == "bm25":
        index: SearchBackend = BM25Index.build(rows, show_progress=show_progress)
    elif backend == "dense":
        if encoder is None:
            raise ValueError("the dense backend needs an encoder")
        index = DenseIndex.build(rows, encoder, show_progress=show_progress)
    else:
        raise ValueError(f"unknown search backend {backend!r}")
    index.save(out)
    return index


def load_backend(cfg: MempoConfig, build_missing: bool = True) -> SearchBackend:
    """Load the configured index (building it from the corpus first if it is missing)."""
    s = cfg.search
    path = index_dir(cfg)
    encoder = _encoder(cfg) if s.backend == "dense" else None
    marker = "corpus.jsonl"
    if not (path / marker).is_file() or (s.backend == "dense" and not (path / "faiss.index").is_file()):
        if not build_missing:
            raise FileNotFoundError(f"no {s.backend} index at {path}")
        log.info("building the %s index of %s into %s", s.backend, corpus_path(cfg), path)
        return build_index(read_jsonl(corpus_path(cfg)), s.backend, path, encoder)
    return BM25Index.load(path) if s.backend == "bm25" else DenseIndex.load(path, encoder)
