"""A corpus at Wikipedia scale, in small: the corpus read by offset, each faiss index kind's recall
against flat, the memory-mapped load, Search-R1's e5_Flat.index + wiki-18.jsonl layout as published,
and the config-driven build (streamed from the corpus file, under a lock). No model, no download:
vectors are synthetic and the query encoder a stub."""

import json
import zlib
from pathlib import Path

import faiss
import numpy as np
import pytest

from services.config import load_config
from services.search_tool import backends
from services.search_tool.corpus_store import CorpusStore, offsets_current, write_offsets
from services.search_tool.dense_index import DenseIndex, factory_string, read_faiss


class StubEncoder:
    """Deterministic text -> unit vector; "row <i>" gives the vector of row i of ``table``."""

    path = "stub"
    passage_prefix = ""
    query_prefix = ""

    def __init__(self, dim: int, table: np.ndarray | None = None):
        self.dim, self.table = dim, table

    def _one(self, text: str) -> np.ndarray:
        if self.table is not None and text.startswith("row "):
            return self.table[int(text.split()[1])]
        v = np.random.default_rng(zlib.crc32(text.encode())).normal(size=self.dim).astype(np.float32)
        return v / np.linalg.norm(v)

    def encode(self, texts, prefix="", show_progress=False):
        return np.stack([self._one(t) for t in texts]) if texts else np.zeros((0, self.dim), np.float32)

    def encode_queries(self, queries):
        return self.encode(queries)


