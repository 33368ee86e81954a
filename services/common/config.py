"""The one typed configuration tree of the mempo pipeline.

Every knob of every service is a pydantic field with a help string and, where MemPO's reference
implementation fixes a number (see docs/algorithm.md), that number as its default. A run's config
is a YAML file from ``deploy/configs/`` plus ``key.sub=value`` overrides from the command line:

    from services.common.config import load_config
    cfg = load_config("deploy/configs/tiny.yaml", ["rollout.n=4", "scorer.tau=-1.0"])

    python -m services.common.config deploy/configs/tiny.yaml rollout.n=4   # print the result
    python -m services.common.config --help-fields                          # every field, documented

Unknown keys and bad values fail at load time with :class:`ConfigError`, naming the field.
"""

from __future__ import annotations

import difflib
import math
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from services.common.turn_format import answer_continuation
from services.common.choices import MEM_CREDIT_SCOPES, MEM_CREDITS, MEM_POOLINGS, SCORED_ANSWERS
from services.common.memory_reward import AVERAGES, FILTERS  # the reward-rule registries (pure numpy)

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

def _group_of_two(n: int) -> int:
    if n < 2:  # services/learner/advantages.py: a group of one has std 0, so A_out = 0 for every episode
        raise ValueError("must be at least 2: GRPO normalises each reward within its prompt's group of rollout.n "
                         "episodes, and a group of one gives every episode an outcome advantage of 0 (nothing to "
                         "learn from)")
    return n


def _registered(rules: dict, what: str):
    """A validator accepting the names of one reward-rule registry (services/common/memory_reward.py)."""
    def check(value: str) -> str:
        if value not in rules:
            raise ValueError(f"{what} {value!r} is not one of {', '.join(rules)} (services/common/memory_reward.py)")
        return value
    return check


def _rule_names(rules: dict) -> str:
    return "; ".join(f"{r.name}: {r.description}" for r in rules.values())


DEFAULT_SYSTEM_PROMPT = (
    "You are a search agent. Answer the user's question(s) by searching a knowledge base. "
    "Every turn after the first starts with <mem> ... </mem>: a complete rewrite of everything "
    "worth keeping so far (facts found, what is still missing). Then reason inside "
    "<think> ... </think>. Then either search with <search> query </search> (results come back "
    "inside <information> ... </information>) or give the final answer with "
    "<answer> ... </answer>. When there are several questions separated by \"; \", answer all of "
    "them in order, separated by \"; \"."
)


PositiveInt = Annotated[int, Field(ge=1)]
BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


def _custom_resources(value: dict) -> dict:
    for name in value:
        if not name or name in BUILTIN_RESOURCES or name.startswith("node:"):
            raise ValueError(f"{name!r} is not a custom resource name (CPUs and GPUs have their own fields; "
                             f"'node:' names are Ray's own)")
    return value


CustomResources = Annotated[dict[str, Annotated[float, Field(ge=0)]], AfterValidator(_custom_resources)]


# "auto": derived from the model's chat template (services/common/chat_turns.py); for ChatML models
# (Qwen2.5, the embedded world) that is "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n".
DEFAULT_OBSERVATION_TEMPLATE = "auto"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the offending field(s)."""


# Field marks (json_schema_extra), read by fields_marked(): a RUNTIME field may change on running
# replicas (a Serve user_config, no restart); a RULE field is also runtime and defines the memory
# reward, so every score echoes it (the REST response, MemoryScoreBatch).
RUNTIME = {"runtime": True}
RULE = {"runtime": True, "rule": True}


def baseline(name: str, title: str, value: Any, default: bool = False) -> dict:
    """A field mark for a knob that exists to make a baseline: setting the field to ``value`` is the
    baseline ``name`` of `mempo compare` (services/pipeline/compare.py collects these marks into its
    VARIANTS registry), so a new knob and its baseline are one field here."""
    return {"baseline": {"name": name, "title": title, "value": value, "default": default}}


def field_baselines(root: type[BaseModel]) -> list[tuple[str, str, str, bool]]:
    """(name, title, "section.field=value", default) for every field of ``root``'s sections marked
    with baseline(), in declaration order."""
    out = []
    for section_name, section in root.model_fields.items():
        for name, f in getattr(section.annotation, "model_fields", {}).items():
            mark = f.json_schema_extra.get("baseline") if isinstance(f.json_schema_extra, dict) else None
            if mark:
                value = str(mark["value"]).lower() if isinstance(mark["value"], bool) else mark["value"]
                out.append((mark["name"], mark["title"], f"{section_name}.{name}={value}", mark["default"]))
    return out


def fields_marked(section: type[BaseModel], mark: str) -> tuple[str, ...]:
    """The names of a section's fields carrying ``mark`` ("runtime" or "rule"), in declaration order."""
    return tuple(n for n, f in section.model_fields.items() if isinstance(f.json_schema_extra, dict)
                 and f.json_schema_extra.get(mark))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


