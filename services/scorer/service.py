"""The scorer service: the memory reward as a Ray Serve deployment with a REST endpoint.

Handle methods (payloads are msgpack bytes of protocol messages; a top-level ObjectRef arrives
resolved):
    score(TrajectoryBatch bytes) -> MemoryScoreBatch bytes   (by value: the caller owns the ref)
    update_weights(WeightUpdate bytes, version) -> {"version", "seconds"}
    info() -> {"version", "model", "replica"}

HTTP (FastAPI; OpenAPI docs at /docs):
    POST /score   text form  {"question": str|[str], "memory": str, "history": [{"role", "content"}],
                              "answer": str|[str], "system": str (optional)}
                  token form {"mem_context_ids": [int], "full_context_ids": [int],
                              "continuation_ids": [int], "answer_span": [start, end]}
                  -> {"p_mem", "p_full", "r_mem", "mem_logprobs", "full_logprobs", "mem_keep",
                      "full_keep", "answer_ids", "answer_tokens", "policy_version", "tau", "filter_mode"}
    GET /health
Over ``scorer.max_request_tokens`` -> 413; malformed or inconsistent input -> 422 naming the field
(400 for a body that is not JSON); the replica keeps serving.

Weights swap atomically: scoring and ``update_weights`` take the same lock, so a request is scored
wholly by one version, and every response says which.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, Union

import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from ray import serve

from services.common.codec import decode, encode
from services.common.config import MempoConfig, replica_config
from services.common.http import HttpError as BadRequest
from services.common.http import parse_model, read_json
from services.common.messages import TrajectoryBatch, WeightUpdate
from services.common.model_io import model_dtype, validate_weights

log = logging.getLogger("mempo.scorer")
app = FastAPI(title="mempo scorer", description="MemPO memory reward: how likely is the gold answer after "
                                                "the memory alone versus after the full history.")


class ChatTurn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr = Field(pattern="^(system|user|assistant|tool)$")
    content: StrictStr


class TextScoreRequest(BaseModel):
    """Grade a memory: P(answer | system + question + memory) vs P(answer | the full history)."""

    model_config = ConfigDict(extra="forbid")
    question: Union[StrictStr, list[StrictStr]]
    memory: StrictStr
    history: list[ChatTurn] = []
    answer: Union[StrictStr, list[StrictStr]]
    system: Optional[StrictStr] = None


class TokenScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mem_context_ids: list[StrictInt]
    full_context_ids: list[StrictInt]
    continuation_ids: list[StrictInt]
    answer_span: tuple[StrictInt, StrictInt]


def _load_model(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(dtype), attn_implementation="sdpa")
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


@serve.deployment(name="scorer")
@serve.ingress(app)
class ScorerService:
    def __init__(self, config: dict):
        from transformers import AutoTokenizer

        from services.common.paths import model_path
        from services.scorer.scorer import MemoryScorer

        self.cfg = MempoConfig.model_validate(config)
        self.model_dir = str(model_path(self.cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.scorer = MemoryScorer(_load_model(self.model_dir, self.cfg.model.dtype), self.tokenizer, self.cfg)
        self.version = 0
        self.lock = asyncio.Lock()
        self.vocab = len(self.tokenizer)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.stats = {"score_calls": 0, "rest_calls": 0, "bad_requests": 0}

    # -- training path ------------------------------------------------------------------------

    async def score(self, payload: bytes) -> bytes:
        batch = decode(payload, TrajectoryBatch)
        async with self.lock:
            out = await asyncio.to_thread(self.scorer.score_trajectories, batch, self.version)
        self.stats["score_calls"] += 1
        return encode(out)

    async def update_weights(self, payload: bytes, version: Optional[int] = None) -> dict:
        update = decode(payload, WeightUpdate)
        if version is not None and version != update.version:
            raise ValueError(f"version {version} does not match the WeightUpdate's version {update.version}")
        model = self.scorer.model
        tied = model.config.tie_word_embeddings
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        tensors = validate_weights(update.tensors, expected)
        t0 = time.perf_counter()
        async with self.lock:  # no request is scored half with the old weights, half with the new
            model.load_state_dict(tensors, strict=False)
            self.version = update.version
        return {"version": update.version, "seconds": time.perf_counter() - t0, "replica": self.replica}

    RUNTIME_FIELDS = ("tau", "filter_mode", "mean_eps", "token_budget", "max_request_tokens")

    async def reconfigure(self, user_config: dict) -> None:
        """Serve ``user_config``: change scorer.{tau, filter_mode, mean_eps, token_budget,
        max_request_tokens} on the running replicas (no restart)."""
        from services.common.config import updated_section

        section = updated_section(self.cfg.scorer, user_config, self.RUNTIME_FIELDS)
        async with self.lock:
            self.cfg.scorer = section
            self.scorer.cfg = section
        log.info("scorer reconfigured: %s", user_config)

    def info(self) -> dict:
        return {"version": self.version, "model": self.model_dir, "replica": self.replica, **self.stats}

    # -- REST ---------------------------------------------------------------------------------

    def _check_ids(self, field: str, ids: list[int]) -> None:
        if not ids:
            raise BadRequest(422, field, "must not be empty")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(422, f"{field}[{bad}]", f"unknown token id {ids[bad]} (vocabulary size {self.vocab})")

    def _text_request(self, req: TextScoreRequest):
        from services.scorer.continuation import build_continuation
        from services.scorer.scorer import text_contexts

        questions = [req.question] if isinstance(req.question, str) else req.question
        answers = [req.answer] if isinstance(req.answer, str) else req.answer
        if not questions or not all(q.strip() for q in questions):
            raise BadRequest(422, "question", "must be a non-empty question or list of questions")
        if not answers or not all(a.strip() for a in answers):
            raise BadRequest(422, "answer", "must not be empty")
        system = req.system if req.system is not None else self.cfg.rollout.system_prompt
        mem_ctx, full_ctx = text_contexts(self.tokenizer, system, questions, req.memory,
                                          [t.model_dump() for t in req.history])
        try:
            cont = build_continuation(self.tokenizer, self.cfg.scorer.answer_template,
                                      self.cfg.scorer.gold_joiner.join(a.strip() for a in answers), self.scorer.tt)
        except ValueError as e:
            raise BadRequest(422, "answer", str(e)) from None
        return mem_ctx, full_ctx, cont

    def _token_request(self, req: TokenScoreRequest):
        from services.scorer.continuation import Continuation

        for name in ("mem_context_ids", "full_context_ids", "continuation_ids"):
            self._check_ids(name, getattr(req, name))
        s, e = req.answer_span
        if not 0 <= s < e <= len(req.continuation_ids):
            raise BadRequest(422, "answer_span", f"[{s}, {e}) is not a non-empty span of the "
                                                 f"{len(req.continuation_ids)}-token continuation")
        return req.mem_context_ids, req.full_context_ids, Continuation("", list(req.continuation_ids), s, e)

    async def _parse(self, request: Request):
        limit = 16 * self.cfg.scorer.max_request_tokens + 65536  # bytes: ids are at most ~8 chars each
        data = await read_json(request, limit)
        model = TextScoreRequest if "question" in data else TokenScoreRequest if "continuation_ids" in data else None
        if model is None:
            raise BadRequest(422, "body", "give the text form (question, memory, history, answer) or the token "
                                          "form (mem_context_ids, full_context_ids, continuation_ids, answer_span)")
        req = parse_model(model, data)
        mem_ctx, full_ctx, cont = self._text_request(req) if model is TextScoreRequest else self._token_request(req)
        total = len(mem_ctx) + len(full_ctx) + 2 * len(cont.ids)
        if total > self.cfg.scorer.max_request_tokens:
            raise BadRequest(413, "body", f"{total} tokens to score, over the limit of {self.cfg.scorer.max_request_tokens}")
        return mem_ctx, full_ctx, cont

    @app.post("/score")
    async def score_rest(self, request: Request):
        try:
            mem_ctx, full_ctx, cont = await self._parse(request)
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            return e.response()
        async with self.lock:
            out = await asyncio.to_thread(self.scorer.score_pair, mem_ctx, full_ctx, cont)
            out["policy_version"] = self.version
        self.stats["rest_calls"] += 1
        return out

    @app.get("/health")
    async def health(self):
        return {"status": "ok", "policy_version": self.version, "model": self.model_dir,
                "device": str(next(self.scorer.model.parameters()).device), **self.stats}


def deployment_options(cfg: MempoConfig) -> dict:
    s = cfg.scorer
    return {"num_replicas": s.replicas, "max_ongoing_requests": 32,
            "ray_actor_options": {"num_cpus": s.num_cpus, "num_gpus": s.num_gpus}}


def scorer_app(cfg: MempoConfig):
    return ScorerService.options(**deployment_options(cfg)).bind(replica_config(cfg))
