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

Lossy behaviours, for the memory-reward bench only (bench/memreward.py; never in the SFT mix):
once per episode (each chance taken with probability ``LOSS_CHANCE``) the memory loses one thing
  lose_answer   a question's answer, right after it was read (the agent then searches it again);
  lose_bridge   the bridge entity of a 2-hop question, right after its first hop was read;
  distractor    the value just read, replaced by a same-kind value from a distractor passage of the
                same observation (the episode then goes on with the wrong value).

Every trajectory carries ground-truth labels from the oracle's own state, one ``TurnLabel`` per
assistant turn: the gold facts (hop objects: bridges and answers) the history had shown by then
(read by the oracle from an observation), which of them this turn's ``<mem>`` kept, and which it
lost and how (dropped, or replaced by a distractor's value). No label comes from matching text.

    agent = OracleAgent(search=index_search, topk=3)
    traj = agent.solve(questions, system_prompt, behaviour="perfect")
    traj.messages  # [system, user, assistant, user(<information>), assistant, ...]
    traj.labels    # [TurnLabel(turn=1, ...), ...], one per assistant message
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Callable

from services.common.passage_format import DEFAULT_DOC_FORMAT, format_passages, split_contents
from services.common.rewards import multi_objective_em
from services.common.turn_format import FINAL_THINK, render_information, render_turn
from services.world.questions import Question
from services.world.relations import OBJECT_KIND, RELATIONS

BEHAVIOURS = ("perfect", "forget", "redundant", "early_answer")
LOSSY_BEHAVIOURS = ("lose_answer", "lose_bridge", "distractor")
LOSS_CHANCE = 0.5  # a lossy behaviour takes each chance with this probability (at most one loss per episode)
SearchFn = Callable[[list[str], int], list[list[dict]]]

# Values of each kind that the corpus's distractor passages state (services/world/corpus.py _DISTRACTORS):
# the value a distractor rewrite puts in the memory instead of the one read from the subject's page.
DISTRACTOR_VALUES = {
    "city": [r"awarded every year in (?P<o>[^.]+?) to a young", r"funds libraries in (?P<o>[^.]+?) and gave",
             r"is a stadium in (?P<o>[^.,]+),", r"first played in (?P<o>[^.]+?) and won",
             r"is a shopping street in (?P<o>[^.]+)\.", r"is a publisher based in (?P<o>[^.,]+),",
             r"is an airline headquartered in (?P<o>[^.]+)\."],
    "country": [r"held each summer in (?P<o>[^.,]+), named after"],
    "university": [r"The ceremony is held at (?P<o>[^.]+)\."],
    "person": [r"It was designed by (?P<o>[^.]+)\.", r"and won by (?P<o>[^.]+)\."],
    "year": [r"gave its first grant in (?P<o>\d+)", r"sponsored by [^.]+ since (?P<o>\d+)",
             r"is a publisher based in [^.,]+, founded in (?P<o>\d+)"],
}


@dataclass(frozen=True)
class Fact:
    question: int  # index of the question in the prompt
    hop: int
    value: str  # the hop's object, as read from the subject's page
    role: str  # "answer" (the question's last hop) or "bridge" (an earlier hop)


@dataclass(frozen=True)
class Loss:
    fact: Fact
    how: str  # "dropped" (left out of the memory) or "replaced" (another value written instead)
    replaced_by: str | None = None

    @property
    def kind(self) -> str:
        """answer / bridge (a dropped fact of that role) or distractor (a replaced value)."""
        return "distractor" if self.how == "replaced" else self.fact.role


@dataclass
class TurnLabel:
    turn: int
    has_mem: bool  # turn 1 writes no memory
    shown: list[Fact]  # gold facts the history had shown (the oracle read them) before this turn
    kept: list[Fact]  # of those, the ones this turn's memory states with their read value
    lost: list[Loss]  # the others, and how they were lost

    @property
    def label(self) -> str:
        """keep (kept all it had been shown), lose (lost one or more), or none (nothing shown yet)."""
        return "lose" if self.lost else "keep" if self.shown else "none"


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
    labels: list[TurnLabel] = field(default_factory=list)  # one per assistant message, in order


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

    def on_gold_chain(self) -> bool:
        """Every object found so far is the question's true hop object."""
        return self.found == [h.object for h in self.q.hops[:len(self.found)]]


def _label(turn: int, goals: list[_Goal], shown: list[Fact]) -> TurnLabel:
    """What the memory written now (from ``goals``, as ``_memory`` writes it) keeps of ``shown``."""
    if turn == 1:
        return TurnLabel(turn, False, [], [], [])
    kept, lost = [], []
    for f in shown:
        found = goals[f.question].found
        if f.hop >= len(found):
            lost.append(Loss(f, "dropped"))
        elif found[f.hop] != f.value:
            lost.append(Loss(f, "replaced", found[f.hop]))
        else:
            kept.append(f)
    return TurnLabel(turn, True, list(shown), kept, lost)


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
        if behaviour not in BEHAVIOURS + LOSSY_BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}; one of {BEHAVIOURS + LOSSY_BEHAVIOURS}")
        rng = rng or random.Random(0)
        goals = [_Goal(q) for q in questions]
        messages = [{"role": "system", "content": system_prompt},
                    {"role": "user", "content": "; ".join(q.text for q in questions)}]
        searches, quirk_used, last_query, note = 0, False, None, ""
        shown: list[Fact] = []  # gold facts read from observations so far (the labels' ground truth)
        labels: list[TurnLabel] = []
        for turn in range(1, self.max_turns + 1):
            mem = self._memory(goals) if turn > 1 else None
            labels.append(_label(turn, goals, shown))  # what ``mem`` keeps of what the history showed
            if behaviour == "early_answer" and not quirk_used:
                open_goals = [g for g in goals if not g.done]
                if len(open_goals) == 1 and len(open_goals[0].q.hops) == 2 and len(open_goals[0].found) == 1:
                    open_goals[0].found.append(open_goals[0].found[0])  # one hop short: a wrong answer
                    quirk_used = True
            pending = [g for g in goals if not g.done]
            if not pending or turn == self.max_turns:
                answer = "; ".join(g.answer() for g in goals)
                think = FINAL_THINK if not pending else "I am out of turns."
                messages.append({"role": "assistant", "content": render_turn(think, mem=mem, answer=answer)})
                golds = [[q.answer] for q in questions]
                return OracleTrajectory(messages, answer, golds, behaviour, searches, turn,
                                        multi_objective_em(answer, golds), finished=not pending, labels=labels)
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
            had = len(g.found)
            note = "" if repeat else self._read(g, docs)
            if len(g.found) > had and g.on_gold_chain():  # a gold fact the history now shows
                fact = Fact(goals.index(g), had, g.found[-1], "answer" if had == len(g.q.hops) - 1 else "bridge")
                if fact not in shown:
                    shown.append(fact)
            if behaviour == "forget" and not quirk_used and any(x.found for x in goals) and rng.random() < 0.7:
                victim = next(x for x in goals if x.found)
                victim.found.pop()  # the next <mem> leaves this fact out, so it is lost for good
                quirk_used = True
            elif behaviour in LOSSY_BEHAVIOURS and not quirk_used and len(g.found) > had:
                quirk_used = self._lose(behaviour, g, docs, rng)
        raise AssertionError("unreachable: the last turn always answers")

    def _lose(self, behaviour: str, g: _Goal, docs: list[dict], rng: random.Random) -> bool:
        """Maybe lose the fact just read into ``g`` (see the module docstring); whether it did."""
        last_hop = len(g.found) == len(g.q.hops)
        if behaviour == "lose_answer":
            chance = last_hop
        elif behaviour == "lose_bridge":
            chance = len(g.q.hops) == 2 and not last_hop
        else:
            value = self._distractor_value(g, docs)
            chance = value is not None
        if not chance or rng.random() >= LOSS_CHANCE:
            return False
        if behaviour == "distractor":
            g.found[-1] = value  # the memory now states the distractor's value in place of the true one
        else:
            g.found.pop()  # the next <mem> leaves the fact out; the agent searches it again
        return True

    def _distractor_value(self, g: _Goal, docs: list[dict]) -> str | None:
        """The first value of the just-read fact's kind that a passage other than the subject's page
        states, if it differs from the value read."""
        hop = g.q.hops[len(g.found) - 1]
        subject = hop.subject if len(g.found) == 1 else g.found[-2]
        kind = OBJECT_KIND[hop.relation] or "year"
        for d in docs:
            title, text = split_contents(d["contents"])
            if title == subject:
                continue
            for pattern in DISTRACTOR_VALUES[kind]:
                m = re.search(pattern, text)
                if m and m.group("o").strip() != g.found[-1]:
                    return m.group("o").strip()
        return None

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