class WorldConfig(_Section):
    seed: int = Field(0, description="Seed of the synthetic world; same seed, same bytes.")
    dir: str = Field(".cache/world", description="Where the built world is cached (one subfolder per config hash).")
    num_countries: int = Field(12, ge=2, description="Fictional countries.")
    num_cities: int = Field(48, ge=2, description="Fictional cities, each in one country.")
    num_people: int = Field(160, ge=2, description="Fictional people, each born in a city and educated at a university.")
    num_universities: int = Field(24, ge=1, description="Fictional universities, each located in a city.")
    num_companies: int = Field(60, ge=1, description="Fictional companies, each founded by a person and based in a city.")
    distractors_per_entity: int = Field(1, ge=0, description="Distractor passages per entity (mention it without stating the asked fact).")
    train_questions: int = Field(10000, ge=1, description="Training prompts to generate.")
    test_questions: int = Field(200, ge=1, description="Held-out prompts per objective count k in test_objectives.")
    test_share: float = Field(0.25, gt=0.0, lt=1.0, description="Share of the entities questions ask about that are held out, with every question about them (train never names them).")
    train_objectives: list[PositiveInt] = Field([2], min_length=1, description="Objective counts k used in training prompts, cycled (the paper trains on k=2).")
    test_objectives: list[PositiveInt] = Field(list(range(2, 11)), min_length=1, description="Objective counts k of the held-out test sets (the paper evaluates k=2..10).")
    two_hop_share: float = Field(0.5, ge=0.0, le=1.0, description="Share of questions that need two hops.")
    oracle_trajectories: int = Field(10000, ge=0, description="Oracle (SFT cold-start) trajectories from training prompts (the paper distils ~10k).")
    oracle_max_turns: int = Field(16, ge=1, description="Turn limit of the oracle's SFT trajectories (the cold start's longest episodes). A world setting, not rollout.max_turns, so changing the agent's turn limit reuses the built world; the agent loop still stops at rollout.max_turns.")
    oracle_imperfect_share: float = Field(0.2, ge=0.0, le=1.0, description="Share of oracle trajectories with imperfect behaviour (sloppy memory, redundant search, early answer).")
    name_pool: int = Field(0, ge=0, description="Words per name inventory (given names, family names, company/university stems); names combine them, as real names reuse words. 0 = every name word is new (each entity's name is a token seen only with it).")
    tokenizer_vocab_size: int = Field(2048, ge=300, description="Vocabulary size of the world's byte-level BPE tokenizer (an upper bound: BPE stops when no pair repeats).")
    pretrain_tokens: int = Field(0, ge=0, description="Tokens of causal-LM pretraining of the tiny model on the world's passages and oracle transcripts, once per world, before SFT (0 = the random-init model). Builds the copy skill a real pretrained base has.")
    pretrain_seq_len: int = Field(512, ge=16, description="Pretraining block length (documents joined with <|endoftext|>, no padding).")
    pretrain_batch_tokens: int = Field(8192, ge=16, description="Tokens per pretraining step (blocks per step = this / pretrain_seq_len).")
    pretrain_lr: float = Field(3e-3, gt=0, description="Peak pretraining learning rate (AdamW, 5% warm-up, cosine to a tenth).")


class ModelConfig(_Section):
    path: str = Field("world", description="Policy model directory; 'world' means the embedded tiny model built by `mempo world`.")
    hidden_size: int = Field(128, ge=32, description="Tiny model: hidden size (num_attention_heads * head_dim).")
    num_layers: int = Field(2, ge=1, description="Tiny model: decoder layers.")
    num_attention_heads: int = Field(2, ge=1, description="Tiny model: attention heads.")
    num_key_value_heads: int = Field(1, ge=1, description="Tiny model: key/value heads (GQA).")
    head_dim: int = Field(64, description="Tiny model: head dim; vLLM's CPU attention needs one of 32, 64, 80, 96, 112, 128, ...")
    intermediate_size: int = Field(256, ge=1, description="Tiny model: MLP width.")
    max_position_embeddings: int = Field(4096, ge=128, description="Tiny model: longest sequence.")
    seed: int = Field(0, description="Seed of the tiny model's random init.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Compute dtype; auto = bf16 on GPU, fp32 on CPU.")


class EngineConfig(_Section):
    max_model_len: int = Field(4096, ge=64, description="vLLM max_model_len (context + generation).")
    gpu_memory_utilization: float = Field(0.6, gt=0.0, le=1.0, description="vLLM gpu_memory_utilization (GPU only).")
    enforce_eager: bool = Field(True, description="Disable CUDA graphs / torch.compile (fast start; required in tests).")
    seed: int = Field(0, description="vLLM engine seed.")
    cpu_kv_cache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU machines, GiB.")
    max_num_seqs: int = Field(64, ge=1, description="vLLM max_num_seqs: sequences batched per engine step.")
    cpu_threads: int = Field(0, ge=-1, description="CPU machines only: OpenMP threads of the vLLM worker, left unpinned so the replica shares the cores Ray gives it; 0 = the rollout replica's reserved CPUs (rollout.num_cpus) rounded down, at least 1; -1 = vLLM's own binding (one pinned thread per core of the machine). Ignored when VLLM_CPU_OMP_THREADS_BIND is set in the environment.")


