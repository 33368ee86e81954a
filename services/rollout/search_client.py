"""The rollout's side of search: timeouts, bounded retries with backoff, and graceful failure.

Talks to the search deployment through its Serve handle (in-cluster) or over HTTP (any
Search-R1-compatible server: ``search.url``). Both paths share the timeout (``search.timeout_s`` per
attempt), the retries (``search.retries``, backoff ``search.retry_backoff_s * 2**i``) and the
accounting: a search that still fails after the retries does not end the episode: the agent gets an
``<information>`` observation saying the search failed, the failure is counted in ``client.stats``
(and by the agent loop in the episode's ``tool_failures``), and each retried attempt is logged.

    client = SearchClient.from_handle(handle, cfg.search)    # or SearchClient.from_url(url, cfg.search)
    text, ok = await client.observation("Zentrix Labs founded by")
    client.stats  # {"calls": 1, "failures": 0, "retries": 0}

Over HTTP the client POSTs Search-R1's body ``{"queries", "topk", "return_scores": true}`` to
``<url>/retrieve`` (a ``url`` given with its ``/retrieve`` is used as it is) and expects
``{"result": [[{"document": {"id", "contents"}, "score"}, ...], ...]}``, one list per query (plain
documents, Search-R1's answer without scores, are taken too). A non-200 answer, a body that is not
JSON and one of another shape raise :class:`SearchAnswerError` naming what was wrong; like a timeout
or a refused connection, it is retried and then counted as a failed call. One ``httpx.AsyncClient``
(one connection pool) per event loop serves all of a client's calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from services.config import SearchConfig
from services.common.passage_format import format_passages
from services.common.turn_format import render_information

log = logging.getLogger("mempo.search")
FAILED_SEARCH = "Search failed: the search service did not answer ({reason}). Answer with what you know or search again."


class SearchAnswerError(RuntimeError):
    """An external /retrieve server answered, but not with Search-R1's results: a non-200 status, a body
    that is not JSON, or JSON of another shape. Retried and counted as any failed search call."""


def retrieve_url(url: str) -> str:
    """The endpoint of a ``search.url``: ``<base>/retrieve`` whether or not the URL ends with /retrieve."""
    base = url.rstrip("/")
    return base if base.endswith("/retrieve") else f"{base}/retrieve"


def _document(doc: Any, where: str) -> dict:
    if not isinstance(doc, dict) or not isinstance(doc.get("contents"), str):
        raise SearchAnswerError(f"{where}: expected a document with a string 'contents', got {str(doc)[:120]}")
    return doc


def parse_retrieve_answer(body: Any, n_queries: int) -> list[list[dict]]:
    """Search-R1's /retrieve answer -> one list of ``{"document", "score"}`` hits per query."""
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list):
        raise SearchAnswerError(f"expected a JSON object with a 'result' list, got {str(body)[:200]}")
    if len(result) != n_queries:
        raise SearchAnswerError(f"'result' has {len(result)} lists for {n_queries} queries")
    out = []
    for i, hits in enumerate(result):
        if not isinstance(hits, list):
            raise SearchAnswerError(f"result[{i}]: expected a list of hits, got {str(hits)[:120]}")
        row = []
        for j, hit in enumerate(hits):
            if isinstance(hit, dict) and "document" in hit:  # return_scores: {document, score}
                row.append({"document": _document(hit["document"], f"result[{i}][{j}].document"),
                            "score": hit.get("score")})
            else:  # a server that ignores return_scores sends the documents alone
                row.append({"document": _document(hit, f"result[{i}][{j}]"), "score": None})
        out.append(row)
    return out


@dataclass
class SearchClient:
    cfg: SearchConfig
    handle: Any = None
    url: Optional[str] = None  # the POST endpoint (retrieve_url of search.url)
    stats: dict = field(default_factory=lambda: {"calls": 0, "failures": 0, "retries": 0})
    _http: Optional[httpx.AsyncClient] = field(default=None, repr=False)
    _http_loop: Any = field(default=None, repr=False)

    @classmethod
    def from_handle(cls, handle: Any, cfg: SearchConfig) -> "SearchClient":
        return cls(cfg=cfg, handle=handle)

    @classmethod
    def from_url(cls, url: str, cfg: SearchConfig) -> "SearchClient":
        """A client of the Search-R1 server at ``url`` (``http://host:port`` or ``http://host:port/retrieve``)."""
        return cls(cfg=cfg, url=retrieve_url(url))

    def _client(self) -> httpx.AsyncClient:
        """The connection pool of the running event loop (a replica has one loop; a test may run several)."""
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop:
            # no connection cap: every episode of the replica may wait on a search at once, as on the handle
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._http, self._http_loop = httpx.AsyncClient(timeout=self.cfg.timeout_s, limits=limits), loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._http_loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = self._http_loop = None

    async def _once(self, queries: list[str], topk: int) -> list[list[dict]]:
        if self.handle is not None:
            return await self.handle.search.remote(queries, topk)
        r = await self._client().post(self.url, json={"queries": queries, "topk": topk, "return_scores": True})
        if r.status_code != 200:
            raise SearchAnswerError(f"{self.url} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SearchAnswerError(f"{self.url} answered a body that is not JSON ({e}): {r.text[:120]!r}") from None
        return parse_retrieve_answer(body, len(queries))

    async def search(self, queries: list[str], topk: Optional[int] = None) -> list[list[dict]]:
        """Search-R1 hits (``{"document", "score"}``) per query; raises after the last retry fails."""
        k = topk or self.cfg.topk
        self.stats["calls"] += 1
        for attempt in range(self.cfg.retries + 1):
            try:
                return await asyncio.wait_for(self._once(queries, k), self.cfg.timeout_s)
            except Exception as e:  # timeouts, dead replicas, HTTP errors: all retried the same way
                if attempt == self.cfg.retries:
                    self.stats["failures"] += 1
                    raise
                self.stats["retries"] += 1
                log.warning("search attempt %d failed (%s: %s); retrying", attempt + 1, type(e).__name__, e)
                await asyncio.sleep(self.cfg.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def observation(self, query: str, topk: Optional[int] = None) -> tuple[str, bool]:
        """The ``<information>`` block for one search call, and whether the search succeeded."""
        try:
            hits = (await self.search([query], topk))[0]
        except Exception as e:
            reason = type(e).__name__ if not str(e) else f"{type(e).__name__}: {str(e)[:200]}"
            return render_information(FAILED_SEARCH.format(reason=reason)), False
        return render_information(format_passages([h["document"] for h in hits], self.cfg.doc_format)), True
