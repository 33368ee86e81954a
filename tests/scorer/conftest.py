"""The scorer deployment shared by the scorer's Serve tests (REST, fuzz): one per session."""

import pytest


@pytest.fixture(scope="session")
def scorer_service(serve_http, grammar_model):
    """The scorer on the grammar model at route /scorer; yields (handle, base URL, config)."""
    from ray import serve

    from services.config import load_config
    from services.scorer.service import scorer_app

    cfg = load_config("deploy/configs/tiny.yaml", [f"model.path={grammar_model}", "scorer.num_cpus=0.25",
                                                   "scorer.max_request_tokens=2000"])
    handle = serve.run(scorer_app(cfg), name="scorer", route_prefix="/scorer")
    yield handle, f"{serve_http}/scorer", cfg
    serve.delete("scorer")
