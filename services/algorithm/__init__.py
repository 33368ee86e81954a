"""MemPO's algorithm as pure functions on plain arrays, in reading order, each selectable rule
registered where it is defined (``@TABLE.rule(name, description)``): the config field, its ``--help``
and docs/algorithm.md read the registry. The scorer computes log-probs and calls this package for the
reward; the learner calls it for advantages and the loss. It imports only services/common.

    sections.py          a memory's per-question sections (``Q<i>:``), as character offsets
    retention.py         which gold answers the history had shown; does a memory keep them (labels, AUC)
    memory_reward.py     R_mem = P_mem - P_full from the answer tokens' log-probs (``scorer.filter_mode``,
                         ``scorer.average``, ``scorer.scored_answers``)
    outcome.py           a GRPO group's outcome advantage A_out (``algorithm.outcome_advantage``)
    memory_advantage.py  A_mem: pooling, credit and where it lands (``algorithm.mem_pooling``,
                         ``algorithm.mem_credit``, ``algorithm.mem_credit_scope``)
    advantages.py        one step's batch -> R_out, A_out, A_mem and each turn's per-token advantage
    loss.py              the token loss: PPO clip, dual clip, behaviour weights, KL (torch)

Everything but loss.py is numpy and the standard library. Run the tests alone in seconds:
``.venv/bin/python -m pytest -q tests/algorithm``; they include whole RL steps in one process (rollout on
a transformers model, scores, advantages, an update; no Ray or vLLM: tests/algorithm/inprocess.py).
"""