class RolloutConfig(_Section):
    n: Annotated[int, AfterValidator(_group_of_two)] = Field(16, description="Rollouts per prompt (the GRPO group size, at least 2).")
    max_turns: int = Field(16, ge=1, description="Maximum assistant turns per episode.")
    memory_window: Union[PositiveInt, Literal["full"]] = Field(1, description="Turns of history the agent sees besides system+question: 1 = MemPO (previous turn only), w = last w turns, 'full' = whole history (Search-R1-like baseline).")
    max_response_tokens: int = Field(512, ge=1, description="Maximum generated tokens per turn.")
    max_context_tokens: int = Field(3584, ge=16, description="An episode ends when a turn's context would exceed this.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling top-p.")
    stop: list[str] = Field(["</search>", "</answer>"], description="Stop strings: nothing is generated after an action.")
    invalid_action: Literal["observe", "stop"] = Field("observe", description="A turn with no valid action: 'observe' returns an error observation and continues, 'stop' ends the episode.")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, description="System message of every prompt.")
    observation_template: str = Field(DEFAULT_OBSERVATION_TEMPLATE, description="Tokens appended after a search turn: closes the assistant message, adds the observation as a user message, opens the next assistant message. {observation} = the <information> block. 'auto' (default) = derived from the model's chat template (services/common/chat_turns.py); ChatML for Qwen2.5 and the embedded world.")
    invalid_action_message: str = Field("Invalid action: end the turn with <search> query </search> or <answer> answer </answer>.", description="Observation after a turn with no valid action (invalid_action=observe).")
    replicas: int = Field(1, ge=1, description="Rollout deployment replicas (one vLLM engine each).")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per rollout replica (Ray resource).")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per rollout replica (1 on GPU clusters).")
    resources: CustomResources = Field({}, description="Custom Ray resources per rollout replica (e.g. {rollout_node: 1}): only nodes started with them (ray start --resources) host it; `mempo plan` shows what a config needs.")
    max_concurrent_episodes: int = Field(64, ge=1, description="Episodes in flight per replica.")
    groups_per_call: int = Field(4, ge=1, description="Prompt groups per rollout call; the driver spreads calls over replicas.")
    call_retries: int = Field(2, ge=0, description="Driver retries of a rollout call whose replica failed.")
    search_app: str = Field("search", description="Serve application name of the search deployment the agent calls.")
    weights_dir: str = Field("/dev/shm/mempo-weights", description="RAM-backed folder where weight updates are staged for vLLM's in-place reload.")


class SearchConfig(_Section):
    backend: Literal["bm25", "dense"] = Field("bm25", description="Retrieval backend.")
    corpus: str = Field("world", description="JSONL corpus path (Search-R1 format); 'world' = the embedded world's corpus.")
    index_dir: str = Field("", description="Index directory; empty = the world's index, or '<corpus>.<backend>' next to another corpus (built on first use).")
    embedding_model: str = Field("", description="Dense backend: local directory of an e5-style encoder (mean pooling).")
    query_prefix: str = Field("query: ", description="Dense backend: prefix of every query (e5 convention).")
    passage_prefix: str = Field("passage: ", description="Dense backend: prefix of every passage when indexing (e5 convention).")
    topk: int = Field(3, ge=1, json_schema_extra=RUNTIME, description="Passages per search call (the agent's and the default of a request with topk null).")
    max_topk: int = Field(50, ge=1, json_schema_extra=RUNTIME, description="Largest topk a request may ask for.")
    max_queries: int = Field(512, ge=1, json_schema_extra=RUNTIME, description="Most queries in one request.")
    max_query_chars: int = Field(4096, ge=1, json_schema_extra=RUNTIME, description="Longest query, in characters; a longer one gets 413.")
    max_body_bytes: int = Field(1_000_000, ge=1024, json_schema_extra=RUNTIME, description="Larger HTTP request bodies get 413.")
    doc_format: str = Field("Doc {i} (Title: {title}) {text}", description="How one passage is shown to the agent inside <information>.")
    batching: bool = Field(True, description="Batch concurrent requests server-side into one index pass (Serve @serve.batch).")
    max_batch_size: int = Field(64, ge=1, json_schema_extra=RUNTIME, description="Most requests merged into one index pass.")
    batch_wait_timeout_s: float = Field(0.005, ge=0, json_schema_extra=RUNTIME, description="How long a batch waits to fill, seconds.")
    replicas: int = Field(1, ge=1, description="Search deployment replicas (fixed count; ignored when autoscaling).")
    autoscaling: bool = Field(False, description="Let Serve scale replicas between min_replicas and max_replicas.")
    min_replicas: int = Field(1, ge=0, description="Autoscaling: fewest replicas.")
    max_replicas: int = Field(4, ge=1, description="Autoscaling: most replicas.")
    target_ongoing_requests: float = Field(16.0, gt=0, description="Autoscaling: target in-flight requests per replica.")
    max_ongoing_requests: int = Field(256, ge=1, description="In-flight requests a replica accepts (Serve's default of 5 would cap batching).")
    num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per search replica.")
    resources: CustomResources = Field({}, description="Custom Ray resources per search replica (e.g. {head_node: 1}): only nodes started with them (ray start --resources) host it; `mempo plan` shows what a config needs.")
    timeout_s: float = Field(10.0, gt=0, description="Client timeout per search call, seconds.")
    retries: int = Field(2, ge=0, description="Client retries after a failed search call.")
    retry_backoff_s: float = Field(0.2, ge=0, description="Client backoff before retry i is backoff * 2**i seconds.")


