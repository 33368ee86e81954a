"""The scorer service: the memory reward as a Ray Serve deployment with a REST endpoint.

Handle methods (payloads are msgpack bytes of protocol messages; a top-level ObjectRef arrives
resolved):
    score(TrajectoryBatch bytes) -> MemoryScoreBatch bytes   (by value: the caller owns the ref)
    update_weights(WeightUpdate bytes, version) -> {"version", "seconds"}
    weight_group() / join_weight_group(...) / receive_weights(...) / commit_weights(group_id, version)
        -> the collective publication's steps (services/learner/collective.py)
    info() -> {"version", "model", "replica"}

HTTP (FastAPI; request and response schemas at /docs):
    POST /score   text form  {"question": str|[str], "memory": str, "history": [{"role", "content"}],
                              "answer": str|[str], "system": str (optional)}
                  token form {"mem_context_ids": [int], "full_context_ids": [int],
                              "continuation_ids": [int], "answer_span": [start, end]}
                  -> {"p_mem", "p_full", "r_mem", "mem_logprobs", "full_logprobs", "mem_keep",
                      "full_keep", "answer_ids", "answer_tokens", "policy_version", "tau", "filter_mode", "average",
                      "logp_floor"}
    GET|HEAD /health
Over the token budget (``scorer.max_request_tokens``, never more than the model's positions) or
the body size it implies -> 413; malformed or inconsistent input -> 422 naming the field (400 for
a body that is not JSON; services/common/http.py); a full queue, or no scoring slot within
``scorer.queue_timeout_s`` -> 503 with Retry-After (services/scorer/admission.py). The replica
keeps serving. Text fields are user text: ``<|im_end|>`` in them is ordinary text, not a control
token (services/common/model_io.py).

Weights swap atomically: scoring calls share the model and ``update_weights`` waits for them to
finish (and holds new ones back), so a request is scored wholly by one version, and every response
says which.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

import ray
import torch
from fastapi import FastAPI, Request
from ray import serve

from services.common.calls import require_version
from services.common.codec import decode, encode
from services.config import (MempoConfig, ScorerConfig, actor_options, fields_marked, replica_config,
                                    scorer_token_budget, updated_section)
from services.common.http import ERROR_RESPONSES, ErrorBody, document_body, install_error_handlers, parse_model, read_json
from services.common.http import HttpError as BadRequest
from services.common.rest_auth import configure_auth, install_auth
from services.common.messages import TrajectoryBatch, WeightUpdate
from services.common.model_io import model_dtype, validate_weights
from services.common.paths import model_path
from services.serve_version import pinned
from services.common.weight_broadcast import Receiver
from services.scorer.admission import Busy, Gate
from services.scorer.schema import ChatTurn, ScoreResponse, TextScoreRequest, TokenScoreRequest  # noqa: F401 (ChatTurn: /docs)

log = logging.getLogger("mempo.scorer")
app = FastAPI(title="mempo scorer", description="MemPO memory reward: how likely is the gold answer after "
                                                "the memory alone versus after the full history.")
install_error_handlers(app)
install_auth(app)  # 401 without the bearer token, when one is configured (ray.http_auth)


# before the class: @serve.ingress freezes a copy of the app
document_body(app, "/score", TextScoreRequest, TokenScoreRequest)


def _load_model(path: str, dtype: str, lora=None):
    """The policy's model; with ``lora`` (``learner.lora.publish: adapter``) peft's LoRA layers on it, zero
    until the first adapter arrives (the base policy), as the learner's."""
    # transformers, and the modules that import it, in the replica only: the driver imports this
    # module for deployment_options (`mempo plan`, the resource check)
    from transformers import AutoModelForCausalLM  # transformers

    model = AutoModelForCausalLM.from_pretrained(path, dtype=model_dtype(dtype), attn_implementation="sdpa")
    if lora is not None:
        from services.common.lora import add_adapters  # peft on use

        add_adapters(model, lora)
    return model.to("cuda" if torch.cuda.is_available() else "cpu").eval()


