"""The ``algorithm`` and ``learner`` config sections: rewards and advantages (GRPO, the memory
reward's credit and pooling), and the policy update (PPO clip, KL, FSDP, checkpoints, weight
publication). Composed into the config tree by services/config.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.algorithm.outcome import OUTCOME_ADVANTAGES  # the outcome-advantage rules (pure numpy)
from services.algorithm.memory_advantage import MEM_CREDIT_SCOPES, MEM_CREDITS, MEM_POOLINGS  # the memory-advantage rules (pure numpy)
from services.common.config_fields import CustomResources, Section, baseline

# The learner reads the whole config (it builds every sample, loss and report), so any change restarts it.
READS = None


class AlgorithmConfig(Section):
    shuffled_rewards: bool = Field(
        False,
        description=(
            "A null control for experiments, never for training a policy: each group's outcome rewards, and "
            "each memory pool's rewards, are permuted among their members (seeded by the step, the group and its "
            "prompt) before normalisation, so an update keeps the real one's size, token structure and advantage "
            "values but carries no signal about which episode or memory did better. Logged rewards stay the "
            "real ones."
        ),
    )
    outcome_advantage: Literal[OUTCOME_ADVANTAGES.names] = Field(
        "grpo",
        description="How a group's outcome rewards become each episode's A_out, a rule of "
                    "services/algorithm/outcome.py: " + "; ".join(f"{r.name}: {r.description}"
                                                                 for r in OUTCOME_ADVANTAGES.values()) + ".",
    )
    grpo_eps: float = Field(
        1e-6, gt=0,
        description="A_out = (R - mean) / (std + grpo_eps) (outcome_advantage=grpo).",
    )
    mem_eps: float = Field(
        1e-6, gt=0,
        description="A_mem = (R_mem - mean) / (std + mem_eps).",
    )
    mem_pooling: Literal[MEM_POOLINGS.names] = Field(
        "prompt",
        description=(
            "Which memory rewards one <mem> block is normalised against: every block of the prompt's group "
            "(prompt, reference), those of the same turn number (prompt_turn), or those written after the same "
            "tool responses (prompt_seen: the same passages shown, order ignored)."
        ),
    )
    mem_credit: Literal[MEM_CREDITS.names] = Field(
        "difference",
        description=(
            "What a <mem> block's R_mem credits before pooling: 'difference' = P_mem - P_full (reference; a memory "
            "can score above the full history, also by writing down an answer it never saw), 'loss_only' = "
            "min(P_mem - P_full, 0): a memory is charged for what it lost against the full history and never "
            "credited beyond it."
        ),
    )
    mem_credit_scope: Literal[MEM_CREDIT_SCOPES.names] = Field(
        "block",
        description=(
            "Where a <mem> block's memory advantage lands: 'block' (reference) = A_mem of the block's R_mem on "
            "every token of the block; 'question' = each question's section of the memory (Q<i>: ...) gets alpha * "
            "A_mem of that question's own R_mem, pooled over the blocks that score it (a section the memory lacks: "
            "its A_mem lands on the whole block; tokens outside every section get none), so credit for one "
            "question's answer does not spread to the lines written about another."
        ),
    )
    mem_alpha: float = Field(
        1.0,
        description="Weight of A_mem added on <mem> tokens (reference 1).",
    )
    mem_std_floor: float = Field(
        0.0, ge=0,
        description=(
            "A_mem = (R_mem - mean) / (max(std, mem_std_floor) + mem_eps): a pool whose memory rewards differ by "
            "less than the floor gets proportionally small advantages instead of unit-scale noise (0 = the "
            "reference's plain normalisation; R_mem lies in [-1, 1])."
        ),
    )
    outcome_on_mem: bool = Field(
        True, json_schema_extra=baseline("mem_only", "MemPO, memory tokens trained by the memory reward alone", False),
        description=(
            "False: the <mem> tokens get no outcome advantage, only alpha * A_mem (the memory is trained by the "
            "memory reward alone)."
        ),
    )
    use_memory_reward: bool = Field(
        True,
        description="False gives MEM1-like GRPO on the memory context (no A_mem).",
    )
    answer_separator: str = Field(
        ";",
        description="Splits a multi-objective answer into per-question answers.",
    )


class LoraConfig(Section):
    rank: int = Field(
        0, ge=0,
        description=(
            "LoRA rank r: 0 = train every parameter (the default); r > 0 = train peft LoRA adapters of rank r on "
            "learner.lora.target_modules and freeze the base. The reference policy of the KL term is then the "
            "base with the adapters switched off (no second copy), the optimizer holds the adapters only, and "
            "checkpoints hold the adapters and their optimizer state (the base is model.path). Dropout is 0, so "
            "the learner's log-probs are the served policy's."
        ),
    )
    alpha: float = Field(
        32.0, gt=0,
        description="LoRA alpha: the adapters' update is scaled by alpha / rank (peft's lora_alpha).",
    )
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear",
        description=(
            "Which modules get adapters: 'all-linear' (every linear layer but the output head, peft's rule), or "
            "a list of module names (e.g. [q_proj, v_proj]; each must name a linear layer of the model)."
        ),
    )
    publish: Literal["merged", "adapter"] = Field(
        "merged",
        description=(
            "How a LoRA policy reaches the rollout and scorer replicas: merged = the adapters folded into the base "
            "weights on rank 0 (W + alpha / rank * B A) and published as a full state dict, as without LoRA; "
            "adapter = the adapter tensors only (megabytes), by the object store: the rollout engine serves them "
            "with vLLM's LoRA support (each policy version a new adapter, the previous one dropped; its "
            "max_lora_rank from learner.lora.rank) and the scorer applies them with peft's layers. The replicas "
            "start from the base (model.path) and keep it; an adapter costs extra compute per token in every "
            "forward pass (bench/README.md measures both)."
        ),
    )


    @property
    def served_as_adapter(self) -> bool:
        """Whether the replicas serve the policy as base + adapter (rank > 0 and publish: adapter)."""
        return self.rank > 0 and self.publish == "adapter"


class LearnerConfig(Section):
    lora: LoraConfig = Field(
        default_factory=LoraConfig,
        description="LoRA adapters instead of full fine-tuning (learner.lora.rank > 0).",
    )
    lr: float = Field(
        1e-6, gt=0,
        description="AdamW learning rate.",
    )
    noise_scale: bool = Field(
        False,
        description=(
            "Measure each RL step's gradient noise scale over its prompt groups (services/learner/noise_scale.py; "
            "metrics noise/trace, noise/signal_sq, noise/groups; the run's B_simple in the report): micro-batches "
            "then never mix groups (a few more of them) and each rank keeps one copy of its gradient shard. "
            "The update itself is the same."
        ),
    )
    warmup_steps: int = Field(
        0, ge=0,
        description="Linear lr warmup steps.",
    )
    weight_decay: float = Field(
        0.01, ge=0,
        description="AdamW weight decay.",
    )
    grad_clip: float = Field(
        1.0, gt=0,
        description="Max global gradient norm.",
    )
    clip_eps_low: float = Field(
        0.2, ge=0,
        description="PPO ratio clip, lower side.",
    )
    clip_eps_high: float = Field(
        0.2, ge=0,
        description="PPO ratio clip, upper side.",
    )
    dual_clip_c: float = Field(
        3.0, gt=1.0,
        description="Dual-clip constant for negative advantages.",
    )
    kl_coef: float = Field(
        0.001, ge=0,
        description="Weight of the KL-to-reference loss term.",
    )
    behaviour_is: Literal["stale", "all", "mask", "off"] = Field(
        "stale",
        description=(
            "Off-policy correction (decoupled PPO): weight tokens by the truncated importance ratio pi_old / "
            "pi_behaviour. stale = only tokens sampled by an older version (a synchronous run is unchanged); all = "
            "every token (also corrects the vLLM/learner numeric mismatch, as verl's TIS); mask = no weights, "
            "tokens sampled by an older version are left out of the loss (slime's masking of off-policy "
            "tokens); off = none."
        ),
    )
    is_cap: float = Field(
        2.0, ge=1.0,
        description="Truncation of the behaviour importance weight (verl's rollout_is_threshold).",
    )
    tempered_logprobs: bool = Field(
        True,
        description=(
            "Divide the policy's (and the reference's) logits by rollout.temperature before the log-probs, entropy "
            "and KL of a training step, as verl's actor does: the gradient is then that of the distribution the "
            "tokens were sampled from, and the rollout asks vLLM for the same tempered log-probs "
            "(logprobs_mode=processed_logprobs; with rollout.top_p < 1 vLLM's are over the nucleus, the learner's "
            "over the whole vocabulary, as verl's). False: log-probs at temperature 1 whatever rollout.temperature "
            "sampled at (the learner's earlier behaviour). SFT and the scorer are unaffected."
        ),
    )
    kl_type: Literal["low_var_kl", "k1", "k2"] = Field(
        "low_var_kl",
        description="KL estimator.",
    )
    loss_agg: Literal["seq-mean-token-mean", "token-mean"] = Field(
        "seq-mean-token-mean",
        description="Loss aggregation (paper: seq-mean-token-mean).",
    )
    micro_token_budget: int = Field(
        8192, ge=64,
        description="Tokens per micro-batch (gradient accumulation over micro-batches).",
    )
    logit_chunk_tokens: int = Field(
        1024, ge=1,
        description=(
            "Positions whose vocabulary logits are held at once (log-probs computed chunk by chunk, each "
            "recomputed in the backward)."
        ),
    )
    activation_checkpointing: bool = Field(
        False,
        description=(
            "Recompute each decoder layer's activations in the backward, keeping only its input: about half the "
            "learner's peak memory for a slightly slower step (figures: bench/learner_memory.py, bench/README.md)."
        ),
    )
    world_size: int = Field(
        1, ge=1,
        description="FSDP workers (one per GPU or CPU slot).",
    )
    num_cpus_per_worker: float = Field(
        1.0, ge=0,
        description="CPUs reserved per FSDP worker actor.",
    )
    resources: CustomResources = Field(
        {},
        description=(
            "Custom Ray resources per FSDP worker actor, the learner's Serve replica asks 0.001 of each, to run "
            "beside them (so give the node the workers' total plus a little, e.g. {learner_node: 1} with the node "
            "started with learner_node=100): only nodes started with them (ray start --resources) host the "
            "learner; `mempo plan` shows what a config needs."
        ),
    )
    threads: int = Field(
        0, ge=0,
        description=(
            "CPU only: torch threads per worker; 0 = its reserved CPUs (at least 1). The loop is synchronous, so "
            "the learner may use cores the idle rollout reserved."
        ),
    )
    cpu_mmap_threshold_mib: int = Field(
        0, ge=0,
        description=(
            "CPU only: fix glibc's mmap threshold of each learner rank at this many MiB, so every freed tensor above "
            "it goes back to the system at once: a lower resident peak (most with LoRA, whose smaller states glibc's "
            "kept heap otherwise fills) for slower steps (each large tensor is fresh pages). 0 = glibc's default, a "
            "threshold that rises to 32 MiB, after which freed activations stay in the heap (bench/learner_memory.py "
            "measures both)."
        ),
    )
    publish_to: list[str] = Field(
        ["rollout:rollout", "scorer:scorer"],
        description="Deployments that receive each new policy, as 'app:deployment'.",
    )
    publish: Literal["object_store", "collective", "auto"] = Field(
        "auto",
        description=(
            "How each new policy reaches the replicas: object_store = one msgpack state dict in Ray's object "
            "store, each replica reloads it (rollout: through a RAM-backed safetensors file); collective = a gloo "
            "group of the learner and every replica, the weights broadcast in 64 MiB chunks and loaded in place, a "
            "failed broadcast (a replica dead or unreachable, bounded wait) falls back to object_store for that "
            "publication and the group is rebuilt next time; auto = collective for a state dict of at least "
            "learner.collective_min_mb, object_store below it, and object_store from then on when no group forms 3 "
            "times in a row (services/learner/collective.py)."
        ),
    )
    collective_min_mb: float = Field(
        16.0, ge=0,
        description=(
            "learner.publish=auto: the smallest state dict (MB, 1e6 bytes) published by the collective; a smaller "
            "one goes by the object store, which is faster for a few MB (the collective's fixed cost per "
            "publication) and slower for hundreds; the crossing point is measured by bench/publish.py "
            "(bench/README.md)."
        ),
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend; auto = nccl on GPU, gloo on CPU.",
    )
    checkpoint_every: int = Field(
        50, ge=1,
        description="Sharded checkpoint every N steps.",
    )
    resume: Literal["auto", "never"] = Field(
        "auto",
        description="auto = resume from the latest complete checkpoint.",
    )
    fault_grace_s: float = Field(
        60.0, gt=0,
        description=(
            "When one rank's call on the worker group fails, how long the group waits for the other ranks' "
            "answers before judging it: a rank found dead within this time makes the failure a rank fault "
            "(whichever rank's error came first: a survivor's collective error while a peer is dead is the same "
            "fault), and the group is rebuilt from the latest checkpoint; otherwise the error is raised as it is. "
            "Long enough for Ray to report a dead process, or a lost node's, as dead."
        ),
    )
    sft_lr: float = Field(
        1e-5, gt=0,
        description="Learning rate of the SFT cold start.",
    )
