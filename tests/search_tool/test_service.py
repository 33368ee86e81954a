"""The search deployment on a local Ray: HTTP and handle, Search-R1 wire compatibility (exactly topk
hits), bad input, HEAD /health and /docs schemas, server-side batching, recall of the planted passages."""

import asyncio
import json

import httpx
import pandas as pd
import pytest

from services.config import load_config
from services.search_tool.bm25_index import BM25Index
from services.search_tool.service import deployment_options
from services.world.questions import questions_of
from services.world.relations import RELATIONS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def search(search_service):
    return search_service


@pytest.fixture(scope="module")
def index(world):
    return BM25Index.load(world / "index" / "bm25")


def _first_hop_queries(world, n=100):
    rows = pd.read_parquet(world / "test.parquet").head(n).to_dict("records")
    out = []
    for row in rows:
        hop = questions_of(row)[0].hops[0]
        out.append((RELATIONS[hop.relation].query.format(s=hop.subject), row["extra_info"]["planted"][0]))
    return out


def test_health(search, world):
    _, url = search
    r = httpx.get(f"{url}/health", timeout=30)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "ok" and body["backend"] == "bm25" and body["index_loaded"] is True
    assert body["corpus_size"] == sum(1 for _ in open(world / "corpus.jsonl"))
    head = httpx.head(f"{url}/health", timeout=30)  # load balancers probe with HEAD
    assert head.status_code == 200 and head.content == b""


def test_docs_show_request_and_response_schemas(search):
    _, url = search
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    post = spec["paths"]["/retrieve"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/RetrieveRequest"}
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/RetrieveResponse")
    assert post["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    schemas = spec["components"]["schemas"]
    assert set(schemas["RetrieveRequest"]["properties"]) == {"queries", "query", "topk", "return_scores"}
    assert {"ScoredHit", "Document"} <= set(schemas)
    assert httpx.get(f"{url}/docs", timeout=30).status_code == 200


def test_recall_at_3_over_http_and_handle(search, world):
    handle, url = search
    pairs = _first_hop_queries(world)
    queries = [q for q, _ in pairs]
    http = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 3, "return_scores": True}, timeout=60).json()
    via_handle = handle.search.remote(queries, 3).result()
    assert http["result"] == via_handle
    hits = sum(planted in [h["document"]["id"] for h in res] for (_, planted), res in zip(pairs, via_handle))
    print(f"recall@3 of the planted first-hop passage: {hits}/{len(pairs)}")
    assert hits >= 95