class ScorerConfig(_Section):
    tau: float = Field(math.log(0.5), json_schema_extra=RULE, description="Keep an answer token if its log-prob exceeds tau (reference: log 0.5).")
    filter_mode: Annotated[str, AfterValidator(_registered(FILTERS, "filter mode"))] = Field("none", json_schema_extra=RULE, description="Which answer tokens count, a rule of services/common/memory_reward.py FILTERS: " + _rule_names(FILTERS) + ".")
    average: Annotated[str, AfterValidator(_registered(AVERAGES, "average"))] = Field("per_question", json_schema_extra=RULE, description="How the counted answer tokens become P, a rule of memory_reward.py AVERAGES: " + _rule_names(AVERAGES) + ".")
    scored_answers: Literal[SCORED_ANSWERS.names] = Field("all", json_schema_extra=baseline("mempo_shown", "MemPO, memory reward on the answers the history had shown", "shown"), description="Which questions' answers a rollout's <mem> block is scored on: 'all' (the reference), or 'shown': only those whose gold answer the episode's observations had shown before the block's turn (services/common/retention.py), so a memory is neither credited for writing down an answer it never saw nor charged for one it could not have; a block with none shown gets no memory score (no A_mem). The REST endpoint scores the answers it is sent.")
    logp_floor: float = Field(-5.0, lt=0, json_schema_extra=RULE, description="filter_mode floor: the lowest log-prob one answer token contributes.")
    answer_template: Annotated[str, AfterValidator(_answer_template)] = Field(DEFAULT_ANSWER_TEMPLATE, description="Assistant continuation scored after each context, {gold} standing for the gold answer; 'policy' (default) = the policy's own answering turn (services/common/turn_format.py), 'reference' = the reference's sentence, which the policy never writes.")
    gold_joiner: str = Field("; ", description="Joins the first gold answer of each question when k > 1.")
    mean_eps: float = Field(1e-8, gt=0, json_schema_extra=RUNTIME, description="Added to the kept-token count in P = exp(sum/count) (reference 1e-8).")
    token_budget: int = Field(2048, ge=64, json_schema_extra=RUNTIME, description="Most tokens in one packed scoring forward; attention with the dense tree mask costs budget^2, so smaller budgets trade repeated trunk tokens for cheaper attention.")
    max_request_tokens: int = Field(0, ge=0, json_schema_extra=RUNTIME, description="Token budget of one REST request (both contexts plus both answer continuations); over it gets 413. 0 = the model's positions (min of engine.max_model_len and, for the world model, model.max_position_embeddings); more than that is a config error.")
    max_queued_requests: int = Field(16, ge=1, json_schema_extra=RUNTIME, description="REST requests a replica holds at once (scoring or waiting); one more gets 503 with Retry-After.")
    max_concurrent_requests: int = Field(2, ge=1, json_schema_extra=RUNTIME, description="REST requests a replica scores at the same time, so a short one runs beside a long one instead of queueing behind it.")
    queue_timeout_s: float = Field(5.0, gt=0, json_schema_extra=RUNTIME, description="A REST request that waited this long for a scoring slot (or for a weight update to finish) gets 503 with Retry-After.")
    replicas: int = Field(1, ge=1, description="Scorer deployment replicas.")
    num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per scorer replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per scorer replica (1 on GPU clusters).")
    resources: CustomResources = Field({}, description="Custom Ray resources per scorer replica (e.g. {scorer_node: 1}): only nodes started with them (ray start --resources) host it; `mempo plan` shows what a config needs.")
    call_retries: int = Field(2, ge=0, description="Driver retries of a scoring call whose replica failed.")


