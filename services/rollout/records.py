"""Token bookkeeping of an episode: prompt ids, the memory rule, observation ids, turn records.

Shared by the live agent loop (``agent.py``, responses from vLLM) and by ``episode_from_transcript``
(a finished chat transcript, e.g. an oracle trajectory, turned into the same records for scoring
or benchmarks). Model responses arrive as token ids; the text the parser reads is decoded from
those ids, and spans are mapped back to token positions (``token_text.py``).
"""

from __future__ import annotations

import numpy as np

from services.common.chat_turns import after_eos, resolve_observation_template
from services.config import MempoConfig
from services.common.messages import Episode, Prompt, TurnRecord
from services.common.model_io import chat_ids
from services.common.token_text import TokenText, clean
from services.rollout.parser import ParsedTurn, parse_turn


class EpisodeBuilder:
    def __init__(self, cfg: MempoConfig, tokenizer):
        self.rc = cfg.rollout
        self.tokenizer = tokenizer
        self.tt = TokenText(tokenizer)
        self.eos_id = tokenizer.eos_token_id
        self.eos_text = tokenizer.eos_token or ""
        self.observation_template = resolve_observation_template(tokenizer, self.rc.observation_template)

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        return chat_ids(self.tokenizer, [{"role": m.role, "content": m.content} for m in prompt.messages])

    def context(self, prompt_ids: list[int], pieces: list[list[int]]) -> list[int]:
        """The memory rule: system + question + the last ``memory_window`` turns (or all)."""
        window = pieces if self.rc.memory_window == "full" else pieces[max(0, len(pieces) - self.rc.memory_window):]
        return prompt_ids + [t for piece in window for t in piece]

    def observation_ids(self, observation: str, response_ids: list[int]) -> list[int]:
        text = self.observation_template.format(observation=observation)
        if response_ids and response_ids[-1] == self.eos_id:
            text = after_eos(text, self.eos_text)  # the model already closed its message
        return self.tokenizer.encode(text, add_special_tokens=False)

    def record(self, turn: int, context: list[int], response_ids: list[int], logprobs: list[float],
               version: int, finish_reason: str, full_prefix_len: int) -> tuple[TurnRecord, ParsedTurn]:
        """A TurnRecord for generated ``response_ids`` (observation filled in by the caller)."""
        text, ends = self.tt.decode(response_ids)
        parsed = parse_turn(text, turn)
        rec = TurnRecord(turn=turn, context_ids=np.asarray(context, np.int32),
                         response_ids=np.asarray(response_ids, np.int32),
                         response_logprobs=np.asarray(logprobs, np.float32),
                         action=parsed.action, action_text=clean(parsed.argument), format_ok=parsed.format_ok,
                         problems=list(parsed.problems), full_prefix_len=full_prefix_len,
                         policy_version=version, finish_reason=finish_reason)
        if parsed.mem is not None:
            rec.mem_start, rec.mem_end = self.tt.token_span(text, ends, parsed.mem.start, parsed.mem.end)
        if parsed.action_block is not None:
            rec.action_start, rec.action_end = self.tt.token_span(text, ends, parsed.action_block.start,
                                                                  parsed.action_block.end)
        return rec, parsed


def episode_from_transcript(builder: EpisodeBuilder, prompt: Prompt, messages: list[dict], sample: int = 0,
                            version: int = 0) -> Episode:
    """Records for a finished transcript [system, user, assistant, user(observation), assistant, ...].

    The assistant texts are tokenised here (they are external text, not this policy's samples), so
    their log-probs are unknown and recorded as zeros.
    """
    prompt_ids = builder.prompt_ids(prompt)
    full_ids, pieces = list(prompt_ids), []
    ep = Episode(uid=f"{prompt.uid}/{sample}", sample=sample, prompt_ids=np.asarray(prompt_ids, np.int32),
                 full_ids=np.zeros(0, np.int32), finish_reason="max_turns")
    for i in range(2, len(messages), 2):
        ctx = builder.context(prompt_ids, pieces)
        resp = builder.tokenizer.encode(messages[i]["content"], add_special_tokens=False)
        rec, parsed = builder.record(len(ep.turns) + 1, ctx, resp, [0.0] * len(resp), version, "stop", len(full_ids))
        obs = builder.observation_ids(messages[i + 1]["content"], resp) if i + 1 < len(messages) else []
        rec.observation_ids = np.asarray(obs, np.int32)
        ep.turns.append(rec)
        ep.tool_calls += parsed.action == "search"
        ep.peak_tokens = max(ep.peak_tokens, len(ctx) + len(resp))
        ep.total_tokens += len(ctx) + len(resp)
        full_ids += resp + obs
        pieces.append(resp + obs)
        if parsed.action == "answer":
            ep.answer, ep.finish_reason = rec.action_text, "answer"
    ep.full_ids = np.asarray(full_ids, np.int32)
    return ep
