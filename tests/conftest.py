"""Session-wide fixtures: one local Ray cluster and one embedded world for the whole test run.

Heavy things (Ray, the world, the grammar model) are created once per session and shared; tests that
need them ask for the fixture. GPU-only tests are marked ``gpu`` and skip without CUDA.

Tests are hermetic: none reads or writes the working tree's ``runs/`` (what a user's ``make run``
leaves there). Every run directory a test uses is a temporary one (``tiny_cfg`` has its own), and
the session fails if ``runs/`` changed while it ran (``runs_untouched``). The world cache
(``.cache/world``) is built once if missing and otherwise only read.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# OpenMP threads sleep while they wait, in this process too (its in-process torch, loaded after this line), as on
# the nodes mempo starts: `make test` runs two sessions side by side on shared cores.
from services.common.local_ray import CPU_NODE_ENV  # noqa: E402 (stdlib only: no torch or Ray yet)

for _key, _value in CPU_NODE_ENV.items():
    os.environ.setdefault(_key, _value)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster shared by every test of the session, started as ``mempo`` starts its own
    (loopback only, token auth on: services/common/local_ray.py)."""
    import ray

    from services.common.local_ray import local_init_options

    if not ray.is_initialized():
        ray.init(**local_init_options(num_cpus=2, object_store_memory=400_000_000))
    yield ray
    ray.shutdown()


TINY_CONFIG = os.path.join(os.path.dirname(__file__), "..", "deploy", "configs", "tiny.yaml")
USER_RUNS = Path(__file__).resolve().parents[1] / "runs"


def tree_state(root: Path) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under ``root`` ({} when it does not exist)."""
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def runs_untouched():
    """Fail the session if any test wrote to the working tree's runs/ (a user's runs live there)."""
    before = tree_state(USER_RUNS)
    yield
    after = tree_state(USER_RUNS)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, (f"{USER_RUNS} changed while the tests ran: {changed[:10]}. A test must use a temporary "
                         f"train.run_dir; a `mempo` command of yours writing there at the same time also shows here")


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    """The laptop/CI config (deploy/configs/tiny.yaml) with a temporary ``train.run_dir``."""
    from services.config import load_config

    return load_config(TINY_CONFIG, [f"train.run_dir={tmp_path_factory.mktemp('tiny-run')}"])


@pytest.fixture(scope="session")
def world(tiny_cfg):
    """The embedded world of the tiny config, built once (and cached on disk across sessions)."""
    from services.world.build import build_world

    return build_world(tiny_cfg, progress=False)


@pytest.fixture(scope="session")
def qwen_tokenizer(world, tiny_cfg):
    """The real Qwen2.5 tokenizer, built offline with the world (cached beside it)."""
    from transformers import AutoTokenizer

    from services.common.paths import qwen_tokenizer_path

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_path(tiny_cfg)))


@pytest.fixture(scope="session")
def serve_http(ray_cluster):
    """Ray Serve on the shared cluster, HTTP on a free local port; yields the base URL."""
    from ray import serve

    from services.common.local_ray import free_ports

    port = free_ports(1)[0]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def search_service(serve_http, tiny_cfg, world):
    """The search deployment of the tiny config at route "/"; yields (handle, base URL)."""
    from ray import serve

    from services.search_tool.service import search_app

    handle = serve.run(search_app(tiny_cfg), name="search", route_prefix="/")
    yield handle, serve_http
    serve.delete("search")


@pytest.fixture(scope="session")
def grammar_model(world):
    """The world's tiny model after a short SFT on oracle turns: it writes the MemPO grammar."""
    from pathlib import Path

    from tests.rollout.grammar_model import grammar_model as build

    return build(world, Path(".cache/test-models"))


@pytest.fixture(scope="session")
def rollout_service(search_service, grammar_model):
    """The rollout deployment (one replica) on the grammar model; yields (handle, config)."""
    from ray import serve

    from services.config import load_config
    from services.rollout.service import rollout_app

    cfg = load_config(TINY_CONFIG, [f"model.path={grammar_model}", "rollout.num_cpus=0.5",
                                    "rollout.max_turns=4", "rollout.max_response_tokens=96"])
    handle = serve.run(rollout_app(cfg), name="rollout", route_prefix=None)
    yield handle, cfg
    serve.delete("rollout")