class AlgorithmConfig(_Section):
    grpo_eps: float = Field(1e-6, gt=0, description="A_out = (R - mean) / (std + grpo_eps).")
    mem_eps: float = Field(1e-6, gt=0, description="A_mem = (R_mem - mean) / (std + mem_eps).")
    mem_pooling: Literal[MEM_POOLINGS.names] = Field("prompt", description="Which memory rewards one <mem> block is normalised against: every block of the prompt's group (prompt, reference), those of the same turn number (prompt_turn), or those written after the same tool responses (prompt_seen: the same passages shown, order ignored).")
    mem_credit: Literal[MEM_CREDITS.names] = Field("difference", description="What a <mem> block's R_mem credits before pooling: 'difference' = P_mem - P_full (reference; a memory can score above the full history, also by writing down an answer it never saw), 'loss_only' = min(P_mem - P_full, 0): a memory is charged for what it lost against the full history and never credited beyond it.")
    mem_credit_scope: Literal[MEM_CREDIT_SCOPES.names] = Field("block", description="Where a <mem> block's memory advantage lands: 'block' (reference) = A_mem of the block's R_mem on every token of the block; 'question' = each question's section of the memory (Q<i>: ...) gets alpha * A_mem of that question's own R_mem, pooled over the blocks that score it (a section the memory lacks: its A_mem lands on the whole block; tokens outside every section get none), so credit for one question's answer does not spread to the lines written about another.")
    mem_alpha: float = Field(1.0, description="Weight of A_mem added on <mem> tokens (reference 1).")
    mem_std_floor: float = Field(0.0, ge=0, description="A_mem = (R_mem - mean) / (max(std, mem_std_floor) + mem_eps): a pool whose memory rewards differ by less than the floor gets proportionally small advantages instead of unit-scale noise (0 = the reference's plain normalisation; R_mem lies in [-1, 1]).")
    outcome_on_mem: bool = Field(True, json_schema_extra=baseline("mem_only", "MemPO, memory tokens trained by the memory reward alone", False), description="False: the <mem> tokens get no outcome advantage, only alpha * A_mem (the memory is trained by the memory reward alone).")
    use_memory_reward: bool = Field(True, description="False gives MEM1-like GRPO on the memory context (no A_mem).")
    answer_separator: str = Field(";", description="Splits a multi-objective answer into per-question answers.")


class LearnerConfig(_Section):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear lr warmup steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    clip_eps_low: float = Field(0.2, ge=0, description="PPO ratio clip, lower side.")
    clip_eps_high: float = Field(0.2, ge=0, description="PPO ratio clip, upper side.")
    dual_clip_c: float = Field(3.0, gt=1.0, description="Dual-clip constant for negative advantages.")
    kl_coef: float = Field(0.001, ge=0, description="Weight of the KL-to-reference loss term.")
    behaviour_is: Literal["stale", "all", "off"] = Field("stale", description="Off-policy correction (decoupled PPO): weight tokens by the truncated importance ratio pi_old / pi_behaviour. stale = only tokens sampled by an older version (a synchronous run is unchanged); all = every token (also corrects the vLLM/learner numeric mismatch, as verl's TIS); off = none.")
    is_cap: float = Field(2.0, ge=1.0, description="Truncation of the behaviour importance weight (verl's rollout_is_threshold).")
    kl_type: Literal["low_var_kl", "k1", "k2"] = Field("low_var_kl", description="KL estimator.")
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = Field("seq-mean-token-mean", description="Loss aggregation (paper: seq-mean-token-mean).")
    micro_token_budget: int = Field(8192, ge=64, description="Tokens per micro-batch (gradient accumulation over micro-batches).")
    logit_chunk_tokens: int = Field(1024, ge=1, description="Positions whose vocabulary logits are held at once "
                                    "(log-probs computed chunk by chunk, each recomputed in the backward).")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in the "
                                           "backward, keeping only its input. SmolLM2-135M on CPU at 4,096 tokens: "
                                           "peak 10.7 -> 5.5 GB, a step ~12% slower (bench/learner_memory.py).")
    world_size: int = Field(1, ge=1, description="FSDP workers (one per GPU or CPU slot).")
    num_cpus_per_worker: float = Field(1.0, ge=0, description="CPUs reserved per FSDP worker actor.")
    resources: CustomResources = Field({}, description="Custom Ray resources per FSDP worker actor, the learner's Serve replica asks 0.001 of each, to run beside them (so give the node the workers' total plus a little, e.g. {learner_node: 1} with the node started with learner_node=100): only nodes started with them (ray start --resources) host the learner; `mempo plan` shows what a config needs.")
    threads: int = Field(0, ge=0, description="CPU only: torch threads per worker; 0 = its reserved CPUs (at least 1). The loop is synchronous, so the learner may use cores the idle rollout reserved.")
    publish_to: list[str] = Field(["rollout:rollout", "scorer:scorer"], description="Deployments that receive each new policy, as 'app:deployment'.")
    publish: Literal["object_store", "collective", "auto"] = Field("object_store", description="How each new policy reaches the replicas: object_store = one msgpack state dict in Ray's object store, each replica reloads it (rollout: through a RAM-backed safetensors file); collective = a gloo group of the learner and every replica, the weights broadcast in 64 MiB chunks and loaded in place, a failed broadcast (a replica dead or unreachable, bounded wait) falls back to object_store for that publication and the group is rebuilt next time; auto = collective, and object_store from then on when no group forms 3 times in a row (services/learner/collective.py).")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto = nccl on GPU, gloo on CPU.")
    checkpoint_every: int = Field(50, ge=1, description="Sharded checkpoint every N steps.")
    resume: Literal["auto", "never"] = Field("auto", description="auto = resume from the latest complete checkpoint.")
    sft_lr: float = Field(1e-5, gt=0, description="Learning rate of the SFT cold start.")


