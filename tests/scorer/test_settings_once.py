"""Each scorer setting is said once: the config's field marks (RUNTIME, RULE in services/scorer/settings.py)
decide what changes at runtime and what every score echoes; the REST response model, the message
and the docs must agree with them."""

import dataclasses
import re
from pathlib import Path

from services.config import ScorerConfig, SearchConfig, fields_marked
from services.common.messages import MemoryScoreBatch
from services.scorer import service as scorer_service
from services.search_tool import service as search_service

ROOT = Path(__file__).resolve().parents[2]
RULE = set(fields_marked(ScorerConfig, "rule"))


def test_every_score_echoes_exactly_the_rule_fields():
    assert RULE == {"tau", "filter_mode", "average", "logp_floor"}
    assert set(scorer_service.ScoreResponse.model_fields) & set(ScorerConfig.model_fields) == RULE
    assert {f.name for f in dataclasses.fields(MemoryScoreBatch)} & set(ScorerConfig.model_fields) == RULE
    assert RULE <= set(fields_marked(ScorerConfig, "runtime"))  # a rule that changes at runtime is echoed


def test_the_rest_docstring_names_every_response_field():
    doc = scorer_service.__doc__
    response = doc[doc.index("-> {", doc.index("POST /score")):doc.index("GET|HEAD")]
    assert set(re.findall(r'"(\w+)"', response)) == set(scorer_service.ScoreResponse.model_fields)


def test_runtime_fields_come_from_the_marks_and_the_docs_list_them_all():
    assert scorer_service.ScorerService.func_or_class.RUNTIME_FIELDS == fields_marked(ScorerConfig, "runtime")
    assert search_service.SearchService.func_or_class.RUNTIME_FIELDS == fields_marked(SearchConfig, "runtime")
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    para = deploy[deploy.index("accept a runtime `user_config`"):]
    para = para[:para.index("\n\n")]
    for name in fields_marked(ScorerConfig, "runtime") + fields_marked(SearchConfig, "runtime"):
        assert f"`{name}`" in para, name
