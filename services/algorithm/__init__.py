"""MemPO's algorithm as pure functions on plain arrays (numpy and the standard library only), each
selectable rule registered where it is defined: the config field, its ``--help`` and docs/algorithm.md
read the registry.

    outcome.py   the outcome advantage of a GRPO group (``algorithm.outcome_advantage``)

Run its tests alone in seconds: ``.venv/bin/python -m pytest -q tests/algorithm``.
"""
