"""A scripted oracle agent that solves world questions in the exact MemPO turn grammar.

It makes the SFT cold-start data (the paper distils ~10k filtered trajectories from a strong
model; ours come from this script). It plays by the agent's rules: it searches the real retrieval
index, reads facts out of the returned passages with the relation's regex, and keeps what it knows
*only* in its ``<mem>`` block, because in memory mode the next turn sees nothing else. It knows
the plan of each question (which relation to look up next), as a strong model would.

Imperfect behaviours (a configurable share of trajectories), so RL has something to improve:
  forget        drops a found fact from one memory rewrite, so it must search again;
  redundant     repeats a search it already made;
  early_answer  answers a 2-hop question with the intermediate entity, one hop short.

    agent = OracleAgent(search=index_search, topk=3)
    traj = agent.solve(questions, system_prompt, behaviour="perfect")
    traj.messages  # [system, user, assistant, user(<information>), assistant, ...]
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

from services.common.turn_format import render_information, render_turn
from services.learner.rewards import multi_objective_em
from services.search_tool.formatting import DEFAULT_DOC_FORMAT, format_passages, split_contents
from services.world.questions import Question
from services.world.relations import RELATIONS

BEHAVIOURS = ("perfect", "forget", "redundant", "early_answer")
SearchFn = Callable[[list[str], int], list[list[dict]]]


@dataclass
class OracleTrajectory:
    messages: list[dict]
    answer: str
    golds: list[list[str]]
    behaviour: str
    searches: int
    turns: int
    em: float = 0.0
    finished: bool = True  # answered within max_turns


@dataclass
class _Goal:
    q: Question
    found: list[str] = field(default_factory=list)  # objects of the hops solved so far
    failed: bool = False
    tries: int = 0  # failed searches for the current hop

    @property
    def done(self) -> bool:
        return self.failed or len(self.found) == len(self.q.hops)

    def subject(self) -> str:
        return self.q.hops[0].subject if not self.found else self.found[-1]

    def relation(self) -> str:
        return self.q.hops[len(self.found)].relation

    def answer(self) -> str:
        return self.found[-1] if len(self.found) == len(self.q.hops) else "unknown"


class OracleAgent:
    def __init__(self, search: SearchFn, topk: int = 3, doc_format: str = DEFAULT_DOC_FORMAT, max_turns: int = 16):
        self.search = search
        self.topk = topk
        self.doc_format = doc_format
        self.max_turns = max_turns

    def _memory(self, goals: list[_Goal]) -> str:
        lines = []
        for i, g in enumerate(goals, 1):
            lines.append(f"Q{i}: {g.q.text}")
            subject = g.q.hops[0].subject
            for hop, obj in zip(g.q.hops, g.found):
                lines.append("- " + RELATIONS[hop.relation].memory.format(s=subject, o=obj) + ".")
                subject = obj
            if g.failed:
                lines.append("- Not found; answer unknown.")
            elif g.done:
                lines.append(f"- Answer: {g.answer()}")
            else:
                lines.append(f"- Still needed: {RELATIONS[g.relation()].phrase.format(s=g.subject())}.")
        return "\n".join(lines)

    def solve(self, questions: list[Question], system_prompt: str, behaviour: str = "perfect",
              rng: random.Random | None = None) -> OracleTrajectory:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}; one of {BEHAVIOURS}")
        rng = rng or random.Random(0)
        goals = [_Goal(q) for q in questions]
        messages = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": "; ".join(q.text for q in questions)}]
        searches, quirk_used, last_query, note = 0, False, None, ""
        for turn in range(1, self.max_turns + 1):
            mem = self._memory(goals) if turn > 1 else None
            if behaviour == "early_answer" and not quirk_used:
                open_goals = [g for g in goals if not g.done]
                if len(open_goals) == 1 and len(open_goals[0].q.hops) == 2 and len(open_goals[0].found) == 1:
                    open_goals[0].found.append(open_goals[0].found[0])  # one hop short: a wrong answer
                    quirk_used = True
            pending = [g for g in goals if not g.done]
            if not pending or turn == self.max_turns:
                answer = "; ".join(g.answer() for g in goals)
                think = "I have found everything the question needs." if not pending else "I am out of turns."
                messages.append({"role": "assistant", "content": render_turn(think, mem=mem, answer=answer)})
                golds = [[q.answer] for q in questions]
                return OracleTrajectory(messages, answer, golds, behaviour, searches, turn,
                                        multi_objective_em(answer, golds), finished=not pending)
            g = pending[0]
            phrase = RELATIONS[g.relation()].phrase.format(s=g.subject())
            repeat = behaviour == "redundant" and not quirk_used and last_query is not None
            if repeat:  # searches what it searched last turn again: a wasted turn, nothing new
                query, quirk_used = last_query, True
                think = f"Let me check the last result once more before looking up {phrase}."
            else:
                query = RELATIONS[g.relation()].query.format(s=g.subject()) if g.tries == 0 else g.subject()
                if turn == 1:
                    think = f"I need to answer {len(goals)} question(s). First I will look up {phrase}."
                else:
                    think = f"{note}I still need {phrase}. I will search for it."
            messages.append({"role": "assistant", "content": render_turn(think, mem=mem, search=query)})
            docs = self.search([query], self.topk)[0]
            searches += 1
            last_query = query
            messages.append({"role": "user", "content": render_information(format_passages(docs, self.doc_format))})
            note = "" if repeat else self._read(g, docs)
            if behaviour == "forget" and not quirk_used and any(x.found for x in goals) and rng.random() < 0.7:
                victim = next(x for x in goals if x.found)
                victim.found.pop()  # the next <mem> leaves this fact out, so it is lost for good
                quirk_used = True
        raise AssertionError("unreachable: the last turn always answers")

    def _read(self, g: _Goal, docs: list[dict]) -> str:
        """Extract the current hop's fact from the passages; returns a note for the next think."""
        subject, rel = g.subject(), RELATIONS[g.relation()]
        for d in docs:
            title, text = split_contents(d["contents"])
            if title == subject:
                obj = rel.extract(text, subject)
                if obj:
                    g.found.append(obj)
                    g.tries = 0
                    return ""
        g.tries += 1
        if g.tries >= 2:
            g.failed = True
        return "The last results did not say it. "
