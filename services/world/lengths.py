"""How long the world's episodes are, per objective count k: the oracle's turns and token counts under
the memory context and under the full history, against the config's limits.

A world is a fair test of memory only if the full history outgrows what an agent can hold while the
memory context stays bounded. This measures it from the oracle's own (perfect) episodes on the
held-out prompts, tokenized with the world's tokenizer and chat template, so a config can be sized
before anything trains:

    python -m services.world lengths deploy/configs/long.yaml      # one row per held-out k

Per k: the oracle's EM and finished share within ``world.oracle_max_turns``; its turns; the longest
assistant turn (tokens; the agent must fit it in ``rollout.max_response_tokens``); the peak context
of one turn under MemPO's rule (system + question + the previous turn and its observation + this
turn, what ``rollout.memory_window=1`` builds); the whole episode as one context (the full-history
rule's last turn); and the shares of episodes over ``rollout.max_context_tokens`` under each rule.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pandas as pd

from services.config import MempoConfig
from services.search_tool.bm25_index import BM25Index
from services.world.build import index_oracle
from services.world.questions import questions_of

COLUMNS = (("oracle EM", "em", "{:.2f}"), ("finished", "finished", "{:.2f}"), ("turns", "turns", "{:.1f}"),
           ("turns max", "turns_max", "{:.0f}"), ("longest turn", "longest_turn", "{:.0f}"),
           ("longest turn max", "longest_turn_max", "{:.0f}"), ("memory-context peak", "memory_peak", "{:.0f}"),
           ("memory-context peak max", "memory_peak_max", "{:.0f}"), ("full history", "full_history", "{:.0f}"),
           ("full history max", "full_history_max", "{:.0f}"), ("memory over limit", "memory_over", "{:.2f}"),
           ("full over limit", "full_over", "{:.2f}"), ("turn over limit", "turn_over", "{:.2f}"))


def episode_lengths(messages: list[dict], count) -> dict[str, int]:
    """Token counts of one episode (``messages``: system, user, then assistant / observation
    turns); ``count(messages) -> int`` tokenizes a context the way the agent's chat template does."""
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("an episode needs at least one assistant turn")
    prompt = messages[:2]
    longest = max(count([messages[i]], bare=True) for i in turns)
    peak = max(count(prompt + (messages[turns[j - 1]:i] if j else []) + [messages[i]]) for j, i in enumerate(turns))
    return {"turns": len(turns), "longest_turn": longest, "memory_peak": peak, "full_history": count(messages)}


def token_counter(tokenizer):
    """``count(messages, bare=False)``: tokens of the chat-templated messages, or with ``bare`` of
    the first message's content alone (an assistant turn as the model generates it)."""
    def count(messages: list[dict], bare: bool = False) -> int:
        text = messages[0]["content"] if bare else tokenizer.apply_chat_template(messages, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])
    return count


def oracle_lengths(cfg: MempoConfig, world: Path, per_k: int = 50, seed: int = 0) -> dict[int, dict[str, float]]:
    """Per held-out k: the oracle's (perfect) episodes' lengths on ``per_k`` test prompts, against
    ``cfg.rollout``'s limits (see the module docstring)."""
    from transformers import AutoTokenizer  # transformers on use

    count = token_counter(AutoTokenizer.from_pretrained(str(world / "model")))
    agent = index_oracle(cfg, BM25Index.load(world / "index" / "bm25"), cfg.world.oracle_max_turns)
    test = pd.read_parquet(world / "test.parquet").to_dict("records")
    limit, turn_limit = cfg.rollout.max_context_tokens, cfg.rollout.max_response_tokens
    out = {}
    for k in sorted({int(r["extra_info"]["k"]) for r in test}):
        rows = [r for r in test if int(r["extra_info"]["k"]) == k][:per_k]
        eps = []
        for r in rows:
            traj = agent.solve(questions_of(r), cfg.rollout.system_prompt, "perfect", random.Random(seed))
            eps.append({**episode_lengths(traj.messages, count), "em": traj.em, "finished": float(traj.finished)})

        def col(key: str) -> np.ndarray:
            return np.asarray([e[key] for e in eps], dtype=np.float64)

        row = {key: float(col(key).mean()) for key in ("em", "finished", "turns", "longest_turn", "memory_peak",
                                                       "full_history")}
        row.update({f"{key}_max": float(col(key).max()) for key in ("turns", "longest_turn", "memory_peak",
                                                                   "full_history")})
        row.update(memory_over=float((col("memory_peak") > limit).mean()),
                   full_over=float((col("full_history") > limit).mean()),
                   turn_over=float((col("longest_turn") > turn_limit).mean()), prompts=float(len(eps)))
        out[k] = row
    return out


def lengths_table(rows: dict[int, dict[str, float]], cfg: MempoConfig) -> str:
    """Markdown: one row per k (limits: rollout.max_context_tokens, rollout.max_response_tokens)."""
    head = "| k | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [f"Limits: rollout.max_context_tokens {cfg.rollout.max_context_tokens}, rollout.max_response_tokens "
             f"{cfg.rollout.max_response_tokens}, world.oracle_max_turns {cfg.world.oracle_max_turns}.", "",
             head, "|" + "---|" * (len(COLUMNS) + 1)]
    for k, row in rows.items():
        lines.append(f"| {k} | " + " | ".join(f.format(row[key]) for _, key, f in COLUMNS) + " |")
    return "\n".join(lines)
