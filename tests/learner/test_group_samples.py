"""The sampled training groups `mempo view` shows: cut at the turns' own token spans, carrying each
episode's reward and advantage and each block's memory score and A_mem, capped per step."""

import json

from services.config import AlgorithmConfig
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages
from services.learner.group_samples import decoded_group, group_records
from tests.algorithm.test_advantages import _group, _scores


def test_group_records_split_at_the_memory_span_and_carry_rewards_advantages_and_scores():
    batch = TrajectoryBatch(groups=[_group(["Kroumia", "Lagav"]), _group(["x", "y"])], policy_version=0)
    scores = _scores([(0, 1, 0.4), (1, 1, -0.2)])
    adv = compute_advantages(batch, scores, AlgorithmConfig())
    records = group_records(batch, scores, adv, limit=1)
    assert len(records) == 1 and records[0]["k"] == 1 and records[0]["golds"] == [["Kroumia"]]
    ep = records[0]["episodes"][0]
    assert ep["reward"] == 1.0 and ep["a_out"] == adv.a_out[(0, 0)]
    first, second = ep["turns"][0], ep["turns"][1]
    assert first["mem_ids"] == [] and first["before_ids"] == [] and first["after_ids"] == list(range(10))
    assert second["before_ids"] == [] and second["mem_ids"] == [0, 1, 2, 3] and second["after_ids"] == list(range(4, 10))
    assert second["a_mem"] == adv.a_mem[(0, 0, 1)] and second["score"]["r_mem"] == 0.4
    assert first["a_mem"] is None and first["score"] is None
    assert group_records(batch, scores, adv, limit=0) == [] and len(group_records(batch, None, adv, 5)) == 2

    text = decoded_group(records[0], lambda ids: " ".join(f"t{i}" for i in ids))
    turn = text["episodes"][0]["turns"][1]
    assert turn["mem"] == "t0 t1 t2 t3" and turn["after"].startswith("t4") and turn["memory_reward"]["tokens"] == ["t0"]
    assert "answer_ids" not in turn["memory_reward"] and "mem_ids" not in turn
    json.dumps(text)  # plain JSON all the way down: Python numbers, not numpy's
    assert type(ep["a_out"]) is float and type(second["score"]["mem_logp"][0]) is float
    assert type(second["mem_ids"][0]) is int and type(second["score"]["answer_ids"][0]) is int