def _clustered(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """Unit vectors around 50 centres (embeddings of a real corpus cluster by topic)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(50, dim))
    x = centres[rng.integers(0, 50, n)] + 0.6 * rng.normal(size=(n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


def _rows(n: int) -> list[dict]:
    return [{"id": str(i), "contents": f'"Title {i}"\npassage {i} ünïcødé ☃ {"x" * (i % 7)}'} for i in range(n)]


# -- the corpus store ---------------------------------------------------------------------------------

def test_corpus_store_reads_rows_by_offset(tmp_path, monkeypatch):
    rows = _rows(10_000)
    corpus = tmp_path / "c.jsonl"
    with open(corpus, "w", encoding="utf-8", newline="") as f:
        f.write("\n   \n")  # blank lines are not rows (as read_jsonl)
        for i, r in enumerate(rows):
            f.write(json.dumps(r, ensure_ascii=i % 2 == 0) + ("\r\n" if i % 5 == 0 else "\n") + ("\n" if i % 11 == 0 else ""))
    import services.search_tool.corpus_store as cs

    monkeypatch.setattr(cs, "_CHUNK", 4099)  # lines cut across reads
    store = CorpusStore.open(corpus, tmp_path / "o.npy")
    assert len(store) == 10_000 and store.offsets.dtype == np.uint64
    assert store[0] == rows[0] and store[9_999] == rows[-1] and store[-1] == rows[-1]
    assert store.rows([4321, 7]) == [rows[4321], rows[7]] and store[10:13] == rows[10:13]
    assert list(store) == rows
    assert "☃" in store[1]["contents"]
    with pytest.raises(IndexError):
        store[10_000]
    # offsets are kept while the corpus is unchanged, recomputed when it changes
    assert offsets_current(corpus, tmp_path / "o.npy")
    with open(corpus, "a", encoding="utf-8") as f:
        f.write(json.dumps({"id": "new", "contents": "né"}))  # no final newline
    assert not offsets_current(corpus, tmp_path / "o.npy")
    again = CorpusStore.open(corpus, tmp_path / "o.npy")
    assert len(again) == 10_001 and again[-1] == {"id": "new", "contents": "né"}
    assert write_offsets(corpus, tmp_path / "p.npy") == 10_001
    corpus.write_text("")
    with pytest.raises(ValueError, match="does not describe"):
        CorpusStore(corpus, tmp_path / "p.npy")
    assert len(CorpusStore.open(corpus, tmp_path / "p.npy")) == 0


# -- index kinds ---------------------------------------------------------------------------------------

def _recall(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(e)) / len(e) for a, e in zip(approx, exact)]))


@pytest.mark.parametrize("kind", ["ivf", "hnsw", "ivfpq"])
def test_approximate_kinds_recall_against_flat(kind, tmp_path):
    vecs = _clustered(5_000, 32)
    rows = _rows(5_000)
    queries = _clustered(200, 32, seed=1)
    flat = DenseIndex.from_vectors(rows, vecs)
    _, exact = flat.index.search(queries, 3)
    index = DenseIndex.from_vectors(rows, vecs, kind=kind)
    assert index.kind == kind and index.index.ntotal == 5_000
    index.save(tmp_path / kind)
    loaded = DenseIndex.load(tmp_path / kind, mmap=True, nprobe=16, ef_search=128, refine_factor=16)
    assert loaded.kind == kind and isinstance(loaded.rows, CorpusStore)
    _, approx = loaded.index.search(queries, 3)
    recall = _recall(approx, exact)
    print(f"{kind} ({factory_string(kind, 5_000, 32)}): recall@3 vs flat {recall:.3f}")
    assert recall >= 0.9
    hits = loaded.search_vectors(queries[:2], 3)
    assert [r["id"] for r, _ in hits[0]] == [str(i) for i in approx[0]] and hits[0][0][0] == rows[approx[0][0]]


def test_factory_strings_and_unknown_kind():
    assert factory_string("flat", 10, 8) == "Flat"
    assert factory_string("ivf", 1_000_000, 768) == "IVF4096,Flat"
    assert factory_string("ivfpq", 1_000_000, 768) == "IVF4096,PQ96x8,RFlat"
    assert factory_string("IVF64,SQ8", 10_000, 8) == "IVF64,SQ8"
    with pytest.raises(ValueError, match="unknown faiss index"):
        factory_string("annoy", 10, 8)


def _mapped(path: Path) -> bool:
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_mmap_load_maps_the_index_file_and_answers_alike(kind, tmp_path):
    vecs = _clustered(2_000, 16)
    DenseIndex.from_vectors(_rows(2_000), vecs, kind=kind).save(tmp_path / "d")
    queries = _clustered(20, 16, seed=3)
    plain = DenseIndex.load(tmp_path / "d", mmap=False, nprobe=8)
    assert not _mapped(tmp_path / "d" / "faiss.index")
    mapped = DenseIndex.load(tmp_path / "d", mmap=True, nprobe=8)
    assert _mapped(tmp_path / "d" / "faiss.index") and _mapped(tmp_path / "d" / "corpus.jsonl")
    a, b = plain.search_vectors(queries, 3), mapped.search_vectors(queries, 3)
    assert [[r["id"] for r, _ in h] for h in a] == [[r["id"] for r, _ in h] for h in b]
    assert read_faiss(tmp_path / "d" / "faiss.index", mmap=True).ntotal == 2_000


# -- Search-R1's published layout ----------------------------------------------------------------------

def _search_r1_folder(folder: Path, n: int = 50, dim: int = 16) -> np.ndarray:
    """What Search-R1's download script leaves: e5_Flat.index (IndexFlatIP, row i = corpus line i)
    and wiki-18.jsonl ({"id", "contents": '"Title"\\ntext'})."""
    folder.mkdir(parents=True, exist_ok=True)
    vecs = _clustered(n, dim, seed=7)
    flat = faiss.IndexFlatIP(dim)
    flat.add(vecs)
    faiss.write_index(flat, str(folder / "e5_Flat.index"))
    with open(folder / "wiki-18.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"id": str(i), "contents": f'"Page {i}"\nText of page {i}.'}) + "\n")
    return vecs


@pytest.mark.parametrize("how", ["index_dir", "faiss_file"])
def test_search_r1_e5_flat_index_and_wiki18_load_as_published(how, tmp_path, monkeypatch):
    folder = tmp_path / "search_r1"
    vecs = _search_r1_folder(folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    monkeypatch.setattr(backends, "_encoder", lambda cfg: StubEncoder(16, vecs))
    where = ([f"search.index_dir={folder}"] if how == "index_dir" else
             [f"search.faiss_file={folder / 'e5_Flat.index'}", f"search.index_dir={tmp_path / 'offsets'}"])
    cfg = load_config("deploy/configs/tiny.yaml", ["search.backend=dense", f"search.corpus={folder / 'wiki-18.jsonl'}",
                                                   "search.embedding_model=stub", *where])
    index = backends.load_backend(cfg)
    assert len(index) == 50 and isinstance(index.rows, CorpusStore)
    hits = index.search(["row 17", "row 3"], 3)
    assert [h[0][0]["id"] for h in hits] == ["17", "3"]
    assert hits[0][0][0]["contents"] == '"Page 17"\nText of page 17.' and hits[0][0][1] == pytest.approx(1.0, abs=1e-5)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.name in before} == before  # files untouched
    assert not (folder / "faiss.index").exists() and not (folder / "corpus.jsonl").exists()
    # a corpus that is not the index's: said, not silently misaligned
    with open(folder / "wiki-18.jsonl", "a") as f:
        f.write(json.dumps({"id": "50", "contents": "extra"}) + "\n")
    with pytest.raises(ValueError, match="50 vectors but .* 51 rows"):
        backends.load_backend(cfg)


# -- the config path -------------------------------------------------------------------------------------

def test_load_backend_streams_a_configured_ivf_build_once(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for r in _rows(3_000):
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    monkeypatch.setattr(backends, "_encoder", lambda cfg: StubEncoder(16))
    over = ["search.backend=dense", f"search.corpus={corpus}", "search.embedding_model=stub",
            "search.faiss_index=ivf", "search.nprobe=4"]
    cfg = load_config("deploy/configs/tiny.yaml", over)
    index = backends.load_backend(cfg)
    out = Path(f"{corpus}.dense")
    assert index.kind == "ivf" and isinstance(faiss.downcast_index(index.index), faiss.IndexIVFFlat)
    assert faiss.extract_index_ivf(index.index).nprobe == 4 and index.index.ntotal == 3_000
    assert json.loads((out / "dense_meta.json").read_text())["kind"] == "ivf"
    assert {p.name for p in out.iterdir()} >= {"faiss.index", "corpus.jsonl", "corpus.offsets.npy", "dense_meta.json"}
    stamp = (out / "faiss.index").stat().st_mtime_ns
    again = backends.load_backend(cfg)  # loads, does not rebuild
    assert (out / "faiss.index").stat().st_mtime_ns == stamp and _mapped(out / "faiss.index")
    text = '"Title 5"\npassage 5 ünïcødé ☃ xxxxx'
    assert again.search([text], 3)[0][0][0]["id"] == "5"  # a passage's own text finds it
    with pytest.raises(ValueError, match="built as 'ivf' but search.faiss_index is 'flat'"):
        backends.load_backend(load_config("deploy/configs/tiny.yaml", over[:-2]))
    with pytest.raises(FileNotFoundError, match="no dense index"):
        backends.load_backend(load_config("deploy/configs/tiny.yaml", over + [f"search.index_dir={tmp_path / 'x'}"]),
                              build_missing=False)
