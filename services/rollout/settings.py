"""The ``rollout`` config section: the agent loop (group size, turn and token limits, sampling, the
system prompt and turn grammar, replicas). Composed into the config tree by services/config.py.

``READS`` names the other sections the rollout's replicas read; with the section this package
declares, it is the rollout's entry of the section map (services/config.py).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, Field

from services.common.config_fields import CustomResources, PositiveInt, Section

# Besides its own section: the policy and engine it runs, the search section (the client's topk,
# timeouts and passage format), the world (a path still named 'world'), ray (call timeouts), and whether the
# learner tempers its log-probs (the engine then returns tempered ones too), and its LoRA settings (served
# as an adapter with learner.lora.publish=adapter).
READS = ("model", "engine", "search", "world", "ray", "learner.tempered_logprobs", "learner.lora")

DEFAULT_SYSTEM_PROMPT = (
    "You are a search agent. Answer the user's question(s) by searching a knowledge base. "
    "Every turn after the first starts with <mem> ... </mem>: a complete rewrite of everything "
    "worth keeping so far (facts found, what is still missing). Then reason inside "
    "<think> ... </think>. Then either search with <search> query </search> (results come back "
    "inside <information> ... </information>) or give the final answer with "
    "<answer> ... </answer>. When there are several questions separated by \"; \", answer all of "
    "them in order, separated by \"; \"."
)

# "auto": derived from the model's chat template (services/common/chat_turns.py); for ChatML models
# (Qwen2.5, the embedded world) that is
# "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n".
DEFAULT_OBSERVATION_TEMPLATE = "auto"


def _group_of_two(n: int) -> int:
    if n < 2:  # services/algorithm/advantages.py: a group of one has std 0, so A_out = 0 for every episode
        raise ValueError("must be at least 2: GRPO normalises each reward within its prompt's group of rollout.n "
                         "episodes, and a group of one gives every episode an outcome advantage of 0 (nothing to "
                         "learn from)")
    return n


class RolloutConfig(Section):
    n: Annotated[int, AfterValidator(_group_of_two)] = Field(
        16,
        description="Rollouts per prompt (the GRPO group size, at least 2).",
    )
    max_turns: int = Field(
        16, ge=1,
        description="Maximum assistant turns per episode.",
    )
    memory_window: Union[PositiveInt, Literal["full"]] = Field(
        1,
        description=(
            "Turns of history the agent sees besides system+question: 1 = MemPO (previous turn only), w = last w "
            "turns, 'full' = whole history (Search-R1-like baseline)."
        ),
    )
    max_response_tokens: int = Field(
        512, ge=1,
        description="Maximum generated tokens per turn.",
    )
    max_context_tokens: int = Field(
        3584, ge=16,
        description="An episode ends when a turn's context would exceed this.",
    )
    temperature: float = Field(
        1.0, ge=0.0,
        description="Sampling temperature.",
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Nucleus sampling top-p.",
    )
    stop: list[str] = Field(
        ["</search>", "</answer>"],
        description="Stop strings: nothing is generated after an action.",
    )
    invalid_action: Literal["observe", "stop"] = Field(
        "observe",
        description=(
            "A turn with no valid action: 'observe' returns an error observation and continues, 'stop' ends the "
            "episode."
        ),
    )
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT,
        description="System message of every prompt.",
    )
    observation_template: str = Field(
        DEFAULT_OBSERVATION_TEMPLATE,
        description=(
            "Tokens appended after a search turn: closes the assistant message, adds the observation as a user "
            "message, opens the next assistant message. {observation} = the <information> block. 'auto' (default) "
            "= derived from the model's chat template (services/common/chat_turns.py); ChatML for Qwen2.5 and the "
            "embedded world."
        ),
    )
    invalid_action_message: str = Field(
        "Invalid action: end the turn with <search> query </search> or <answer> answer </answer>.",
        description="Observation after a turn with no valid action (invalid_action=observe).",
    )
    replicas: int = Field(
        1, ge=1,
        description="Rollout deployment replicas (one vLLM engine each).",
    )
    num_cpus: float = Field(
        1.0, ge=0,
        description="CPUs reserved per rollout replica (Ray resource).",
    )
    num_gpus: float = Field(
        0.0, ge=0,
        description="GPUs per rollout replica (1 on GPU clusters).",
    )
    resources: CustomResources = Field(
        {},
        description=(
            "Custom Ray resources per rollout replica (e.g. {rollout_node: 1}): only nodes started with them (ray "
            "start --resources) host it; `mempo plan` shows what a config needs."
        ),
    )
    max_concurrent_episodes: int = Field(
        64, ge=1,
        description="Episodes in flight per replica.",
    )
    groups_per_call: int = Field(
        4, ge=1,
        description="Prompt groups per rollout call; the driver spreads calls over replicas.",
    )
    call_retries: int = Field(
        2, ge=0,
        description="Driver retries of a rollout call whose replica failed.",
    )
    search_app: str = Field(
        "search",
        description="Serve application name of the search deployment the agent calls.",
    )
    weights_dir: str = Field(
        "/dev/shm/mempo-weights",
        description="RAM-backed folder where weight updates are staged for vLLM's in-place reload.",
    )
