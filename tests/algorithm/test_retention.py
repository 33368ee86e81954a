"""The label-free retention check: which memories still hold every gold answer the history showed."""

import numpy as np
from transformers import AutoTokenizer

from services.common.messages import Episode, Prompt, RolloutGroup, TurnRecord
from services.algorithm.retention import retention_labels, retention_metrics, shown_answers
from services.common.token_text import TokenText

I32 = np.int32


def _turn(tok, turn: int, memory: str | None, observation: str) -> TurnRecord:
    head = tok.encode(f"<mem>\n{memory}\n</mem>", add_special_tokens=False) if memory is not None else []
    rest = tok.encode("\n<think>\nok\n</think>\n<search> q </search>", add_special_tokens=False)
    return TurnRecord(turn=turn, context_ids=np.zeros(1, I32), response_ids=np.asarray(head + rest, I32),
                      response_logprobs=np.zeros(len(head) + len(rest), np.float32),
                      mem_start=0 if head else -1, mem_end=len(head) if head else -1,
                      observation_ids=np.asarray(tok.encode(observation, add_special_tokens=False), I32))


def test_labels_follow_what_the_history_showed_and_the_memory_kept(world):
    tok = AutoTokenizer.from_pretrained(world / "model")
    obs = ["<information>\nThe Reed College is in Portland.\n</information>",
           "<information>\nNothing here.\n</information>",
           "<information>\nIt opened in 1911.\n</information>", ""]
    keeps = [None, "- Answer: Reed College", "- Still needed: everything", "- Reed college; - Answer: 1911"]
    ep = Episode(uid="p/0", sample=0, prompt_ids=np.zeros(1, I32), full_ids=np.zeros(1, I32),
                 turns=[_turn(tok, i + 1, m, o) for i, (m, o) in enumerate(zip(keeps, obs))])
    group = RolloutGroup(prompt=Prompt(uid="p", messages=[], golds=[["Reed College", "Reed"], ["1911"]]),
                         episodes=[ep])
    labels = retention_labels(TokenText(tok), group, [(0, 1), (0, 2), (0, 3)])
    # turn 2 kept the one answer shown; turn 3 dropped it; turn 4 holds both (normalised: case, articles)
    assert labels == [1, 0, 1]
    # what each block's turn had been shown: question 0 from the first observation, question 1 from the third
    reed = ["Reed College", "Reed"]  # every alias the observations hold
    assert shown_answers(TokenText(tok), group, [(0, 1), (0, 2), (0, 3)]) == [{0: reed}, {0: reed}, {0: reed, 1: ["1911"]}]
    early = RolloutGroup(prompt=Prompt(uid="q", messages=[], golds=[["Kalton"]]), episodes=[ep])
    assert retention_labels(TokenText(tok), early, [(0, 1)]) == [-1]  # nothing shown: unlabelled


def test_metrics_share_and_auc():
    m = retention_metrics([0.5, 0.4, -0.2, 0.1, 9.0], [1, 1, 0, 0, -1])
    assert m == {"retention_blocks": 4.0, "retained_share": 0.5, "retention_auc": 1.0}
    assert "retention_auc" not in retention_metrics([0.1, 0.2], [1, 1])  # one class: no AUC
    assert retention_metrics([0.1], [-1]) == {"retention_blocks": 0.0}
