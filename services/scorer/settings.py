"""The ``scorer`` config section: the memory reward's scoring rule (tau, filters, averages, the
answer continuation) and the REST endpoint's limits. Composed into the config tree by
services/config.py.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from services.common.config_fields import RULE, RUNTIME, CustomResources, Section, baseline
from services.algorithm.memory_reward import AVERAGES, FILTERS, SCORED_ANSWERS  # the reward-rule registries (pure numpy)
from services.common.turn_format import answer_continuation

# Besides its own section: the policy and engine it scores with, the rollout's system prompt (the REST
# default), the world (a path still named 'world'), ray (call timeouts), the learner's LoRA settings (its
# adapters applied with learner.lora.publish=adapter).
READS = ("model", "engine", "rollout.system_prompt", "world", "ray", "learner.lora")

# The answer continuation appended to both the memory and the full context when scoring a <mem>
# block (docs/algorithm.md, section 4). ``{gold}`` is replaced by the gold answer(s). The default is the
# policy's own answering turn, written by services/common/turn_format.py (the oracle's SFT data uses the
# same code); the reference's sentence, which the policy never writes, stays selectable by name.
REFERENCE_ANSWER_TEMPLATE = (
    "\n<think>\nI have sufficient information to provide the final answers.\n</think>\n"
    "<answer> {gold} </answer>"
)
DEFAULT_ANSWER_TEMPLATE = answer_continuation()
ANSWER_TEMPLATES = {"policy": DEFAULT_ANSWER_TEMPLATE, "reference": REFERENCE_ANSWER_TEMPLATE}


def _answer_template(value: str) -> str:
    value = ANSWER_TEMPLATES.get(value, value)
    if value.count("{gold}") != 1:
        raise ValueError(f"must be {' or '.join(ANSWER_TEMPLATES)}, or a template with {{gold}} exactly once")
    return value

def _registered(rules: dict, what: str):
    """A validator accepting the names of one reward-rule registry (services/algorithm/memory_reward.py)."""
    def check(value: str) -> str:
        if value not in rules:
            raise ValueError(f"{what} {value!r} is not one of {', '.join(rules)} (services/algorithm/memory_reward.py)")
        return value
    return check


def _rule_names(rules: dict) -> str:
    return "; ".join(f"{r.name}: {r.description}" for r in rules.values())


class ScorerConfig(Section):
    tau: float = Field(
        math.log(0.5), json_schema_extra=RULE,
        description="Keep an answer token if its log-prob exceeds tau (reference: log 0.5).",
    )
    filter_mode: Annotated[str, AfterValidator(_registered(FILTERS, "filter mode"))] = Field(
        "none", json_schema_extra=RULE,
        description=(
            "Which answer tokens count, a rule of services/algorithm/memory_reward.py FILTERS: "
            + _rule_names(FILTERS)
            + "."
        ),
    )
    average: Annotated[str, AfterValidator(_registered(AVERAGES, "average"))] = Field(
        "per_question", json_schema_extra=RULE,
        description=(
            "How the counted answer tokens become P, a rule of memory_reward.py AVERAGES: "
            + _rule_names(AVERAGES)
            + "."
        ),
    )
    scored_answers: Literal[SCORED_ANSWERS.names] = Field(
        "all",
        json_schema_extra=baseline("mempo_shown", "MemPO, memory reward on the answers the history had shown", "shown"),
        description=(
            "Which questions' answers a rollout's <mem> block is scored on: 'all' (the reference), or 'shown': "
            "only those whose gold answer the episode's observations had shown before the block's turn "
            "(services/algorithm/retention.py), so a memory is neither credited for writing down an answer it never "
            "saw nor charged for one it could not have; a block with none shown gets no memory score (no A_mem). "
            "The REST endpoint scores the answers it is sent."
        ),
    )
    logp_floor: float = Field(
        -5.0, lt=0, json_schema_extra=RULE,
        description="filter_mode floor: the lowest log-prob one answer token contributes.",
    )
    answer_template: Annotated[str, AfterValidator(_answer_template)] = Field(
        DEFAULT_ANSWER_TEMPLATE,
        description=(
            "Assistant continuation scored after each context, {gold} standing for the gold answer; 'policy' "
            "(default) = the policy's own answering turn (services/common/turn_format.py), 'reference' = the "
            "reference's sentence, which the policy never writes."
        ),
    )
    gold_joiner: str = Field(
        "; ",
        description="Joins the first gold answer of each question when k > 1.",
    )
    mean_eps: float = Field(
        1e-8, gt=0, json_schema_extra=RUNTIME,
        description="Added to the kept-token count in P = exp(sum/count) (reference 1e-8).",
    )
    token_budget: int = Field(
        2048, ge=64, json_schema_extra=RUNTIME,
        description=(
            "Most tokens in one packed scoring forward; attention with the dense tree mask costs budget^2, so "
            "smaller budgets trade repeated trunk tokens for cheaper attention."
        ),
    )
    max_request_tokens: int = Field(
        0, ge=0, json_schema_extra=RUNTIME,
        description=(
            "Token budget of one REST request (both contexts plus both answer continuations); over it gets 413. 0 "
            "= the model's positions (min of engine.max_model_len and, for the world model, "
            "model.max_position_embeddings); more than that is a config error."
        ),
    )
    max_queued_requests: int = Field(
        16, ge=1, json_schema_extra=RUNTIME,
        description=(
            "REST requests a replica holds at once (scoring or waiting); one more gets 503 with Retry-After."
        ),
    )
    max_concurrent_requests: int = Field(
        2, ge=1, json_schema_extra=RUNTIME,
        description=(
            "REST requests a replica scores at the same time, so a short one runs beside a long one instead of "
            "queueing behind it."
        ),
    )
    queue_timeout_s: float = Field(
        5.0, gt=0, json_schema_extra=RUNTIME,
        description=(
            "A REST request that waited this long for a scoring slot (or for a weight update to finish) gets 503 "
            "with Retry-After."
        ),
    )
    replicas: int = Field(
        1, ge=1,
        description="Scorer deployment replicas.",
    )
    num_cpus: float = Field(
        1.0, ge=0,
        description="CPUs reserved per scorer replica.",
    )
    num_gpus: float = Field(
        0.0, ge=0,
        description="GPUs per scorer replica (1 on GPU clusters).",
    )
    resources: CustomResources = Field(
        {},
        description=(
            "Custom Ray resources per scorer replica (e.g. {scorer_node: 1}): only nodes started with them (ray "
            "start --resources) host it; `mempo plan` shows what a config needs."
        ),
    )
    call_retries: int = Field(
        2, ge=0,
        description="Driver retries of a scoring call whose replica failed.",
    )
