"""Every message that crosses a service boundary in mempo, as typed dataclasses.

Flow of one training step (see docs/architecture.md):

    driver --PromptBatch--> rollout --TrajectoryBatch--> scorer --MemoryScoreBatch--> learner
    learner --TrainingBatch (internal, to its FSDP workers)--> learner --WeightUpdate--> rollout, scorer
    rollout, scorer --``metrics`` dicts inside their batches--> learner --step result--> driver

Token data is kept as token ids and positions (docs/algorithm.md, section 3), never as re-tokenised text:

* ``Episode.prompt_ids`` is the chat-template encoding of [system, user] plus the assistant
  generation prompt, captured at turn 1 (the reference's ``mem_sys_prompt_ids``).
* ``Episode.full_ids`` is the uncompressed history: prompt, then every turn's response ids and
  observation ids. The *full context* of turn t is ``full_ids[:turn.full_prefix_len]``.
* The *mem context* of turn t is ``prompt_ids + turn.response_ids[mem_start:mem_end]``.
* ``TurnRecord.context_ids`` is what the policy actually saw when it generated the turn (memory
  window applied), so the learner trains each turn under its own context.

Encode with ``services.common.codec.encode`` / ``decode``; how each message moves through Ray is
in docs/architecture.md (``services.common.transport`` wraps put/get; tests use it). Bump
``codec.SCHEMA_VERSION`` when a field changes meaning.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import torch

from services.common.codec import array_field, message

Scalar = Union[int, float, str, bool]


@message
class ChatMessage:
    role: str
    content: str


@message
class Prompt:
    """One task: a chat prompt with k >= 1 questions and the gold answers of each."""

    uid: str
    messages: list[ChatMessage]
    # golds[q] = acceptable answers of question q (k = len(golds) objectives)
    golds: list[list[str]]
    data_source: str = "mempo_world"
    extra: dict[str, Scalar] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.extra is None:
            self.extra = {}


@message
class PromptBatch:
    """Driver -> rollout: prompts to roll out, each ``n`` times, with the policy version expected."""

    prompts: list[Prompt]
    n: int
    policy_version: int
    step: int = 0
    seed: int = 0
    temperature: float = -1.0  # sampling temperature of this batch; < 0 = the rollout config's
    search: bool = True  # False = every search returns an empty observation (the eval's no-retrieval control)
    min_version: int = -1  # a replica holding an older policy refuses the call (StaleReplica); -1 = any


@message
class TurnRecord:
    """One assistant turn of one episode (docs/algorithm.md, section 3). Spans index ``response_ids``;
    ``turn`` counts from 1 (turn 1 has no history, hence no <mem>)."""

    turn: int
    context_ids: np.ndarray = array_field("int32")
    response_ids: np.ndarray = array_field("int32")
    response_logprobs: np.ndarray = array_field("float32")  # sampling log-probs, one per response id
    mem_start: int = -1  # [mem_start, mem_end) covers "<mem>...</mem>"; -1 = no (complete) block
    mem_end: int = -1
    action: str = "invalid"  # "search" | "answer" | "invalid" (no valid action: see rollout/parser.py)
    action_text: str = ""  # the search query or the answer
    action_start: int = -1  # [action_start, action_end) covers "<search>...</search>" or "<answer>...</answer>"
    action_end: int = -1
    format_ok: bool = True  # the turn follows the grammar (rollout/parser.py)
    problems: list[str] = None  # type: ignore[assignment]  # what the parser found wrong
    observation_ids: np.ndarray = array_field("int32", default_factory=lambda: np.zeros(0, np.int32))
    full_prefix_len: int = 0  # full context of this turn = Episode.full_ids[:full_prefix_len]
    policy_version: int = 0
    finish_reason: str = ""  # engine finish reason: "stop" | "length" | ...

    def __post_init__(self):
        if self.problems is None:
            self.problems = []


@message
class Episode:
    """One rollout: every turn of one agent run on one prompt."""

    uid: str  # f"{prompt uid}/{sample index}"
    sample: int
    prompt_ids: np.ndarray = array_field("int32")
    full_ids: np.ndarray = array_field("int32")
    turns: list[TurnRecord] = None  # type: ignore[assignment]
    answer: Optional[str] = None  # text of the last <answer>, None if it never answered
    finish_reason: str = ""  # "answer" | "max_turns" | "max_context" | "invalid_action"
    tool_calls: int = 0
    tool_failures: int = 0
    peak_tokens: int = 0  # PT: the largest single-turn context + response
    total_tokens: int = 0  # TT: all context + generated tokens processed over the episode

    def __post_init__(self):
        if self.turns is None:
            self.turns = []


@message
class RolloutGroup:
    """All n rollouts of one prompt (one GRPO group)."""

    prompt: Prompt
    episodes: list[Episode]


@message
class TrajectoryBatch:
    """Rollout -> scorer/learner: the groups produced for one PromptBatch."""

    groups: list[RolloutGroup]
    policy_version: int  # version at the start of the call (each turn records its own)
    step: int = 0
    metrics: dict[str, float] = None  # type: ignore[assignment]
    replica: str = ""  # which rollout replica produced it

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = {}


@message
class MemoryScore:
    """The memory reward of one <mem> block (docs/algorithm.md, section 4)."""

    group: int  # index into TrajectoryBatch.groups
    episode: int  # index into RolloutGroup.episodes
    turn: int  # index into Episode.turns
    answer_ids: np.ndarray = array_field("int32")  # the scored continuation's answer tokens
    full_logp: np.ndarray = array_field("float32")
    mem_logp: np.ndarray = array_field("float32")
    full_keep: np.ndarray = array_field("bool")
    mem_keep: np.ndarray = array_field("bool")
    p_full: float = 0.0
    p_mem: float = 0.0
    r_mem: float = 0.0
    # 1: the memory's text holds every gold answer the episode's observations had shown; 0: it lost one;
    # -1: none shown yet (services/algorithm/retention.py: a label-free check, never a training signal)
    retained: int = -1
    # per question of the prompt (k entries; empty when the scorer had no tokenizer to read sections):
    # that question's own R_mem under the same rule (NaN where it is not scored), and the token range
    # [start, end) of its ``Q<i>:`` section in the turn's response_ids (-1, -1 where the memory has none)
    question_r_mem: np.ndarray = array_field("float32", default_factory=lambda: np.zeros(0, np.float32))
    question_spans: np.ndarray = array_field("int32", ndim=2, default_factory=lambda: np.zeros((0, 2), np.int32))


@message
class MemoryScoreBatch:
    """Scorer -> learner: every block's score, and how it was computed."""

    scores: list[MemoryScore]
    policy_version: int
    tau: float  # tau .. logp_floor: the reward's rule (the scorer config's RULE fields), echoed
    filter_mode: str
    average: str = "geometric"
    logp_floor: float = -5.0
    step: int = 0
    metrics: dict[str, float] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.metrics is None:
            self.metrics = {}


