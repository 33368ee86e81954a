"""Dense retrieval: faiss inner-product search over normalised e5-style embeddings.

The encoder is any local transformers encoder directory (e5-base-v2 for Wikipedia, or a small one
such as all-MiniLM-L6-v2 for tests): mean pooling over the attention mask, L2 normalisation,
``"query: "`` / ``"passage: "`` prefixes (e5 convention, configurable), batched (texts sorted by
length so a batch pads little), on CUDA in float16 when torch sees a GPU and on the CPU in float32
otherwise, with a progress bar. Vectors can also be precomputed and handed in directly.

    enc = TextEncoder("path/to/e5-base-v2")
    index = DenseIndex.build(rows, enc, kind="ivf")            # or DenseIndex.from_vectors(rows, vecs, enc)
    index.save("index_dir"); index = DenseIndex.load("index_dir", enc, mmap=True, nprobe=64)
    DenseIndex.build_file("corpus.jsonl", "index_dir", enc, kind="hnsw")   # streams the corpus, saves
    hits = index.search(["who founded Zentrix Labs"], topk=3)  # [[(row, score), ...]]

Index kinds (``kind``, the config's ``search.faiss_index``), all inner product:
    flat    exact (IndexFlatIP), today's default
    ivf     IVF<nlist>,Flat: k-means cells, ``nprobe`` of them scanned per query
    hnsw    HNSW32,Flat: a graph, ``ef_search`` candidates per query
    ivfpq   IVF<nlist>,PQ<d/8>,RFlat: PQ codes in the cells, the best ``refine_factor * k`` re-scored
            exactly against the full vectors
    or any faiss index_factory string (e.g. ``IVF4096,SQ8``). ``nlist`` 0 = about 4 sqrt(n), a power of two.

An index directory (what ``save`` and ``build_file`` write):
    faiss.index          the faiss index; row i of the index is row i of the corpus
    corpus.jsonl         the passages, one JSON object per line (the marker every backend has)
    corpus.offsets.npy   uint64 byte offset of every row, then the file size (services/search_tool/corpus_store.py)
    corpus.offsets.npy.json   the corpus file those offsets describe (path, size, mtime)
    dense_meta.json      {"dim", "size", "encoder", "kind", "factory"}

Loading never reads the corpus into Python objects: rows are read by offset from the memory-mapped
file when a search returns them. With ``mmap=True`` the faiss index is memory-mapped too
(``faiss.IO_FLAG_MMAP_IFC``: zero-copy for flat, IVF, HNSW and refine indexes; older layouts fall back
to ``IO_FLAG_MMAP`` or a plain read), so the replicas on one node share one copy in the page
cache instead of each holding the index in its own memory.

Search-R1's published retriever files load as they are: ``faiss_file=".../e5_Flat.index"`` (an
IndexFlatIP over E5 embeddings of wiki-18.jsonl's rows in file order) with ``corpus=".../wiki-18.jsonl"``
read in place; only the offsets are written, into the index directory given.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Sequence

import faiss
import numpy as np
from tqdm import tqdm

from services.search_tool.corpus_store import CorpusStore

_CORPUS_FILE = "corpus.jsonl"
_OFFSETS_FILE = "corpus.offsets.npy"
_INDEX_FILE = "faiss.index"
_META_FILE = "dense_meta.json"
SEARCH_R1_INDEX = "e5_Flat.index"  # the name Search-R1 publishes its wiki-18 E5 index under
KINDS = ("flat", "ivf", "hnsw", "ivfpq")


class TextEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a local encoder directory."""

    def __init__(self, path: str | Path, query_prefix: str = "query: ", passage_prefix: str = "passage: ",
                 max_length: int = 256, batch_size: int = 64, device: str = "auto"):
        import torch  # on use: a replica of the BM25 backend (backends.py imports this module) never loads it
        from transformers import AutoModel, AutoTokenizer  # transformers on use

        if not Path(path).is_dir():
            raise FileNotFoundError(f"embedding model directory {str(path)!r} does not exist")
        self.path = str(path)
        self.device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        model = AutoModel.from_pretrained(self.path).eval()
        if self.device.startswith("cuda"):
            model = model.half()  # as Search-R1's own retriever encodes E5
        self.model = model.to(self.device)
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.max_length, self.batch_size = max_length, batch_size

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def encode(self, texts: list[str], prefix: str = "", show_progress: bool = False) -> np.ndarray:
        import torch  # loaded by __init__ already; see there

        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))  # similar lengths share a batch
        starts = range(0, len(texts), self.batch_size)
        with torch.inference_mode():
            for s in tqdm(starts, desc=f"encoding ({self.device})", disable=not show_progress):
                idx = order[s : s + self.batch_size]
                batch = [prefix + texts[i] for i in idx]
                enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                hidden = self.model(**enc).last_hidden_state
                mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-6)
                out[idx] = torch.nn.functional.normalize(pooled.float(), dim=-1).cpu().numpy()
        return out

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return self.encode(queries, self.query_prefix)


# -- faiss indexes -------------------------------------------------------------------------------

