"""Each registry of choices (the rule tables of services/algorithm/: memory_reward.py, memory_advantage.py,
outcome.py) is the one list its config field validates against, its code branches on (an unknown name raises), and
docs/algorithm.md shows."""

import re
from pathlib import Path
from typing import get_args

import numpy as np
import pytest

from services.algorithm.outcome import OUTCOME_ADVANTAGES
from services.algorithm.memory_advantage import MEM_CREDIT_SCOPES, MEM_CREDITS, MEM_POOLINGS, mem_credit
from services.common.choices import Choices
from services.config import AlgorithmConfig, ConfigError, MempoConfig, load_config
from services.algorithm.memory_reward import AVERAGES, FILTERS, SCORED_ANSWERS, average_p, memory_reward
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages

ROOT = Path(__file__).resolve().parents[2]
ALGORITHM_MD = (ROOT / "docs" / "algorithm.md").read_text()
TABLES = (FILTERS, AVERAGES, MEM_POOLINGS, MEM_CREDITS, MEM_CREDIT_SCOPES, SCORED_ANSWERS, OUTCOME_ADVANTAGES)


def _field(table: Choices):
    section, name = table.field.split(".")
    return MempoConfig.model_fields[section].annotation.model_fields[name]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.field)
def test_the_config_field_accepts_exactly_the_tables_names(table):
    field = _field(table)
    assert table.reference in table and field.default in table
    if get_args(field.annotation):  # a Literal: its values are the table's, in its order
        assert get_args(field.annotation) == table.names
        assert all(re.search(rf"\b{n}\b", field.description) for n in table), "the help names every choice"
    for name in table:
        assert getattr(getattr(load_config(None, [f"{table.field}={name}"]), table.field.split(".")[0]),
                       table.field.split(".")[1]) == name
    with pytest.raises(ConfigError, match=re.escape(table.field)):
        load_config(None, [f"{table.field}=no_such_choice"])


def test_code_that_branches_on_a_choice_raises_on_an_unknown_one():
    for table in (FILTERS, AVERAGES, MEM_POOLINGS, MEM_CREDITS, MEM_CREDIT_SCOPES, OUTCOME_ADVANTAGES):
        assert all(callable(rule.fn) for rule in table.values()), f"{table.field}: a choice without its rule"
    assert [mem_credit(-0.5, c) for c in MEM_CREDITS] == [-0.5, -0.5] and mem_credit(0.5, "loss_only") == 0.0
    with pytest.raises(ValueError, match="algorithm.mem_credit: unknown choice 'diference'"):
        mem_credit(0.5, "diference")  # before: silently acted as 'difference'
    bad = AlgorithmConfig.model_construct(**{**AlgorithmConfig().model_dump(), "outcome_advantage": "rloo"})
    with pytest.raises(ValueError, match="algorithm.outcome_advantage: unknown choice 'rloo'"):
        compute_advantages(TrajectoryBatch(policy_version=0, groups=[]), None, bad)
    bad = AlgorithmConfig.model_construct(**{**AlgorithmConfig().model_dump(), "mem_credit_scope": "token"})
    with pytest.raises(ValueError, match="algorithm.mem_credit_scope: unknown choice 'token'"):
        compute_advantages(TrajectoryBatch(policy_version=0, groups=[]), None, bad)  # before: silently acted as 'block'
    logp = np.log([0.9, 0.8])
    with pytest.raises(ValueError, match="filter mode 'median'"):
        memory_reward(logp, logp, mode="median")
    with pytest.raises(ValueError, match="average 'median'"):
        average_p(logp, np.ones(2, bool), "median")
    with pytest.raises(ValueError, match="registered twice"):
        Choices("x.y", "a", ("a", "one"), ("a", "again"))


def _bullets(after: str) -> list[str]:
    """The backticked names of the bullet list that follows the line containing ``after``."""
    lines = ALGORITHM_MD[ALGORITHM_MD.index(after):].splitlines()[1:]
    start = next(i for i, line in enumerate(lines) if line.startswith("- "))
    names = []
    for line in lines[start:]:
        if line.startswith("- "):
            names.append(re.match(r"- `([^`]+)`", line).group(1))
        elif not line.startswith("  "):
            break
    return names


def test_the_docs_list_every_filter_and_average_in_the_registry_order():
    assert _bullets("`scorer.filter_mode` decides") == list(FILTERS)
    assert _bullets("`scorer.average` decides") == list(AVERAGES)
    for table in (FILTERS, AVERAGES):
        assert f"`{table.reference}` (reference)" in ALGORITHM_MD


def test_the_docs_name_every_option_beyond_the_reference():
    options = ALGORITHM_MD[ALGORITHM_MD.index("Options beyond the reference"):]
    options = options[: options.index("\n4. ")]
    for table in TABLES:
        short = table.field.split(".")[1]
        for name in table:
            if name not in (table.reference, _field(table).default):
                assert f"`{short}" in options and re.search(rf"[`= ]{name}`", options), (table.field, name)
    assert "`mem_std_floor`" in options
    # the algorithm's own choices are explained where the advantages are (section 5)
    advantages = ALGORITHM_MD[ALGORITHM_MD.index("## 5."):ALGORITHM_MD.index("## 6.")]
    for table in (MEM_POOLINGS, MEM_CREDITS, MEM_CREDIT_SCOPES, SCORED_ANSWERS, OUTCOME_ADVANTAGES):
        for name in table:
            if name != table.reference:
                assert f"`{table.field}={name}`" in advantages, (table.field, name)