class TrainConfig(_Section):
    steps: int = Field(200, ge=0, description="RL steps.")
    data: str = Field("world", description="Training prompts (verl/Search-R1 parquet); 'world' = the embedded world's train.parquet.")
    init_from_sft: bool = Field(True, description="Start RL from the SFT policy (train.sft_dir, written by `mempo sft`) instead of model.path.")
    sft_dir: str = Field("", description="Where `mempo sft` writes the cold-start policy and RL reads it; empty = <run_dir>/sft/model. `mempo compare` points every variant at one.")
    prompts_per_step: int = Field(128, ge=1, description="Prompts per step (reference 128; each gets rollout.n rollouts).")
    sft_epochs: int = Field(1, ge=0, description="Epochs over the oracle trajectories in the SFT cold start.")
    sft_lr_schedule: Literal["constant", "cosine"] = Field("constant", description="SFT learning rate: constant learner.sft_lr, or 5% warm-up then cosine decay to a tenth of it.")
    sft_steps: int = Field(0, ge=0, description="SFT steps; 0 = train.sft_epochs passes over the turns. A cap that keeps the cold start inside a time budget when the oracle writes many trajectories.")
    sft_data: str = Field("world", description="SFT trajectories: JSONL rows with 'messages' (a finished transcript) and 'em'; 'world' = the world's oracle.jsonl.")
    sft_min_em: float = Field(1.0, ge=0.0, le=1.0, description="Keep only SFT trajectories whose answer scored at least this EM (rejection sampling).")
    sft_batch_size: int = Field(32, ge=1, description="Turns (context, response samples) per SFT step.")
    sft_checkpoint_every: int = Field(0, ge=0, description="SFT checkpoint every N steps in <run_dir>/sft/checkpoints (0 = every 5% of the steps); an interrupted `mempo sft` run again with the same settings resumes from the latest, and the checkpoints are removed once the policy is exported.")
    sft_name_swap: float = Field(0.0, ge=0.0, le=1.0, description="Share of SFT transcripts whose people, companies and universities are renamed, consistently through the transcript, to fresh combinations of the world's name words, so the policy must copy names rather than recall them (services/world/name_swap.py). Needs the embedded world's SFT data.")
    eval_every: int = Field(10, ge=0, description="Evaluate on eval.during_training_per_k held-out prompts per k at the start, every N steps and at the last step; 0 = no evaluation during training (`mempo compare` sets 0 unless given: its final evaluation is the comparison).")
    max_staleness: int = Field(0, ge=0, description="How many policy versions a training batch's rollouts may lag the learner: 0 = synchronous (rollout, scoring, update, publish, in turn); s > 0 = the rollout of the next s steps runs while the learner trains, and the loss corrects for the lag (learner.behaviour_is).")
    seed: int = Field(0, description="Seed of data order and sampling.")
    sample_groups: int = Field(2, ge=0, description="Training groups per step saved to <run_dir>/groups.jsonl for `mempo view` (every episode of a prompt, decoded, with rewards, advantages and memory scores); 0 = none.")
    run_dir: str = Field("runs/default", description="Where checkpoints, logs and reports go.")


class EvalConfig(_Section):
    data: str = Field("world", description="Held-out prompts (parquet with extra_info.k); 'world' = the world's test.parquet.")
    objectives: list[PositiveInt] = Field([], description="Objective counts k to evaluate; empty = world.test_objectives.")
    questions_per_k: int = Field(100, ge=1, description="Held-out prompts per k in `mempo eval` and the final report.")
    during_training_per_k: int = Field(16, ge=1, description="Held-out prompts per k in the periodic eval during training.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of evaluation rollouts (0 = greedy).")
    memory_reward: bool = Field(True, description="Also score the eval episodes' <mem> blocks (mean R_mem, P_mem, P_full).")


