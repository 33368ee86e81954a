"""The rollout's side of search: timeouts, bounded retries with backoff, and graceful failure.

Talks to the search deployment through its Serve handle (in-cluster) or over HTTP (any
Search-R1-compatible server). A search that still fails after the retries does not end the
episode: the agent gets an ``<information>`` observation saying the search failed, and the
failure is counted in ``client.stats``.

    client = SearchClient.from_handle(handle, cfg.search)    # or SearchClient.from_url(url, cfg.search)
    text, ok = await client.observation("Zentrix Labs founded by")
    client.stats  # {"calls": 1, "failures": 0, "retries": 0}
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from services.common.config import SearchConfig
from services.common.passage_format import format_passages
from services.common.turn_format import render_information

log = logging.getLogger("mempo.search")
FAILED_SEARCH = "Search failed: the search service did not answer ({reason}). Answer with what you know or search again."


@dataclass
class SearchClient:
    cfg: SearchConfig
    handle: Any = None
    url: Optional[str] = None
    stats: dict = field(default_factory=lambda: {"calls": 0, "failures": 0, "retries": 0})

    @classmethod
    def from_handle(cls, handle: Any, cfg: SearchConfig) -> "SearchClient":
        return cls(cfg=cfg, handle=handle)

    @classmethod
    def from_url(cls, url: str, cfg: SearchConfig) -> "SearchClient":
        return cls(cfg=cfg, url=url.rstrip("/"))

    async def _once(self, queries: list[str], topk: int) -> list[list[dict]]:
        if self.handle is not None:
            return await self.handle.search.remote(queries, topk)
        async with httpx.AsyncClient(timeout=self.cfg.timeout_s) as http:
            r = await http.post(f"{self.url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": True})
            r.raise_for_status()
            return r.json()["result"]

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
