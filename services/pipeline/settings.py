"""The ``train`` and ``eval`` config sections: the training loop (steps, data, the SFT cold start,
evaluation cadence, staleness, the run folder) and held-out evaluation. Only the driver reads them.
Composed into the config tree by services/config.py.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from services.common.config_fields import PositiveInt, Section


class TrainConfig(Section):
    steps: int = Field(
        200, ge=0,
        description="RL steps.",
    )
    data: str = Field(
        "world",
        description=(
            "Training prompts: Search-R1/verl parquet as published, or JSONL (docs/data.md); 'world' = the "
            "embedded world's train.parquet. Every prompt gets rollout.system_prompt and the row's question(s)."
        ),
    )
    init_from_sft: bool = Field(
        True,
        description="Start RL from the SFT policy (train.sft_dir, written by `mempo sft`) instead of model.path.",
    )
    sft_dir: str = Field(
        "",
        description=(
            "Where `mempo sft` writes the cold-start policy and RL reads it; empty = <run_dir>/sft/model. `mempo "
            "compare` points every variant at one."
        ),
    )
    prompts_per_step: int = Field(
        128, ge=1,
        description="Prompts per step (reference 128; each gets rollout.n rollouts).",
    )
    sft_epochs: int = Field(
        1, ge=0,
        description="Epochs over the oracle trajectories in the SFT cold start.",
    )
    sft_lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="SFT learning rate: constant learner.sft_lr, or 5% warm-up then cosine decay to a tenth of it.",
    )
    sft_steps: int = Field(
        0, ge=0,
        description=(
            "SFT steps; 0 = train.sft_epochs passes over the turns. A cap that keeps the cold start inside a time "
            "budget when the oracle writes many trajectories."
        ),
    )
    sft_data: str = Field(
        "world",
        description=(
            "SFT transcripts: JSONL rows with 'messages' (OpenAI/TRL chat format, a system message optional and "
            "replaced by rollout.system_prompt) or ShareGPT 'conversations', and optionally 'em' (docs/data.md); "
            "'world' = the world's oracle.jsonl."
        ),
    )
    sft_min_em: float = Field(
        1.0, ge=0.0, le=1.0,
        description="Keep only SFT trajectories whose answer scored at least this EM (rejection sampling).",
    )
    sft_batch_size: int = Field(
        32, ge=1,
        description="Turns (context, response samples) per SFT step.",
    )
    sft_checkpoint_every: int = Field(
        0, ge=0,
        description=(
            "SFT checkpoint every N steps in <run_dir>/sft/checkpoints (0 = every 5% of the steps); an interrupted "
            "`mempo sft` run again with the same settings resumes from the latest, and the checkpoints are removed "
            "once the policy is exported."
        ),
    )
    sft_name_swap: float = Field(
        0.0, ge=0.0, le=1.0,
        description=(
            "Share of SFT transcripts whose people, companies and universities are renamed, consistently through "
            "the transcript, to fresh combinations of the world's name words, so the policy must copy names rather "
            "than recall them (services/world/name_swap.py). Needs the embedded world's SFT data."
        ),
    )
    eval_every: int = Field(
        10, ge=0,
        description=(
            "Evaluate on eval.during_training_per_k held-out prompts per k at the start, every N steps and at the "
            "last step; 0 = no evaluation during training (`mempo compare` sets 0 unless given: its final "
            "evaluation is the comparison)."
        ),
    )
    max_staleness: int = Field(
        0, ge=0,
        description=(
            "How many policy versions a training batch's rollouts may lag the learner: 0 = synchronous (rollout, "
            "scoring, update, publish, in turn); s > 0 = the rollout of the next s steps runs while the learner "
            "trains, and the loss corrects for the lag (learner.behaviour_is)."
        ),
    )
    over_sampling: float = Field(
        1.0, ge=1.0,
        description=(
            "Over-sampling with a buffer: keep ceil(prompts_per_step x over_sampling) prompt groups in flight, one "
            "rollout call each, and train each step on the first prompts_per_step that complete; the others keep "
            "running turn by turn under whatever policy the replicas hold as they go (partial rollouts) and enter a "
            "later step, unless they started more than max_staleness versions before the learner that would train "
            "them (dropped, counted as oversample/dropped_groups). 1 = off: a step's groups start together and all "
            "are trained. Needs max_staleness >= 1; step s draws its prompts from positions [s*T, (s+1)*T) of the "
            "seeded prompt order (T = the groups in flight), so a resumed run never draws a position again and "
            "the buffer of a stopped run is dropped. Not deterministic: which groups finish first depends on timing."
        ),
    )
    pause_rollout: bool = Field(
        False,
        description=(
            "With max_staleness >= 1 (and over_sampling): the rollout replicas start no new turn while the "
            "learner updates and publishes (turns already generating finish), so rollout and learner take turns "
            "on shared cores instead of slowing each other down; groups in flight continue afterwards under the "
            "new policy (partial rollouts as APRIL's). For machines where the stages share CPUs; on separate "
            "devices leave it off."
        ),
    )
    seed: int = Field(
        0,
        description="Seed of data order and sampling.",
    )
    sample_groups: int = Field(
        2, ge=0,
        description=(
            "Training groups per step saved to <run_dir>/groups.jsonl for `mempo view` (every episode of a prompt, "
            "decoded, with rewards, advantages and memory scores); 0 = none."
        ),
    )
    run_dir: str = Field(
        "runs/default",
        description="Where checkpoints, logs and reports go.",
    )
    loggers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        ["tensorboard"],
        description=(
            "Where metrics go besides <run_dir>/metrics.jsonl, for sft, train, eval and compare: TensorBoard "
            "(<run_dir>/tb), Weights & Biases (pip install wandb), MLflow (pip install mlflow-skinny). W&B and MLflow "
            "get the resolved config as parameters, every metrics row at its step, and the reports as artifacts; "
            "a resumed run goes on in the same tracked run (its id in <run_dir>/trackers.json)."
        ),
    )
    wandb_project: str = Field(
        "mempo",
        description="W&B project of the runs (train.loggers has wandb).",
    )
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description=(
            "W&B mode: auto = online when a W&B key is set (WANDB_API_KEY or `wandb login`), offline otherwise "
            "(files under <run_dir>/wandb; `wandb sync` uploads them later)."
        ),
    )
    mlflow_tracking_uri: str = Field(
        "",
        description=(
            "MLflow tracking URI (an MLflow server, http(s)://...; or file:DIR); empty = a file store in "
            "<run_dir>/mlruns (read with `mlflow ui --backend-store-uri <run_dir>/mlruns` or MlflowClient)."
        ),
    )
    mlflow_experiment: str = Field(
        "mempo",
        description="MLflow experiment the runs are logged under.",
    )

    @model_validator(mode="after")
    def _over_sampling_needs_staleness(self) -> "TrainConfig":
        if self.over_sampling > 1.0 and self.max_staleness < 1:
            raise ValueError(f"train.over_sampling: {self.over_sampling} keeps groups running across updates, so their "
                             "later turns come from newer policies than their first: set train.max_staleness >= 1 (how "
                             "many versions a trained group may lag), or over_sampling=1")
        return self

    @property
    def groups_in_flight(self) -> int:
        """T: the prompt groups over-sampling keeps in flight (prompts_per_step when it is off)."""
        return max(self.prompts_per_step, math.ceil(self.prompts_per_step * self.over_sampling - 1e-9))


class EvalConfig(Section):
    data: str = Field(
        "world",
        description="Held-out prompts, in train.data's formats (docs/data.md); 'world' = the world's test.parquet.",
    )
    objectives: list[PositiveInt] = Field(
        [],
        description="Objective counts k to evaluate; empty = every k present in eval.data.",
    )
    questions_per_k: int = Field(
        100, ge=1,
        description="Held-out prompts per k in `mempo eval` and the final report.",
    )
    during_training_per_k: int = Field(
        16, ge=1,
        description="Held-out prompts per k in the periodic eval during training.",
    )
    temperature: float = Field(
        0.0, ge=0.0,
        description="Sampling temperature of evaluation rollouts (0 = greedy).",
    )
    memory_reward: bool = Field(
        True,
        description="Also score the eval episodes' <mem> blocks (mean R_mem, P_mem, P_full).",
    )
