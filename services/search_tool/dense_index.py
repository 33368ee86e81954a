"""Dense retrieval: faiss inner-product search over normalised e5-style embeddings.

The encoder is any local transformers encoder directory (e5-base-v2 for Wikipedia, or a small one
such as all-MiniLM-L6-v2 for tests): mean pooling over the attention mask, L2 normalisation,
``"query: "`` / ``"passage: "`` prefixes (e5 convention, configurable). Vectors can also be
precomputed and handed in directly.

    enc = TextEncoder("path/to/e5-base-v2")
    index = DenseIndex.build(rows, enc, show_progress=True)    # or DenseIndex.from_vectors(rows, vecs, enc)
    index.save("index_dir"); index = DenseIndex.load("index_dir", enc)
    hits = index.search(["who founded Zentrix Labs"], topk=3)  # [[(row, score), ...]]
"""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import torch
from tqdm import tqdm

from services.common.jsonl import read_jsonl, write_jsonl

_CORPUS_FILE = "corpus.jsonl"
_INDEX_FILE = "faiss.index"
_META_FILE = "dense_meta.json"


class TextEncoder:
    """Mean-pooled, L2-normalised sentence embeddings from a local encoder directory."""

    def __init__(self, path: str | Path, query_prefix: str = "query: ", passage_prefix: str = "passage: ",
                 max_length: int = 256, batch_size: int = 64):
        from transformers import AutoModel, AutoTokenizer  # transformers on use

        if not Path(path).is_dir():
            raise FileNotFoundError(f"embedding model directory {str(path)!r} does not exist")
        self.path = str(path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModel.from_pretrained(self.path).eval()
        self.query_prefix, self.passage_prefix = query_prefix, passage_prefix
        self.max_length, self.batch_size = max_length, batch_size

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @torch.no_grad()
    def encode(self, texts: list[str], prefix: str = "", show_progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        starts = range(0, len(texts), self.batch_size)
        for s in tqdm(starts, desc="encoding", disable=not show_progress):
            batch = [prefix + t for t in texts[s : s + self.batch_size]]
            enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            hidden = self.model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[s : s + len(batch)] = torch.nn.functional.normalize(pooled, dim=-1).float().numpy()
        return out

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        return self.encode(queries, self.query_prefix)


class DenseIndex:
    backend = "dense"

    def __init__(self, index: "faiss.Index", rows: list[dict], encoder: TextEncoder | None):
        self.index = index
        self.rows = rows
        self.encoder = encoder

    @classmethod
    def from_vectors(cls, rows: list[dict], vectors: np.ndarray, encoder: TextEncoder | None = None) -> "DenseIndex":
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(vectors) != len(rows):
            raise ValueError(f"need one vector per row: {len(rows)} rows, vectors of shape {vectors.shape}")
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(vectors)
        return cls(index, rows, encoder)

    @classmethod
    def build(cls, rows: list[dict], encoder: TextEncoder, show_progress: bool = False) -> "DenseIndex":
        if not rows:
            raise ValueError("cannot index an empty corpus")
        vecs = encoder.encode([r["contents"] for r in rows], encoder.passage_prefix, show_progress)
        return cls.from_vectors(rows, vecs, encoder)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(path / _INDEX_FILE))
        write_jsonl(self.rows, path / _CORPUS_FILE)
        meta = {"dim": self.index.d, "size": self.index.ntotal, "encoder": self.encoder.path if self.encoder else None}
        (path / _META_FILE).write_text(json.dumps(meta))

    @classmethod
    def load(cls, path: str | Path, encoder: TextEncoder | None = None) -> "DenseIndex":
        path = Path(path)
        if not (path / _INDEX_FILE).is_file():
            raise FileNotFoundError(f"no dense index at {path} (build it first)")
        index = faiss.read_index(str(path / _INDEX_FILE))
        rows = read_jsonl(path / _CORPUS_FILE)
        if encoder is not None and encoder.dim != index.d:
            raise ValueError(f"encoder dim {encoder.dim} does not match the index dim {index.d}")
        return cls(index, rows, encoder)

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
