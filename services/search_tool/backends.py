"""Choosing, building and loading the retrieval backend named by the config.

    index = load_backend(cfg)          # BM25Index or DenseIndex; both have .search(queries, topk)
    build_index(rows, "dense", out_dir, encoder_path="path/to/e5")   # what `mempo index` runs

``search.corpus: world`` with ``search.index_dir`` empty uses the embedded world's BM25 index
(which must be built: the pipeline builds the world before it deploys search). Another corpus gets
its index in ``search.index_dir`` (default ``<corpus>.<backend>/``), built on first use if missing.
The first replica to find it missing builds it under a file lock (``<index_dir>.lock``); the other
replicas of the node wait for it and then load the same files (the dense index memory-mapped with
``search.mmap``, its corpus read by offset: services/search_tool/dense_index.py).

Dense with a prebuilt faiss file (Search-R1's ``e5_Flat.index`` beside ``wiki-18.jsonl``): set
``search.corpus`` to the JSONL and either ``search.faiss_file`` to the index file or
``search.index_dir`` to the folder holding ``e5_Flat.index``; both are read where they are and the
index is never rebuilt (only the corpus offsets are written, into ``search.index_dir``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
from pathlib import Path
from typing import Protocol, Union

from services.config import MempoConfig
from services.common.jsonl import read_jsonl
from services.common.paths import corpus_path, index_dir
from services.search_tool.bm25_index import BM25Index
from services.search_tool.dense_index import SEARCH_R1_INDEX, DenseIndex, TextEncoder

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
    return TextEncoder(s.embedding_model, query_prefix=s.query_prefix, passage_prefix=s.passage_prefix,
                       batch_size=s.encode_batch_size)


def build_index(rows: list[dict], backend: str, out: Path, encoder: TextEncoder | None = None,
                show_progress: bool = True, faiss_index: str = "flat", nlist: int = 0) -> SearchBackend:
    """Index ``rows`` with ``backend`` and save it to ``out``."""
    if backend == "bm25":
        index: SearchBackend = BM25Index.build(rows, show_progress=show_progress)
    elif backend == "dense":
        if encoder is None:
            raise ValueError("the dense backend needs an encoder")
        index = DenseIndex.build(rows, encoder, show_progress=show_progress, kind=faiss_index, nlist=nlist)
    else:
        raise ValueError(f"unknown search backend {backend!r}")
    index.save(out)
    return index


@contextlib.contextmanager
def _build_lock(path: Path):
    """An exclusive lock beside the index directory, held while one process builds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _prebuilt_faiss(cfg: MempoConfig, path: Path) -> Path | None:
    s = cfg.search
    if s.faiss_file:
        return Path(s.faiss_file)
    if not (path / "faiss.index").is_file() and (path / SEARCH_R1_INDEX).is_file():
        return path / SEARCH_R1_INDEX
    return None


def _load_dense(cfg: MempoConfig, path: Path, encoder: TextEncoder, build_missing: bool) -> DenseIndex:
    s = cfg.search
    params = {"mmap": s.mmap, "nprobe": s.nprobe, "ef_search": s.ef_search, "refine_factor": s.refine_factor}
    prebuilt = _prebuilt_faiss(cfg, path)
    if prebuilt is not None:
        with _build_lock(path):  # the first replica writes the corpus offsets
            return DenseIndex.load(path, encoder, faiss_file=prebuilt, corpus=corpus_path(cfg), **params)

    def built() -> bool:
        return (path / "corpus.jsonl").is_file() and (path / "faiss.index").is_file()

    if not built():
        if not build_missing:
            raise FileNotFoundError(f"no dense index at {path}")
        with _build_lock(path):
            if not built():
                log.info("building the dense %s index of %s into %s", s.faiss_index, corpus_path(cfg), path)
                DenseIndex.build_file(corpus_path(cfg), path, encoder, kind=s.faiss_index, nlist=s.nlist,
                                      show_progress=True)
    kind = DenseIndex.built_kind(path)
    if kind is not None and kind != s.faiss_index:
        raise ValueError(f"the dense index at {path} was built as {kind!r} but search.faiss_index is "
                         f"{s.faiss_index!r}: point search.index_dir at another directory (or delete this one)")
    with _build_lock(path):  # offsets of an index written before they existed
        return DenseIndex.load(path, encoder, **params)


def load_backend(cfg: MempoConfig, build_missing: bool = True) -> SearchBackend:
    """Load the configured index (building it from the corpus first if it is missing)."""
    s = cfg.search
    path = index_dir(cfg)
    if s.backend == "dense":
        return _load_dense(cfg, path, _encoder(cfg), build_missing)
    if not (path / "corpus.jsonl").is_file():
        if not build_missing:
            raise FileNotFoundError(f"no {s.backend} index at {path}")
        with _build_lock(path):
            if not (path / "corpus.jsonl").is_file():
                log.info("building the %s index of %s into %s", s.backend, corpus_path(cfg), path)
                return build_index(read_jsonl(corpus_path(cfg)), s.backend, path)
    return BM25Index.load(path)