@serve.deployment(name="scorer")
@serve.ingress(app)
class ScorerService:
    def __init__(self, config: dict):
        from transformers import AutoTokenizer  # transformers in the replica only (see _load_model)

        from services.scorer.scorer import MemoryScorer  # transformers at its top

        self.cfg = MempoConfig.model_validate(config)
        configure_auth(self.cfg.ray)  # before the model loads: a missing token fails the start at once
        self.model_dir = str(model_path(self.cfg))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.lora = self.cfg.learner.lora if self.cfg.learner.lora.served_as_adapter else None
        self.scorer = MemoryScorer(_load_model(self.model_dir, self.cfg.model.dtype, self.lora), self.tokenizer,
                                   self.cfg)
        self.version = 0
        s = self.cfg.scorer
        self.gate = Gate(s.max_queued_requests, s.max_concurrent_requests, s.queue_timeout_s)
        self.positions = getattr(self.scorer.model.config, "max_position_embeddings", None)
        self.max_tokens = scorer_token_budget(self.cfg, self.positions)
        self.vocab = len(self.tokenizer)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.stats = {"score_calls": 0, "rest_calls": 0, "bad_requests": 0, "busy": 0}
        self.scoring_now = 0  # training-path calls being scored now
        self.receiver = Receiver()  # its end of the learner's weight group (learner.publish=collective)

    # -- training path ------------------------------------------------------------------------

    async def score(self, payload: bytes, min_version: int = -1) -> bytes:
        if not isinstance(min_version, int):
            raise TypeError(f"min_version must be an int, got {type(min_version).__name__}")
        batch = decode(payload, TrajectoryBatch)
        require_version(self.version, min_version, self.replica)  # a replacement not yet synced
        async with self.gate.shared():
            self.scoring_now += 1
            try:
                out = await asyncio.to_thread(self.scorer.score_trajectories, batch, self.version)
            finally:
                self.scoring_now -= 1
        self.stats["score_calls"] += 1
        return encode(out)

    async def update_weights(self, payload: bytes, version: Optional[int] = None) -> dict:
        update = decode(payload, WeightUpdate)
        if version is not None and version != update.version:
            raise ValueError(f"version {version} does not match the WeightUpdate's version {update.version}")
        return await self._load(update.tensors, update.version)

    async def _load(self, tensors: dict, version: int) -> dict:
        """Load the weights (or with ``learner.lora.publish: adapter`` the adapter tensors) as ``version``."""
        model = self.scorer.model
        if self.lora is not None:
            from services.common.lora import check_adapters, is_adapter  # peft on use

            check_adapters(tensors, {k: tuple(p.shape) for k, p in model.named_parameters() if is_adapter(k)}, self.lora)
        else:
            tied = model.config.tie_word_embeddings
            expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                        if not (tied and k == "lm_head.weight")}
            tensors = validate_weights(tensors, expected)
        t0 = time.perf_counter()
        async with self.gate.exclusive():  # no request is scored half with the old weights, half with the new
            model.load_state_dict(tensors, strict=False)
            self.version = version
        return {"version": version, "seconds": time.perf_counter() - t0, "replica": self.replica}

    # collective publication (services/learner/collective.py): join the learner's group, stage a whole
    # broadcast, then load it when the learner commits (every replica has it)
    def weight_group(self) -> Optional[str]:
        return self.receiver.group_id

    async def join_weight_group(self, host: str, port: int, world: int, group_id: str, timeout_s: float) -> int:
        return await asyncio.to_thread(self.receiver.join, host, port, world, group_id, timeout_s)

    async def receive_weights(self, group_id: str, version: int, plan: list, timeout_s: float) -> dict:
        out = await asyncio.to_thread(self.receiver.receive, group_id, version, plan, timeout_s)
        return {**out, "replica": self.replica}

    async def commit_weights(self, group_id: str, version: int) -> dict:
        if group_id != self.receiver.group_id:
            raise RuntimeError(f"commit of group {group_id}, this replica holds {self.receiver.group_id}")
        try:
            return await self._load(self.receiver.tensors(version), version)
        finally:
            self.receiver.drop()

    RUNTIME_FIELDS = fields_marked(ScorerConfig, "runtime")  # marked in services/scorer/settings.py

    async def reconfigure(self, user_config: dict) -> None:
        """Serve ``user_config``: change the scorer's runtime fields (``RUNTIME_FIELDS``; `mempo config
        --help-fields` marks them) on the running replicas (no restart)."""
        section = updated_section(self.cfg.scorer, user_config, self.RUNTIME_FIELDS)
        cfg = MempoConfig.model_validate({**self.cfg.model_dump(), "scorer": section.model_dump()})  # cross-field checks
        async with self.gate.exclusive():
            self.cfg = cfg
            self.scorer.cfg = section
            self.max_tokens = scorer_token_budget(cfg, self.positions)
            self.gate.configure(section.max_queued_requests, section.max_concurrent_requests, section.queue_timeout_s)
        log.info("scorer reconfigured: %s", user_config)

    def info(self) -> dict:
        return {"version": self.version, "model": self.model_dir, "replica": self.replica, **self.stats,
                "node_id": ray.get_runtime_context().get_node_id(),
                **self.gate.stats, "scoring_now": self.scoring_now, "pid": os.getpid()}

    # -- REST ---------------------------------------------------------------------------------

    def _check_ids(self, field: str, ids: list[int]) -> None:
        if not ids:
            raise BadRequest(422, field, "must not be empty")
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise BadRequest(422, f"{field}[{bad}]", f"unknown token id {ids[bad]} (vocabulary size {self.vocab})")

    def _text_request(self, req: TextScoreRequest):
        from services.scorer.scorer import text_contexts  # transformers at its top (see _load_model)

        questions = [req.question] if isinstance(req.question, str) else req.question
        answers = [req.answer] if isinstance(req.answer, str) else req.answer
        if not questions or not all(q.strip() for q in questions):
            raise BadRequest(422, "question", "must be a non-empty question or list of questions")
        if not answers or not all(a.strip() for a in answers):
            raise BadRequest(422, "answer", "must not be empty")
        system = req.system if req.system is not None else self.cfg.rollout.system_prompt
        try:
            mem_ctx, full_ctx = text_contexts(self.tokenizer, system, questions, req.memory,
                                              [t.model_dump() for t in req.history])
        except ValueError as e:
            raise BadRequest(422, "history", str(e)) from None
        try:
            cont = self.scorer.continuation([a.strip() for a in answers])
        except ValueError as e:
            raise BadRequest(422, "answer", str(e)) from None
        return mem_ctx, full_ctx, cont

    def _token_request(self, req: TokenScoreRequest):
        from services.scorer.continuation import Continuation  # transformers at its top (see _load_model)

        for name in ("mem_context_ids", "full_context_ids", "continuation_ids"):
            self._check_ids(name, getattr(req, name))
        s, e = req.answer_span
        if not 0 <= s < e <= len(req.continuation_ids):
            raise BadRequest(422, "answer_span", f"[{s}, {e}) is not a non-empty span of the "
                                                 f"{len(req.continuation_ids)}-token continuation")
        return req.mem_context_ids, req.full_context_ids, Continuation("", list(req.continuation_ids), s, e)

    async def _parse(self, request: Request):
        limit = 16 * self.max_tokens + 65536  # bytes: ids are at most ~8 chars each
        data = await read_json(request, limit)
        model = TextScoreRequest if "question" in data else TokenScoreRequest if "continuation_ids" in data else None
        if model is None:
            raise BadRequest(422, "body", "give the text form (question, memory, history, answer) or the token "
                                          "form (mem_context_ids, full_context_ids, continuation_ids, answer_span)")
        return await asyncio.to_thread(self._prepare, parse_model(model, data))  # tokenising is off the event loop

    def _prepare(self, req):
        mem_ctx, full_ctx, cont = self._text_request(req) if isinstance(req, TextScoreRequest) else self._token_request(req)
        total = len(mem_ctx) + len(full_ctx) + 2 * len(cont.ids)
        if total > self.max_tokens:
            raise BadRequest(413, "body", f"{total} tokens to score, over the limit of {self.max_tokens} "
                                          f"(scorer.max_request_tokens, at most the model's positions)")
        return mem_ctx, full_ctx, cont

    @app.post("/score", response_model=None, responses={200: {"model": ScoreResponse}, **ERROR_RESPONSES,
                                                        503: {"model": ErrorBody, "description": "Busy: retry after "
                                                              "the Retry-After header's seconds."}})
    async def score_rest(self, request: Request):
        """Grade a memory: P(answer | system + question + memory) vs P(answer | the full history)."""
        try:
            mem_ctx, full_ctx, cont = await self._parse(request)
            async with self.gate.rest():
                out = await asyncio.to_thread(self.scorer.score_pair, mem_ctx, full_ctx, cont)
                out["policy_version"] = self.version
        except BadRequest as e:
            self.stats["bad_requests"] += 1
            return e.response()
        except Busy as e:
            self.stats["busy"] += 1
            return BadRequest(503, "queue", e.reason, {"Retry-After": str(e.retry_after)}).response()
        self.stats["rest_calls"] += 1
        return out

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(self):
        return {"status": "ok", "policy_version": self.version, "model": self.model_dir,
                "device": str(next(self.scorer.model.parameters()).device), **self.stats}


def deployment_options(cfg: MempoConfig) -> dict:
    s = cfg.scorer
    # room for the REST queue plus training-path calls, so that the queue's 503 answers, not Serve's
    return {"num_replicas": s.replicas, "max_ongoing_requests": max(32, s.max_queued_requests + 16),
            "ray_actor_options": actor_options(s.num_cpus, s.num_gpus, s.resources)}


def scorer_app(cfg: MempoConfig):
    config = replica_config(cfg)
    return pinned(ScorerService.options(**deployment_options(cfg)), config, "scorer").bind(config)
