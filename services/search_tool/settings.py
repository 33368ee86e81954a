"""The ``search`` config section: the retrieval service (backend, corpus, index, request limits,
batching, replicas and autoscaling) and the client the agent calls it with. Composed into the config
tree by services/config.py.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from services.common.config_fields import RUNTIME, CustomResources, Section

# Besides its own section: the world (the corpus and index still named 'world'), ray (call timeouts).
READS = ("world", "ray")


class SearchConfig(Section):
    url: str = Field(
        "",
        description=(
            "An external Search-R1 /retrieve server, http(s)://host[:port][/path] (with or without a trailing "
            "/retrieve): the rollout calls it and no search service is deployed; empty = deploy the in-cluster one."
        ),
    )
    backend: Literal["bm25", "dense"] = Field(
        "bm25",
        description="Retrieval backend.",
    )
    corpus: str = Field(
        "world",
        description="JSONL corpus path (Search-R1 format); 'world' = the embedded world's corpus.",
    )
    index_dir: str = Field(
        "",
        description=(
            "Index directory; empty = the world's index, or '<corpus>.<backend>' next to another corpus (built on "
            "first use)."
        ),
    )
    embedding_model: str = Field(
        "",
        description="Dense backend: local directory of an e5-style encoder (mean pooling).",
    )
    query_prefix: str = Field(
        "query: ",
        description="Dense backend: prefix of every query (e5 convention).",
    )
    passage_prefix: str = Field(
        "passage: ",
        description="Dense backend: prefix of every passage when indexing (e5 convention).",
    )
    faiss_index: str = Field(
        "flat",
        description=(
            "Dense backend: the faiss index built over the corpus: flat (exact), ivf (IVF cells, nprobe scanned), "
            "hnsw (a graph, ef_search), ivfpq (PQ codes in IVF cells, re-scored exactly) or a faiss index_factory "
            "string (e.g. IVF4096,SQ8); an index directory keeps the kind it was built with."
        ),
    )
    nlist: int = Field(
        0, ge=0,
        description="Dense backend, ivf and ivfpq: IVF cells when building; 0 = about 4 sqrt(corpus size).",
    )
    nprobe: int = Field(
        64, ge=1,
        description="Dense backend, ivf and ivfpq: IVF cells scanned per query (more: better recall, slower).",
    )
    ef_search: int = Field(
        128, ge=1,
        description="Dense backend, hnsw: candidates kept per query while walking the graph.",
    )
    refine_factor: int = Field(
        16, ge=1,
        description="Dense backend, ivfpq: the best refine_factor * topk PQ hits are re-scored with the full vectors.",
    )
    mmap: bool = Field(
        True,
        description=(
            "Dense backend: memory-map the faiss index (the replicas of a node share one copy in the page cache) "
            "instead of reading it into each replica's memory; the corpus is always read by offset from disk."
        ),
    )
    faiss_file: str = Field(
        "",
        description=(
            "Dense backend: a prebuilt faiss index whose row i is line i of search.corpus (Search-R1's "
            "e5_Flat.index with wiki-18.jsonl), used as is and never rebuilt; search.index_dir then only holds "
            "the corpus offsets. Empty = the index in search.index_dir (its e5_Flat.index if it has one)."
        ),
    )
    encode_batch_size: int = Field(
        64, ge=1,
        description="Dense backend: texts per encoder batch (on the GPU when there is one).",
    )
    topk: int = Field(
        3, ge=1, json_schema_extra=RUNTIME,
        description="Passages per search call (the agent's and the default of a request with topk null).",
    )
    max_topk: int = Field(
        50, ge=1, json_schema_extra=RUNTIME,
        description="Largest topk a request may ask for.",
    )
    max_queries: int = Field(
        512, ge=1, json_schema_extra=RUNTIME,
        description="Most queries in one request.",
    )
    max_query_chars: int = Field(
        4096, ge=1, json_schema_extra=RUNTIME,
        description="Longest query, in characters; a longer one gets 413.",
    )
    max_body_bytes: int = Field(
        1_000_000, ge=1024, json_schema_extra=RUNTIME,
        description="Larger HTTP request bodies get 413.",
    )
    doc_format: str = Field(
        "Doc {i} (Title: {title}) {text}",
        description="How one passage is shown to the agent inside <information>.",
    )
    batching: bool = Field(
        True,
        description="Batch concurrent requests server-side into one index pass (Serve @serve.batch).",
    )
    max_batch_size: int = Field(
        64, ge=1, json_schema_extra=RUNTIME,
        description="Most requests merged into one index pass.",
    )
    batch_wait_timeout_s: float = Field(
        0.005, ge=0, json_schema_extra=RUNTIME,
        description="How long a batch waits to fill, seconds.",
    )
    replicas: int = Field(
        1, ge=1,
        description="Search deployment replicas (fixed count; ignored when autoscaling).",
    )
    autoscaling: bool = Field(
        False,
        description="Let Serve scale replicas between min_replicas and max_replicas.",
    )
    min_replicas: int = Field(
        1, ge=0,
        description="Autoscaling: fewest replicas.",
    )
    max_replicas: int = Field(
        4, ge=1,
        description="Autoscaling: most replicas.",
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0,
        description="Autoscaling: target in-flight requests per replica.",
    )
    max_ongoing_requests: int = Field(
        256, ge=1,
        description="In-flight requests a replica accepts (Serve's default of 5 would cap batching).",
    )
    num_cpus: float = Field(
        0.5, ge=0,
        description="CPUs reserved per search replica.",
    )
    resources: CustomResources = Field(
        {},
        description=(
            "Custom Ray resources per search replica (e.g. {head_node: 1}): only nodes started with them (ray "
            "start --resources) host it; `mempo plan` shows what a config needs."
        ),
    )
    timeout_s: float = Field(
        10.0, gt=0,
        description="Client timeout per search call, seconds.",
    )
    retries: int = Field(
        2, ge=0,
        description="Client retries after a failed search call.",
    )
    retry_backoff_s: float = Field(
        0.2, ge=0,
        description="Client backoff before retry i is backoff * 2**i seconds.",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        """Kept as given; the client posts to ``<url without a trailing /retrieve>/retrieve``."""
        if not value:
            return value
        expected = "expected http(s)://host[:port][/path], e.g. http://127.0.0.1:8000/retrieve"
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 (raises on a port that is not a number in 0..65535)
        except ValueError as e:
            raise ValueError(f"{e}; {expected}") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"the scheme must be http or https, not {parts.scheme or 'missing'!r}; {expected}")
        if not parts.hostname:
            raise ValueError(f"no host; {expected}")
        if parts.username is not None or parts.password is not None:
            raise ValueError(f"no user or password in the URL; {expected}")
        if parts.query or parts.fragment or value.endswith(("?", "#")):
            raise ValueError(f"no query or fragment; {expected}")
        if any(c.isspace() for c in value):
            raise ValueError(f"no whitespace; {expected}")
        return value
