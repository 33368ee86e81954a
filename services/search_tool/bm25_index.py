"""BM25 retrieval over a Search-R1 JSONL corpus, with bm25s (the default search backend).

Build once, save to disk, load in each search replica; search is batched (many queries, one
index pass). Documents come back as Search-R1 rows ``{"id", "contents"}`` with their scores.

    index = BM25Index.build(rows)            # rows: [{"id": "0", "contents": "\\"T\\"\\ntext"}, ...]
    index.save("index_dir"); index = BM25Index.load("index_dir")
    hits = index.search(["Ada Brenn born"], topk=3)   # [[(row, score), ...]]

An empty or whitespace-only query, or one that matches no indexed term, returns an empty list.
"""

from __future__ import annotations

from pathlib import Path

import bm25s
import numpy as np
import Stemmer

from services.common.jsonl import read_jsonl, write_jsonl

_STEMMER = Stemmer.Stemmer("english")
_CORPUS_FILE = "corpus.jsonl"


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords="en", stemmer=_STEMMER, return_ids=False, show_progress=False)


def _tokenize_corpus(texts: list[str]) -> "bm25s.tokenization.Tokenized":
    """Corpus tokens with a sorted vocabulary, so the saved index is byte-identical across runs
    (bm25s's own vocabulary order follows Python's per-process string hashing)."""
    docs = _tokenize(texts)
    vocab = {w: i for i, w in enumerate(sorted({w for d in docs for w in d} | {""}))}
    return bm25s.tokenization.Tokenized(ids=[[vocab[w] for w in d] for d in docs], vocab=vocab)


class BM25Index:
    backend = "bm25"

    def __init__(self, retriever: "bm25s.BM25", rows: list[dict]):
        self.retriever = retriever
        self.rows = rows

    @classmethod
    def build(cls, rows: list[dict], show_progress: bool = False) -> "BM25Index":
        if not rows:
            raise ValueError("cannot index an empty corpus")
        retriever = bm25s.BM25()
        retriever.index(_tokenize_corpus([r["contents"] for r in rows]), show_progress=show_progress)
        return cls(retriever, rows)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.retriever.save(str(path), show_progress=False)
        write_jsonl(self.rows, path / _CORPUS_FILE)

    @classmethod
    def load(cls, path: str | Path) -> "BM25Index":
        path = Path(path)
        if not (path / _CORPUS_FILE).is_file():
            raise FileNotFoundError(f"no BM25 index at {path} (build it first)")
        retriever = bm25s.BM25.load(str(path), show_progress=False)
        rows = read_jsonl(path / _CORPUS_FILE)
        return cls(retriever, rows)

    def __len__(self) -> int:
        return len(self.rows)

    def search(self, queries: list[str], topk: int = 3) -> list[list[tuple[dict, float]]]:
        """Top-k (row, score) per query, best first, in query order; one index pass for all."""
        out: list[list[tuple[dict, float]]] = [[] for _ in queries]
        live = [i for i, q in enumerate(queries) if q.strip()]
        if not live:
            return out
        k = min(topk, len(self.rows))
        tokens = _tokenize([queries[i] for i in live])
        docs, scores = self.retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        for j, i in enumerate(live):
            out[i] = [(self.rows[int(d)], float(s)) for d, s in zip(docs[j], scores[j]) if s > 0 and np.isfinite(s)]
        return out