def auto_nlist(n: int) -> int:
    """About 4 sqrt(n) cells (a power of two), with at least 39 training vectors per cell."""
    want = 2 ** round(math.log2(max(4 * math.sqrt(max(n, 1)), 1)))
    return int(max(1, min(want, n // 39)))


def factory_string(kind: str, n: int, dim: int, nlist: int = 0) -> str:
    """The faiss index_factory string of ``kind`` for ``n`` vectors of ``dim`` (a factory string as is)."""
    nlist = nlist or auto_nlist(n)
    if kind == "flat":
        return "Flat"
    if kind == "ivf":
        return f"IVF{nlist},Flat"
    if kind == "hnsw":
        return "HNSW32,Flat"
    if kind == "ivfpq":
        m = next(m for m in (dim // 8, dim // 4, dim // 2, dim, 1) if m >= 1 and dim % m == 0)
        bits = int(min(8, max(1, math.floor(math.log2(max(n // 39, 2))))))  # 2**bits centroids need data
        return f"IVF{nlist},PQ{m}x{bits},RFlat"
    if "," in kind or kind[:1].isupper():
        return kind
    raise ValueError(f"unknown faiss index {kind!r}: one of {', '.join(KINDS)} or a faiss index_factory string")


def new_index(kind: str, vectors_for_training: np.ndarray | None, n: int, dim: int, nlist: int = 0) -> "faiss.Index":
    index = faiss.index_factory(dim, factory_string(kind, n, dim, nlist), faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        if vectors_for_training is None or not len(vectors_for_training):
            raise ValueError(f"a {kind} index needs training vectors")
        index.train(np.ascontiguousarray(vectors_for_training, dtype=np.float32))
    return index


def training_rows(kind: str, n: int, dim: int, nlist: int = 0, seed: int = 0) -> np.ndarray:
    """Which rows to train a ``kind`` index on: all of a small corpus, else a seeded sample
    (40 per IVF cell, at least 10,000)."""
    fac = factory_string(kind, n, dim, nlist)
    if "IVF" not in fac and "PQ" not in fac and "SQ" not in fac:
        return np.arange(0)
    want = max(10_000, 40 * (nlist or auto_nlist(n)))
    if n <= want:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=want, replace=False))


def read_faiss(path: str | Path, mmap: bool) -> "faiss.Index":
    """``faiss.read_index``, memory-mapped when ``mmap`` (zero-copy where the index type allows it)."""
    path = str(path)
    if not mmap:
        return faiss.read_index(path)
    for flag in (getattr(faiss, "IO_FLAG_MMAP_IFC", None), faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY):
        if flag is None:
            continue
        try:
            return faiss.read_index(path, flag)
        except RuntimeError:
            continue
    return faiss.read_index(path)


def set_search_params(index: "faiss.Index", nprobe: int | None = None, ef_search: int | None = None,
                      refine_factor: int | None = None) -> None:
    """Set the query-time knobs the index has (the others are ignored)."""
    ps = faiss.ParameterSpace()
    for name, value in (("nprobe", nprobe), ("efSearch", ef_search), ("k_factor_rf", refine_factor)):
        if value is None:
            continue
        try:
            ps.set_index_parameter(index, name, value)
        except RuntimeError:  # this index has no such parameter
            pass


def _write_atomic(index: "faiss.Index", path: Path) -> None:
    """Write to a new file and rename it over ``path``: replicas that mapped the old file keep it."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


class DenseIndex:
    backend = "dense"

    def __init__(self, index: "faiss.Index", rows: Sequence[dict], encoder: TextEncoder | None, kind: str = "flat"):
        self.index = index
        self.rows = rows  # a list, or a CorpusStore reading rows by offset
        self.encoder = encoder
        self.kind = kind

    @classmethod
    def from_vectors(cls, rows: Sequence[dict], vectors: np.ndarray, encoder: TextEncoder | None = None,
                     kind: str = "flat", nlist: int = 0) -> "DenseIndex":
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(rows):
            raise ValueError(f"need one vector per row: {len(rows)} rows, vectors of shape {vectors.shape}")
        n, dim = vectors.shape
        index = new_index(kind, vectors[training_rows(kind, n, dim, nlist)], n, dim, nlist)
        index.add(vectors)
        return cls(index, rows, encoder, kind)

    @classmethod
    def build(cls, rows: list[dict], encoder: TextEncoder, show_progress: bool = False, kind: str = "flat",
              nlist: int = 0) -> "DenseIndex":
        if not rows:
            raise ValueError("cannot index an empty corpus")
        vecs = encoder.encode([r["contents"] for r in rows], encoder.passage_prefix, show_progress)
        return cls.from_vectors(rows, vecs, encoder, kind, nlist)

    @classmethod
    def build_file(cls, corpus: str | Path, out: str | Path, encoder: TextEncoder, kind: str = "flat",
                   nlist: int = 0, show_progress: bool = False, chunk: int = 16384) -> "DenseIndex":
        """Index the JSONL ``corpus`` into the directory ``out`` without holding its rows in memory: the
        file is copied there, read by offset, encoded ``chunk`` rows at a time (a training sample first
        for IVF / PQ kinds) and added; the faiss index itself is built in memory and saved once."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        if Path(corpus).resolve() != (out / _CORPUS_FILE).resolve():
            tmp = out / f".{_CORPUS_FILE}.tmp{os.getpid()}"
            shutil.copyfile(corpus, tmp)
            os.replace(tmp, out / _CORPUS_FILE)
        store = CorpusStore.open(out / _CORPUS_FILE, out / _OFFSETS_FILE, show_progress)
        n = len(store)
        if not n:
            raise ValueError("cannot index an empty corpus")
        dim = encoder.dim

        def encode(ids) -> np.ndarray:
            return encoder.encode([store[int(i)]["contents"] for i in ids], encoder.passage_prefix)

        train = training_rows(kind, n, dim, nlist)
        index = new_index(kind, encode(train) if len(train) else None, n, dim, nlist)
        for s in tqdm(range(0, n, chunk), desc=f"indexing ({kind})", disable=not show_progress):
            index.add(encode(range(s, min(n, s + chunk))))
        built = cls(index, store, encoder, kind)
        built._save_index(out)
        return built

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        corpus = path / _CORPUS_FILE
        if not (isinstance(self.rows, CorpusStore) and self.rows.path.resolve() == corpus.resolve()):
            tmp = path / f".{_CORPUS_FILE}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                for r in self.rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            os.replace(tmp, corpus)
            CorpusStore.open(corpus, path / _OFFSETS_FILE).close()
        self._save_index(path)

    def _save_index(self, path: Path) -> None:
        _write_atomic(self.index, path / _INDEX_FILE)
        meta = {"dim": self.index.d, "size": self.index.ntotal, "encoder": self.encoder.path if self.encoder else None,
                "kind": self.kind}
        (path / _META_FILE).write_text(json.dumps(meta))

    @staticmethod
    def built_kind(path: str | Path) -> str | None:
        """The kind an index directory was built as (``flat`` for one written before kinds existed)."""
        try:
            return json.loads((Path(path) / _META_FILE).read_text()).get("kind", "flat")
        except (OSError, ValueError):
            return None

    @classmethod
    def load(cls, path: str | Path, encoder: TextEncoder | None = None, mmap: bool = False,
             nprobe: int | None = None, ef_search: int | None = None, refine_factor: int | None = None,
             faiss_file: str | Path | None = None, corpus: str | Path | None = None) -> "DenseIndex":
        """An index directory as ``save`` writes it; or, with ``faiss_file`` and ``corpus``, a prebuilt
        faiss index whose row i is the i-th row of the JSONL ``corpus`` (Search-R1's e5_Flat.index and
        wiki-18.jsonl), both read where they are; the corpus offsets then go into ``path``."""
        path = Path(path)
        index_file = Path(faiss_file) if faiss_file else path / _INDEX_FILE
        if not index_file.is_file():
            raise FileNotFoundError(f"no dense index at {index_file} (build it first)")
        corpus_file = Path(corpus) if corpus else path / _CORPUS_FILE
        if not corpus_file.is_file():
            raise FileNotFoundError(f"no corpus at {corpus_file} for the dense index {index_file}")
        index = read_faiss(index_file, mmap)
        if encoder is not None and encoder.dim != index.d:
            raise ValueError(f"encoder dim {encoder.dim} does not match the index dim {index.d} ({index_file})")
        path.mkdir(parents=True, exist_ok=True)
        store = CorpusStore.open(corpus_file, path / _OFFSETS_FILE, show_progress=True)
        if len(store) != index.ntotal:
            raise ValueError(f"{index_file} holds {index.ntotal} vectors but {corpus_file} has {len(store)} rows: "
                             "row i of the index must be line i of the corpus")
        set_search_params(index, nprobe, ef_search, refine_factor)
        kind = cls.built_kind(path) if not faiss_file else "flat" if isinstance(index, faiss.IndexFlat) else "prebuilt"
        return cls(index, store, encoder, kind or "flat")

    def __len__(self) -> int:
        return len(self.rows)

    def search_vectors(self, vectors: np.ndarray, topk: int) -> list[list[tuple[dict, float]]]:
        k = min(topk, len(self.rows))
        scores, ids = self.index.search(np.ascontiguousarray(vectors, dtype=np.float32), k)
        return [[(self.rows[int(i)], float(s)) for i, s in zip(row_ids, row_scores) if i >= 0]
                for row_ids, row_scores in zip(ids, scores)]

    def search(self, queries: list[str], topk: int = 3) -> list[list[tuple[dict, float]]]:
        """Top-k (row, score) per query, best first; an empty query gives an empty list."""
        if self.encoder is None:
            raise RuntimeError("this dense index has no query encoder; pass one to load() or use search_vectors()")
        out: list[list[tuple[dict, float]]] = [[] for _ in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if live:
            hits = self.search_vectors(self.encoder.encode_queries([queries[i] for i in live]), topk)
            for i, h in zip(live, hits):
                out[i] = h
        return out