class RayConfig(_Section):
    address: str = Field("", description="Ray address; empty starts a local cluster.")
    num_cpus: int = Field(0, ge=0, description="CPUs of a local cluster; 0 = all.")
    object_store_memory: int = Field(1_000_000_000, ge=78_643_200, description="Object store bytes of a local cluster.")
    http_host: str = Field("127.0.0.1", description="Serve HTTP host.")
    http_port: int = Field(8000, ge=1, le=65535, description="Serve HTTP port.")
    proxy_location: Literal["EveryNode", "HeadOnly", "Disabled"] = Field("EveryNode", description="Where Serve runs its HTTP proxies: every node with a replica (clients may hit any node), the head only, or none (in-cluster handles only). Several nodes on one machine share an address, so only HeadOnly can hold the port there.")
    replica_wait_s: float = Field(0.0, ge=0, description="How long a call waits for a replacement replica that Serve is starting and that fits a live node (a lost node's replica re-placed on a survivor) before the step fails; 0 = 600 s plus 60 s per GiB of the model's weights (a cold vLLM start on a loaded machine). A replacement that fits no live node fails the call at once.")
    autoscaler: bool = Field(False, description="The cluster adds nodes on demand (KubeRay, the cluster launcher): a replacement replica that fits no live node is waited for, up to ray.replica_wait_s, instead of failing the call at once.")
    call_timeout_s: float = Field(1800.0, ge=0, description="Longest one training call (a rollout call, a scoring call, the learner's wait for their results) may take before the step fails with an error naming it (a node lost with no replacement, an object no copy of which survived); 0 = no limit.")
    app_prefix: str = Field("", description="Prefix of the pipeline's Serve application names (search, rollout, scorer, learner), so two pipelines can share a cluster; a non-empty prefix also sets rollout.search_app and learner.publish_to to match.")


class MempoConfig(_Section):
    """Root of the config tree: one section per concern."""

    world: WorldConfig = Field(default_factory=WorldConfig, description="The embedded synthetic world.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model (and the tiny model's shape).")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM engine arguments.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="The agent loop.")
    search: SearchConfig = Field(default_factory=SearchConfig, description="Retrieval service.")
    scorer: ScorerConfig = Field(default_factory=ScorerConfig, description="Memory reward scoring.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Rewards and advantages.")
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="Policy update and FSDP.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="The training loop.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Held-out evaluation.")
    ray: RayConfig = Field(default_factory=RayConfig, description="Ray cluster and Serve.")

    @model_validator(mode="after")
    def _scorer_budget_fits_the_model(self) -> "MempoConfig":
        positions = model_positions(self)
        if self.scorer.max_request_tokens > positions:
            raise ValueError(f"scorer.max_request_tokens: {self.scorer.max_request_tokens} exceeds the model's "
                             f"{positions} positions (engine.max_model_len, model.max_position_embeddings)")
        return self

    @model_validator(mode="after")
    def _budgets_and_groups_fit(self) -> "MempoConfig":
        r = self.rollout
        if r.max_context_tokens + r.max_response_tokens > self.engine.max_model_len:
            raise ValueError(f"rollout.max_response_tokens: rollout.max_context_tokens ({r.max_context_tokens}) + rollout.max_response_tokens "
                             f"({r.max_response_tokens}) exceeds engine.max_model_len ({self.engine.max_model_len}): "
                             f"a turn near the context limit would get a cut response budget; lower one or raise "
                             f"the engine length")
        return self


def model_positions(cfg: MempoConfig, loaded: int | None = None) -> int:
    """Longest sequence the policy can take: engine.max_model_len, the world model's
    model.max_position_embeddings, and ``loaded`` (a loaded model's own), whichever is least."""
    caps = [cfg.engine.max_model_len] + ([cfg.model.max_position_embeddings] if cfg.model.path == "world" else [])
    return min(caps + ([loaded] if loaded else []))


def scorer_token_budget(cfg: MempoConfig, loaded_positions: int | None = None) -> int:
    """Tokens one REST scoring request may take: scorer.max_request_tokens (0 = the model's positions),
    never more than the model's positions."""
    positions = model_positions(cfg, loaded_positions)
    return min(cfg.scorer.max_request_tokens or positions, positions)


# Where a check lives: one field's own rule is its validator (it holds wherever the section is built,
# MempoConfig or the section alone, and pydantic names the field); a rule over several fields sits on
# the lowest model holding them all (the root for fields of two sections) and starts its message with
# the field to change, "section.field: why", which becomes that error's location.
_NAMED = re.compile(r"([a-z_]+(?:\.[a-z_]+)+): (.*)", re.S)


def _format_errors(err: ValidationError) -> str:
    """One line per offending field; union alternatives of one field are merged into its line."""
    by_field: dict[str, list[str]] = {}
    for e in err.errors():
        # pydantic adds the tried union member ("constrained-int", "literal['full']") to the path
        loc = ".".join(str(p) for p in e["loc"] if isinstance(p, int) or str(p).isidentifier())
        if e["type"] == "extra_forbidden":
            msg = f"unknown key{_suggest(loc)}"
        elif e["type"] == "value_error" and (named := _NAMED.match(e["msg"].removeprefix("Value error, "))):
            # a cross-field check (on the root, so its location is empty): "section.field: why"
            loc, msg = ".".join(p for p in (loc, named[1]) if p), named[2]
        elif not e["loc"]:
            loc, msg = "config", e["msg"].removeprefix("Value error, ")
        else:
            msg = f"{e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})"
        if msg not in by_field.setdefault(loc, []):
            by_field[loc].append(msg)
    lines = [f"{loc}: {' | '.join(msgs)}" for loc, msgs in by_field.items()]
    return "invalid config:\n  " + "\n  ".join(lines)


