"""The ``world`` config section: the embedded synthetic world (entities, corpus, questions, oracle,
tokenizer, tiny model) that `mempo world` builds. Composed into the config tree by
services/config.py; every field's help is printed by ``mempo config --help-fields``.
"""

from __future__ import annotations

from pydantic import Field

from services.common.config_fields import PositiveInt, Section


class WorldConfig(Section):
    seed: int = Field(
        0,
        description="Seed of the synthetic world; same seed, same bytes.",
    )
    dir: str = Field(
        ".cache/world",
        description="Where the built world is cached (one subfolder per config hash).",
    )
    num_countries: int = Field(
        12, ge=2,
        description="Fictional countries.",
    )
    num_cities: int = Field(
        48, ge=2,
        description="Fictional cities, each in one country.",
    )
    num_people: int = Field(
        160, ge=2,
        description="Fictional people, each born in a city and educated at a university.",
    )
    num_universities: int = Field(
        24, ge=1,
        description="Fictional universities, each located in a city.",
    )
    num_companies: int = Field(
        60, ge=1,
        description="Fictional companies, each founded by a person and based in a city.",
    )
    distractors_per_entity: int = Field(
        1, ge=0,
        description="Distractor passages per entity (mention it without stating the asked fact).",
    )
    train_questions: int = Field(
        10000, ge=1,
        description="Training prompts to generate.",
    )
    test_questions: int = Field(
        200, ge=1,
        description="Held-out prompts per objective count k in test_objectives.",
    )
    test_share: float = Field(
        0.25, gt=0.0, lt=1.0,
        description=(
            "Share of the entities questions ask about that are held out, with every question about them (train "
            "never names them)."
        ),
    )
    train_objectives: list[PositiveInt] = Field(
        [2], min_length=1,
        description="Objective counts k used in training prompts, cycled (the paper trains on k=2).",
    )
    test_objectives: list[PositiveInt] = Field(
        list(range(2, 11)), min_length=1,
        description="Objective counts k of the held-out test sets (the paper evaluates k=2..10).",
    )
    two_hop_share: float = Field(
        0.5, ge=0.0, le=1.0,
        description="Share of questions that need two hops.",
    )
    oracle_trajectories: int = Field(
        10000, ge=0,
        description="Oracle (SFT cold-start) trajectories from training prompts (the paper distils ~10k).",
    )
    oracle_max_turns: int = Field(
        16, ge=1,
        description=(
            "Turn limit of the oracle's SFT trajectories (the cold start's longest episodes). A world setting, not "
            "rollout.max_turns, so changing the agent's turn limit reuses the built world; the agent loop still "
            "stops at rollout.max_turns."
        ),
    )
    oracle_imperfect_share: float = Field(
        0.2, ge=0.0, le=1.0,
        description=(
            "Share of oracle trajectories with imperfect behaviour (sloppy memory, redundant search, early "
            "answer)."
        ),
    )
    name_pool: int = Field(
        0, ge=0,
        description=(
            "Words per name inventory (given names, family names, company/university stems); names combine them, "
            "as real names reuse words. 0 = every name word is new (each entity's name is a token seen only with "
            "it)."
        ),
    )
    tokenizer_vocab_size: int = Field(
        2048, ge=300,
        description=(
            "Vocabulary size of the world's byte-level BPE tokenizer (an upper bound: BPE stops when no pair "
            "repeats)."
        ),
    )
    pretrain_tokens: int = Field(
        0, ge=0,
        description=(
            "Tokens of causal-LM pretraining of the tiny model on the world's passages and oracle transcripts, "
            "once per world, before SFT (0 = the random-init model). Builds the copy skill a real pretrained base "
            "has."
        ),
    )
    pretrain_seq_len: int = Field(
        512, ge=16,
        description="Pretraining block length (documents joined with <|endoftext|>, no padding).",
    )
    pretrain_batch_tokens: int = Field(
        8192, ge=16,
        description="Tokens per pretraining step (blocks per step = this / pretrain_seq_len).",
    )
    pretrain_lr: float = Field(
        3e-3, gt=0,
        description="Peak pretraining learning rate (AdamW, 5% warm-up, cosine to a tenth).",
    )
