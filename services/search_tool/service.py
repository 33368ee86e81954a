"""The search service: a Ray Serve deployment, wire-compatible with Search-R1's ``/retrieve``.

HTTP (FastAPI ingress; request and response schemas at /docs):
    POST /retrieve  {"queries": [str], "topk": int|null, "return_scores": bool}   (or {"query": str})
        -> {"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}   with scores
        -> {"result": [[{"id", "contents"}, ...], ...]}                                 without
    GET|HEAD /health  {"status": "ok", "backend", "corpus_size", "batching", ...}
As Search-R1's server: ``queries`` required, ``topk`` optional (null = search.topk),
``return_scores`` false by default. Every query gets exactly ``topk`` hits when the corpus has that
many passages: BM25 finds none for a query of stop words or unknown terms, so the list is topped up
with the first passages of the corpus (corpus order) that are not hits yet, at score 0 (clients
index results by position, as Search-R1's own client does).
In-cluster (DeploymentHandle, no HTTP): ``await handle.search.remote(queries, topk)`` -> the
per-query lists with scores, unpadded (the agent sees what the index found, as the oracle that
writes the SFT data does).

Concurrent requests are merged server-side (``@serve.batch``) into one index pass. Bad input
(services/common/http.py: not JSON, wrong types, over the body, query count or query length
limits) gets a 4xx JSON body ``{"error": ..., "field": ...}`` and the replica keeps serving. Replica count or
autoscaling, batching and limits all come from the ``search`` config section:

    from services.search_tool.service import search_app
    serve.run(search_app(cfg), name="search", route_prefix="/")
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Union

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from ray import serve

from services.config import (MempoConfig, SearchConfig, actor_options, fields_marked, replica_config,
                                    updated_section)
from services.common.http import ERROR_RESPONSES, document_body, install_error_handlers, parse_model, read_json
from services.common.http import HttpError as BadRequest
from services.common.rest_auth import configure_auth, install_auth
from services.serve_version import pinned

log = logging.getLogger("mempo.search")
app = FastAPI(title="mempo search", description="Search-R1 compatible retrieval for MemPO agents.")
install_error_handlers(app)
install_auth(app)  # 401 without the bearer token, when one is configured (ray.http_auth)


class RetrieveRequest(BaseModel):
    """Body of POST /retrieve (Search-R1's QueryRequest, plus the singular ``query`` form)."""

    model_config = ConfigDict(extra="forbid")
    queries: Optional[list[StrictStr]] = Field(None, description="The queries (give this or query).")
    query: Optional[StrictStr] = Field(None, description="One query (give this or queries).")
    topk: Optional[StrictInt] = Field(None, description="Passages per query; null = the server's search.topk.")
    return_scores: StrictBool = Field(False, description="Wrap each passage as {document, score}.")


class Document(BaseModel):
    id: str
    contents: str = Field(description='Search-R1 contents: "\"Title\"\ntext".')


class ScoredHit(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    """One list per query, in query order, best first: scored hits, or plain documents."""

    result: Union[list[list[ScoredHit]], list[list[Document]]]


# before the class: @serve.ingress freezes a copy of the app
document_body(app, "/retrieve", RetrieveRequest)


def _hit(row: dict, score: float) -> dict:
    return {"document": {"id": row["id"], "contents": row["contents"]}, "score": score}


@serve.deployment(name="search")
@serve.ingress(app)
class SearchService:
    def __init__(self, config: dict):
        from services.search_tool.backends import load_backend  # torch at its top, in the replica only

        cfg = MempoConfig.model_validate(config)
        configure_auth(cfg.ray)  # before the index loads: a missing token fails the start at once
        self.cfg = cfg.search
        t0 = time.perf_counter()
        self.index = load_backend(cfg)
        self.load_s = time.perf_counter() - t0
        self._batched.set_max_batch_size(self.cfg.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.cfg.batch_wait_timeout_s)
        self.stats = {"requests": 0, "queries": 0, "index_passes": 0, "max_batch": 0, "bad_requests": 0}
        log.info("search replica ready: %s over %d passages (%.1fs)", self.index.backend, len(self.index), self.load_s)

    RUNTIME_FIELDS = fields_marked(SearchConfig, "runtime")  # marked in services/search_tool/settings.py

    def reconfigure(self, user_config: dict) -> None:
        """Serve ``user_config``: change the search tool's runtime fields (``RUNTIME_FIELDS``; `mempo
        config --help-fields` marks them) on the running replicas (no index reload)."""
        self.cfg = updated_section(self.cfg, user_config, self.RUNTIME_FIELDS)
        self._batched.set_max_batch_size(self.cfg.max_batch_size)
        self._batched.set_batch_wait_timeout_s(self.cfg.batch_wait_timeout_s)
        log.info("search reconfigured: %s", user_config)

    # -- the search itself ------------------------------------------------------------------

    def _check(self, queries: list, topk: Optional[int]) -> int:
        if not isinstance(queries, list) or not queries:
            raise BadRequest(422, "queries", "must be a non-empty list of strings")
        if len(queries) > self.cfg.max_queries:
            raise BadRequest(422, "queries", f"at most {self.cfg.max_queries} queries per request, got {len(queries)}")
        bad = next((i for i, q in enumerate(queries) if not isinstance(q, str)), None)
        if bad is not None:
            raise BadRequest(422, f"queries.{bad}", f"must be a string, got {type(queries[bad]).__name__}")
        long = next((i for i, q in enumerate(queries) if len(q) > self.cfg.max_query_chars), None)
        if long is not None:
            raise BadRequest(413, f"queries.{long}", f"{len(queries[long])} characters, over the limit of "
                                                      f"{self.cfg.max_query_chars} per query")
        k = self.cfg.topk if topk is None else topk
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.cfg.max_topk:
            raise BadRequest(422, "topk", f"must be an integer in [1, {self.cfg.max_topk}], got {topk!r}")
        return k

    def _pass(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        self.stats["index_passes"] += 1
        return self.index.search(queries, topk)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)
    async def _batched(self, requests: list[tuple[list[str], int]]) -> list[list[list[tuple[dict, float]]]]:
        """Many concurrent requests -> one index pass at the largest topk, then split back."""
        self.stats["max_batch"] = max(self.stats["max_batch"], len(requests))
        flat = [q for qs, _ in requests for q in qs]
        hits = await asyncio.to_thread(self._pass, flat, max(k for _, k in requests))
        out, i = [], 0
        for qs, k in requests:
            out.append([h[:k] for h in hits[i : i + len(qs)]])
            i += len(qs)
        return out

    async def _search(self, queries: list[str], topk: int) -> list[list[tuple[dict, float]]]:
        self.stats["requests"] += 1
        self.stats["queries"] += len(queries)
        if self.cfg.batching:
            return await self._batched((queries, topk))
        return await asyncio.to_thread(self._pass, queries, topk)

    async def search(self, queries: list[str], topk: Optional[int] = None) -> list[list[dict]]:
        """Handle method: Search-R1 results with scores, one list per query, in order.
        Raises ValueError on bad input (the replica keeps serving)."""
        try:
            k = self._check(queries, topk)
        except BadRequest as e:
            raise ValueError(f"{e.field}: {e.message}") from None
        return [[_hit(r, s) for r, s in hits] for hits in await self._search(queries, k)]

    def get_stats(self) -> dict:
        return dict(self.stats)

    def _padded(self, hits: list[tuple[dict, float]], k: int) -> list[tuple[dict, float]]:
        """``hits`` topped up to ``k`` with the corpus's first passages not among them, at score 0."""
        if len(hits) >= k:
            return hits[:k]
        out, seen = list(hits), {r["id"] for r, _ in hits}  # the dense backend's rows are read anew per access
        for row in self.index.rows:
            if len(out) >= k:
                break
            if row["id"] not in seen:
                out.append((row, 0.0))
        return out

    # -- HTTP -------------------------------------------------------------------------------

    @app.post("/retrieve", response_model=None, responses={200: {"model": RetrieveResponse}, **ERROR_RESPONSES})
    async def retrieve(self, request: Request):
        """Search-R1's /retrieve: the top ``topk`` passages of every query."""
        try:
            req = parse_model(RetrieveRequest, await read_json(request, self.cfg.max_body_bytes))
            if (req.queries is None) == (req.query is None):
                raise BadRequest(422, "queries", "give exactly one of 'queries' (a list) or 'query' (a string)")
            queries = req.queries if req.queries is not None else [req.query]
            k = self._check(queries, req.topk)
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            return e.response()
        hits = [self._padded(h, k) for h in await self._search(queries, k)]
        if req.return_scores:
            return {"result": [[_hit(r, s) for r, s in h] for h in hits]}
        return {"result": [[{"id": r["id"], "contents": r["contents"]} for r, _ in h] for h in hits]}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        return {"status": "ok", "backend": self.index.backend, "corpus_size": len(self.index),
                "index_loaded": True, "batching": self.cfg.batching, "load_s": round(self.load_s, 3),
                **self.stats}


def deployment_options(cfg: MempoConfig) -> dict:
    """Serve options of the search deployment, from the config alone."""
    s = cfg.search
    opts: dict = {"ray_actor_options": actor_options(s.num_cpus, 0.0, s.resources),
                  "max_ongoing_requests": s.max_ongoing_requests}
    if s.autoscaling:
        opts["autoscaling_config"] = {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                                      "initial_replicas": max(s.min_replicas, 1),
                                      "target_ongoing_requests": s.target_ongoing_requests}
    else:
        opts["num_replicas"] = s.replicas
    return opts


def search_app(cfg: MempoConfig):
    """The bound search application for ``serve.run``."""
    config = replica_config(cfg)
    return pinned(SearchService.options(**deployment_options(cfg)), config, "search_tool").bind(config)
