"""search.url: the pipeline deploys no search service and the rollout calls the external server.

Without Ray: the plan, the fit check's actors, the Serve config, serve_apps' search builder and
``mempo serve --apps search`` leave search out or refuse it. With Ray (slow, as the other rollout
integration tests): a second search service is started the way ``mempo serve --apps search`` starts one
(``Pipeline.start(cfg, ["search"])``, here under its own ``ray.app_prefix`` and over a corpus of its own
on the session's loopback Serve), and a pipeline of search + rollout with ``search.url`` pointing at its
HTTP route deploys the rollout only; the rollout's episodes show that server's passages.
"""

from __future__ import annotations

import json

import httpx
import pytest

from services.config import load_config
from tests.conftest import TINY_CONFIG

URL = "http://127.0.0.1:9/retrieve"


def test_the_plan_and_the_serve_config_leave_search_out():
    from services.pipeline import plan

    cfg, ext = load_config(TINY_CONFIG), load_config(TINY_CONFIG, [f"search.url={URL}"])
    assert plan.deployed(cfg) == ["search", "rollout", "scorer", "learner"]
    assert plan.deployed(ext) == ["rollout", "scorer", "learner"]
    assert plan.deployed(ext, ("search", "rollout")) == ["rollout"]
    assert list(plan.deployments(ext)) == ["rollout", "scorer", "learner"]
    assert {a.service for a in plan.actors(ext)} == {"rollout", "scorer", "learner"}
    assert plan.totals(plan.actors(cfg))["CPU"] - plan.totals(plan.actors(ext))["CPU"] == cfg.search.num_cpus
    assert [a["name"] for a in plan.serve_config(ext, "x.yaml")["applications"]] == ["rollout", "scorer", "learner"]


def test_serve_apps_and_mempo_serve_refuse_an_explicit_search(capsys):
    from services.cli import main
    from services.pipeline import serve_apps

    with pytest.raises(ValueError, match="search.url=.*deploys no search application"):
        serve_apps.search({"config": "deploy/configs/tiny.yaml", "overrides": [f"search.url={URL}"]})
    assert main(["serve", "--apps", "search,scorer", TINY_CONFIG, f"search.url={URL}"]) == 2
    assert "names an external search server" in capsys.readouterr().err


# -- a rollout against a second search service -------------------------------------------------------

MARK = "Elsewhere"


@pytest.fixture(scope="module")
def external_search(serve_http, tmp_path_factory, world):
    """A second search service, as `mempo serve --apps search` starts it, over a corpus of its own
    (titles "Elsewhere <i>"); yields its search.url (the /retrieve of its HTTP route)."""
    from services.pipeline.apps import Pipeline

    corpus = tmp_path_factory.mktemp("external-corpus") / "corpus.jsonl"
    words = ["city", "country", "founded", "company", "river", "born", "capital", "population"]
    corpus.write_text("".join(json.dumps({"id": f"x{i}", "contents": f'"{MARK} {i}"\nThe {w} of {MARK} {i} '
                                                                         f'is written on this page.'}) + "\n"
                              for i, w in enumerate(words)))
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config(TINY_CONFIG, [f"search.corpus={corpus}", "search.num_cpus=0.25", "ray.app_prefix=ext-",
                                    "ray.http_host=127.0.0.1", f"ray.http_port={port}"])
    pipe = Pipeline.start(cfg, ["search"])
    assert pipe.apps == ["ext-search"]
    yield f"{serve_http}/ext-search/retrieve"
    pipe.shutdown()


@pytest.mark.slow
def test_the_rollout_calls_the_external_search_and_none_is_deployed(external_search, serve_http, grammar_model,
                                                                     world):
    from ray import serve
    from transformers import AutoTokenizer

    from services.common.data import load_prompts
    from services.common.messages import PromptBatch, TrajectoryBatch
    from services.common.transport import get_message
    from services.pipeline.apps import Pipeline

    health = f"{external_search.rsplit('/', 1)[0]}/health"
    before = httpx.get(health, timeout=10).json()
    assert before["corpus_size"] == 8
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config(TINY_CONFIG, [f"model.path={grammar_model}", "rollout.num_cpus=0.25", "rollout.max_turns=2",
                                    "rollout.max_response_tokens=96", f"search.url={external_search}",
                                    "ray.app_prefix=xrun-", "ray.http_host=127.0.0.1", f"ray.http_port={port}"])
    pipe = Pipeline.start(cfg, ("search", "rollout"))  # what `mempo eval` asks for, less the scorer
    try:
        assert pipe.apps == ["xrun-rollout"] and pipe.search is None
        assert "xrun-search" not in serve.status().applications
        prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, k=1, limit=2)
        refs = pipe.rollout.rollout(PromptBatch(prompts=prompts, n=2, policy_version=0, seed=7))
        out = [get_message(r, TrajectoryBatch) for r in refs]
    finally:
        pipe.shutdown()
    tokenizer = AutoTokenizer.from_pretrained(str(grammar_model))
    searched = [tokenizer.decode(t.observation_ids.tolist()) for b in out for g in b.groups for e in g.episodes
                for t in e.turns if t.action == "search"]
    assert searched, "the grammar model should search"
    for text in searched:
        assert "<information>" in text and f"(Title: {MARK} " in text, text
    calls = sum(b.metrics["tool_calls"] for b in out)
    assert calls == len(searched) and sum(b.metrics["tool_failures"] for b in out) == 0
    after = httpx.get(health, timeout=10).json()
    assert after["requests"] - before["requests"] == calls  # every search went to the external service