def _field_paths(model: type[BaseModel] = MempoConfig, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        path = f"{prefix}{name}"
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_field_paths(ann, path + "."))
        else:
            out.append(path)
    return out


def _suggest(key: str) -> str:
    # compare like with like: a misspelt section against section names, a leaf against leaf paths
    candidates = [p for p in _field_paths() + list(MempoConfig.model_fields) if p.count(".") == key.count(".")]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"rollout.n=8"`` -> (["rollout", "n"], 8). Values are parsed as YAML scalars/lists."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: value {raw!r} is not valid YAML: {e}") from None
    return key.split("."), value


def _apply(tree: dict, path: list[str], value: Any) -> None:
    model: type[BaseModel] = MempoConfig
    node = tree
    for i, part in enumerate(path):
        dotted = ".".join(path[: i + 1])
        if part not in model.model_fields:
            raise ConfigError(f"{dotted}: unknown key{_suggest(dotted)}")
        ann = model.model_fields[part].annotation
        if i == len(path) - 1:
            node[part] = value
        else:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                raise ConfigError(f"{dotted}: is a value, not a section")
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{dotted}: expected a section")
            model = ann


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MempoConfig:
    """Load a YAML config (or the defaults if ``path`` is None) and apply ``key=value`` overrides."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections")
        tree = loaded
    for ov in overrides:
        keys, value = parse_override(ov)
        _apply(tree, keys, value)
    try:
        return MempoConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def updated_section(section: BaseModel, changes: dict, allowed: tuple[str, ...]) -> BaseModel:
    """A validated copy of a config section with ``changes`` applied (a Serve deployment's
    ``user_config``); keys outside ``allowed`` (the fields safe to change at runtime) fail."""
    bad = sorted(set(changes or {}) - set(allowed))
    if bad:
        raise ConfigError(f"user_config: {bad} cannot change at runtime; allowed: {', '.join(allowed)}")
    try:
        return type(section).model_validate({**section.model_dump(), **(changes or {})})
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


# Replica counts are Serve deployment options, and the loop's length and eval cadence only concern
# the driver: leaving them out of the config replicas are built with makes "more rollout replicas"
# or "train for longer" a lightweight Serve update (running replicas stay) instead of a redeploy.
_DRIVER_ONLY_FIELDS = {"rollout": {"replicas"}, "scorer": {"replicas", "call_retries"},
                       "search": {"replicas", "autoscaling", "min_replicas", "max_replicas", "target_ongoing_requests"},
                       "train": {"steps", "eval_every", "max_staleness", "prompts_per_step"}, "eval": True}


def replica_config(cfg: MempoConfig) -> dict:
    """The config dict a deployment's replicas are constructed with (driver-only fields left out)."""
    return cfg.model_dump(mode="json", exclude=_DRIVER_ONLY_FIELDS)


def learner_worker_gpus(cfg: "MempoConfig") -> float:
    """GPUs per learner FSDP worker: one wherever the policy runs on GPUs (the rollout or scorer use them, or
    learner.backend is nccl), else none. Read from the config, not from ``torch.cuda.is_available()``: the
    learner group is built inside the learner's Serve replica, which asks Ray for no GPU and may see none."""
    return 1.0 if cfg.rollout.num_gpus or cfg.scorer.num_gpus or cfg.learner.backend == "nccl" else 0.0


def actor_options(num_cpus: float, num_gpus: float = 0.0, resources: dict | None = None) -> dict:
    """Ray actor options of a replica or worker: CPUs, GPUs and, where a config names them, custom
    resources (left out when empty, so a config without placement deploys as before)."""
    out = {"num_cpus": num_cpus, "num_gpus": num_gpus}
    if resources:
        out["resources"] = dict(resources)
    return out


def to_yaml(cfg: MempoConfig) -> str:
    """The full resolved config as YAML (every field, defaults included)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def describe_fields(model: type[BaseModel] = MempoConfig, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help) for every leaf field of the tree."""
    rows = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
        else:
            runtime = isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("runtime")
            rows.append((f"{prefix}{name}", f.get_default(call_default_factory=True),
                         (f.description or "") + (" [runtime: a Serve user_config changes it on running replicas]"
                                                  if runtime else "")))
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv and argv[0] == "--help-fields":
        for key, default, help_ in describe_fields():
            print(f"{key} = {default!r}\n    {help_}")
        return 0
    path = argv.pop(0) if argv and "=" not in argv[0] else None
    try:
        print(to_yaml(load_config(path, argv)), end="")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
