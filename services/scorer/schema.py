"""The scorer's REST request and response models: the one definition the service validates with and
the client (services/scorer/client.py, ``mempo score``) sends and reads, so the two cannot drift.
Pydantic only: a client imports this without torch, Ray or FastAPI.

    TextScoreRequest.model_validate({"question": ..., "memory": ..., "history": [...], "answer": ...})
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr


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
    """Score token ids: the continuation after each context; the answer is ``continuation_ids[start:end]``."""

    model_config = ConfigDict(extra="forbid")
    mem_context_ids: list[StrictInt]
    full_context_ids: list[StrictInt]
    continuation_ids: list[StrictInt]
    answer_span: tuple[StrictInt, StrictInt]


class ScoreResponse(BaseModel):
    """The memory reward of one request (docs/algorithm.md, section 4), scored by one policy version."""

    p_mem: float
    p_full: float
    r_mem: float = Field(description="p_mem - p_full")
    mem_logprobs: list[float]
    full_logprobs: list[float]
    mem_keep: list[bool]
    full_keep: list[bool]
    answer_ids: list[int]
    answer_tokens: list[str]
    policy_version: int
    tau: float  # tau .. logp_floor: the reward's rule (ScorerConfig's RULE fields; a test keeps them equal)
    filter_mode: str
    average: str
    logp_floor: float