@message
class TrainingBatch:
    """Learner-internal (driver -> FSDP workers): packed (context, response) samples.

    Sample i occupies ``input_ids[cu_seqlens[i]:cu_seqlens[i+1]]``; the per-token arrays align
    with ``input_ids`` and are zero outside generated tokens (``loss_mask`` = 1 on them).
    """

    input_ids: np.ndarray = array_field("int32")
    cu_seqlens: np.ndarray = array_field("int64")
    loss_mask: np.ndarray = array_field("bool")
    advantages: np.ndarray = array_field("float32")
    rollout_logprobs: np.ndarray = array_field("float32")
    mem_mask: np.ndarray = array_field("bool")
    group_ids: np.ndarray = array_field("int32")  # per sample: which prompt group
    policy_version: int = 0  # the learner's pre-update version
    step: int = 0
    # per sample: the policy version that sampled it (empty = every sample at ``policy_version``);
    # policy_version - sample_versions[i] is sample i's staleness, which the loss corrects for
    sample_versions: np.ndarray = array_field("int32", default_factory=lambda: np.zeros(0, np.int32))


@message
class WeightUpdate:
    """Learner -> rollout and scorer replicas: a full policy state dict and its version."""

    version: int
    tensors: dict[str, torch.Tensor]
    step: int = 0


@message
class Metrics:
    """Named numbers of one stage for one step. No service sends it today: metrics travel as the
    ``metrics`` dicts of TrajectoryBatch / MemoryScoreBatch and the learner's step result."""

    stage: str
    step: int
    values: dict[str, float]
    wall_time: float = 0.0
