"""Oracle trajectories as protocol records: a ``RolloutGroup`` of n oracle episodes for one prompt.

Used to score oracle data, and by tests and benchmarks that need realistic multi-turn episodes with
<mem> blocks without sampling a trained policy. Episode i plays behaviour ``BEHAVIOURS[i % 4]``
(perfect, forget, redundant, early_answer), so a group's episodes differ.

    group = oracle_group(cfg, world_dir, train_row, n=16, tokenizer=tok)
    group, trajs = oracle_episodes(cfg, world_dir, train_row, 8, tok, behaviours=("perfect", "lose_answer"))
    trajs[i].labels[t]   # ground truth for group.episodes[i].turns[t] (services/world/oracle.py TurnLabel)
"""

from __future__ import annotations

import random
from pathlib import Path

from services.config import MempoConfig
from services.common.data import row_to_prompt
from services.common.messages import RolloutGroup
from services.rollout.records import EpisodeBuilder, episode_from_transcript
from services.search_tool.bm25_index import BM25Index
from services.world.build import index_oracle
from services.world.oracle import BEHAVIOURS, OracleTrajectory
from services.world.questions import questions_of


def oracle_group(cfg: MempoConfig, world: Path, row: dict, n: int, tokenizer, seed: int = 0,
                 index: BM25Index | None = None) -> RolloutGroup:
    return oracle_episodes(cfg, world, row, n, tokenizer, seed=seed, index=index)[0]


def oracle_episodes(cfg: MempoConfig, world: Path, row: dict, n: int, tokenizer, seed: int = 0,
                    index: BM25Index | None = None, behaviours: tuple[str, ...] = BEHAVIOURS
                    ) -> tuple[RolloutGroup, list[OracleTrajectory]]:
    """The group and the oracle trajectories it was made of (their ``labels`` line up with the
    episodes' turns); episode i plays ``behaviours[i % len(behaviours)]``."""
    index = index or BM25Index.load(world / "index" / "bm25")
    agent = index_oracle(cfg, index, cfg.rollout.max_turns)
    builder = EpisodeBuilder(cfg, tokenizer)
    prompt = row_to_prompt(row, cfg.rollout.system_prompt)
    rng = random.Random(seed)
    episodes, trajs = [], []
    for i in range(n):
        traj = agent.solve(questions_of(row), prompt.messages[0].content, behaviours[i % len(behaviours)], rng)
        episodes.append(episode_from_transcript(builder, prompt, traj.messages, sample=i))
        trajs.append(traj)
    return RolloutGroup(prompt=prompt, episodes=episodes), trajs