def test_response_is_byte_compatible_with_search_r1(search, index):
    """A client written to Search-R1's spec (generation.py: _batch_search / _passages2string)."""
    _, url = search
    queries = ["Gerkville city country", "Teabe Media founded by"]
    payload = {"queries": queries, "topk": 3, "return_scores": True}
    raw = httpx.post(f"{url}/retrieve", json=payload, timeout=30).content
    expected = {"result": [[{"document": {"id": r["id"], "contents": r["contents"]}, "score": s} for r, s in hits]
                           for hits in index.search(queries, 3)]}
    assert raw == json.dumps(expected, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    result = json.loads(raw)["result"]
    assert len(result) == len(queries)
    for docs in result:
        assert list(docs[0]) == ["document", "score"] and list(docs[0]["document"]) == ["id", "contents"]
        reference = ""
        for idx, doc_item in enumerate(docs):  # Search-R1's _passages2string, verbatim logic
            content = doc_item["document"]["contents"]
            title = content.split("\n")[0]
            text = "\n".join(content.split("\n")[1:])
            reference += f"Doc {idx + 1}(Title: {title}) {text}\n"
        assert reference.startswith("Doc 1(Title: \"")


def test_plain_documents_singular_query_and_defaults(search, index):
    _, url = search
    r = httpx.post(f"{url}/retrieve", json={"queries": ["Gerkville city country"]}, timeout=30).json()
    assert [d["id"] for d in r["result"][0]] == [row["id"] for row, _ in index.search(["Gerkville city country"], 3)[0]]
    assert set(r["result"][0][0]) == {"id", "contents"}
    single = httpx.post(f"{url}/retrieve", json={"query": "Gerkville city country", "topk": 2}, timeout=30).json()
    assert [d["id"] for d in single["result"][0]] == [d["id"] for d in r["result"][0][:2]]
    empty = httpx.post(f"{url}/retrieve", json={"queries": ["   ", "Gerkville"], "topk": 2}, timeout=30).json()
    assert [d["id"] for d in empty["result"][0]] == [r["id"] for r in index.rows[:2]] and len(empty["result"][1]) == 2


def test_exactly_topk_hits_padded_in_corpus_order_at_score_zero(search, index):
    """BM25 finds nothing for stop words or unknown terms; Search-R1 clients index hits by position."""
    _, url = search
    queries = ["zzqqxx", "the of and", "   ", "Gerkville city country"]
    r = httpx.post(f"{url}/retrieve", json={"queries": queries, "topk": 5, "return_scores": True}, timeout=30).json()
    assert [len(h) for h in r["result"]] == [5, 5, 5, 5]
    first = [row["id"] for row in index.rows[:5]]
    for hits in r["result"][:3]:
        assert [h["document"]["id"] for h in hits] == first and all(h["score"] == 0.0 for h in hits)
    found = index.search(queries[3:], 5)[0]
    real = r["result"][3][:len(found)]
    assert [(h["document"]["id"], h["score"]) for h in real] == [(row["id"], s) for row, s in found]
    pad = [h["document"]["id"] for h in r["result"][3][len(found):]]
    assert all(h["score"] == 0.0 for h in r["result"][3][len(found):])
    assert pad == [i for i in (row["id"] for row in index.rows) if i not in {row["id"] for row, _ in found}][:len(pad)]


BAD = [
    ({"queries": []}, 422, "queries"),
    ({"queries": ["ok", 3]}, 422, "queries.1"),
    ({"queries": "not a list"}, 422, "queries"),
    ({"queries": ["x"], "topk": 0}, 422, "topk"),
    ({"queries": ["x"], "topk": 51}, 422, "topk"),
    ({"queries": ["x"], "topk": "3"}, 422, "topk"),
    ({"queries": ["x"], "bogus": 1}, 422, "bogus"),
    ({"queries": ["x"], "query": "y"}, 422, "queries"),
    ({}, 422, "queries"),
    ({"queries": ["x"], "topk": True}, 422, "topk"),                  # a bool is not an int
    ({"queries": ["x"], "topk": 10**300}, 422, "topk"),
    ({"queries": ["x"], "return_scores": "yes"}, 422, "return_scores"),
    ({"queries": [["nested"]]}, 422, "queries.0"),
    ({"queries": ["x" * 4097]}, 413, "queries.0"),                     # over search.max_query_chars
    ({"queries": ["x"] * 513}, 422, "queries"),                         # over search.max_queries
]


@pytest.mark.parametrize("body,status,field", BAD)
def test_bad_input_gets_4xx_and_service_keeps_serving(search, body, status, field):
    _, url = search
    r = httpx.post(f"{url}/retrieve", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["field"] == field and r.json()["error"]
    ok = httpx.post(f"{url}/retrieve", json={"queries": ["Gerkville"]}, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["result"]) == 1


def test_malformed_and_oversized_bodies(search, tiny_cfg):
    _, url = search
    r = httpx.post(f"{url}/retrieve", content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "body"
    r = httpx.post(f"{url}/retrieve", json=[1, 2], timeout=30)
    assert r.status_code == 422
    big = {"queries": ["x" * (tiny_cfg.search.max_body_bytes + 10)]}
    r = httpx.post(f"{url}/retrieve", json=big, timeout=30)
    assert r.status_code == 413
    for raw in (b'{"queries": ["x"], "topk": ' + b"9" * 5000 + b"}",    # over Python's int digit limit
                b'{"queries": ' + b"[" * 3000 + b"]" * 3000 + b"}",       # RecursionError in the parser
                b'{"queries": ["x"], "topk": NaN}', b'{"queries": ["\xff"]}'):
        r = httpx.post(f"{url}/retrieve", content=raw, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["field"] == "body", (raw[:40], r.text)
    raw = b'{"queries": ["ok", "lone \\ud800 surrogate"]}'  # valid JSON, not valid text
    r = httpx.post(f"{url}/retrieve", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 422 and r.json()["field"] == "queries.1", r.text
    r = httpx.get(f"{url}/retrieve", timeout=30)
    assert r.status_code == 405 and set(r.json()) == {"error", "field"}
    assert httpx.post(f"{url}/retrieve", json={"query": "Gerkville"}, timeout=30).status_code == 200


def test_handle_rejects_bad_input_and_keeps_serving(search, index):
    handle, _ = search
    with pytest.raises(Exception, match="topk"):
        handle.search.remote(["x"], 0).result()
    with pytest.raises(Exception, match="queries.0"):
        handle.search.remote(["x" * 5000], 1).result()
    title = index.rows[0]["contents"].split("\n")[0].strip('"')  # a name this world's corpus has
    assert len(handle.search.remote([title], 1).result()[0]) == 1


def test_concurrent_handle_calls_are_batched(search, index):
    handle, _ = search
    before = handle.get_stats.remote().result()

    async def many():
        return await asyncio.gather(*[handle.search.remote([f"Gerkville {i}"], 2) for i in range(32)])

    results = asyncio.run(many())
    after = handle.get_stats.remote().result()
    assert all(len(r) == 1 for r in results)
    passes = after["index_passes"] - before["index_passes"]
    assert after["max_batch"] > 1 and passes < 32, (passes, after)
    assert results[0] == [[{"document": {"id": r["id"], "contents": r["contents"]}, "score": s}
                           for r, s in index.search(["Gerkville 0"], 2)[0]]]


def test_replicas_and_autoscaling_come_from_config():
    fixed = deployment_options(load_config(None, ["search.replicas=3"]))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    auto = deployment_options(load_config(None, ["search.autoscaling=true", "search.min_replicas=1",
                                                 "search.max_replicas=5", "search.target_ongoing_requests=8"]))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["max_replicas"] == 5 and auto["autoscaling_config"]["target_ongoing_requests"] == 8
