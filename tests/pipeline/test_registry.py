"""The service registry (services/pipeline/registry.py) is the one list of services: the Serve apps, the
plan, the Serve config, the version map and the pipeline read it, and services/pipeline/ has no import
circle. No cluster: the service modules are imported, nothing is deployed."""

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path
from types import FunctionType

import pytest
import yaml

from services.config import LearnerConfig, load_config, replica_config
from services.serve_version import deployment_version
from services.config import sections_read
from services.pipeline import plan, serve_apps
from services.pipeline.apps import Pipeline
from services.pipeline.registry import (POLICY_HOLDERS, RESTART_RULES, ROOT, SERVICES, _load, application,
                                        route_prefix, service, wired)

TINY = "deploy/configs/tiny.yaml"
PACKAGE = {"search": "search_tool", "rollout": "rollout", "scorer": "scorer", "learner": "learner"}


def test_the_registry_lists_the_services_in_deploy_order_with_their_packages_and_sections():
    assert tuple(SERVICES) == ("search", "rollout", "scorer", "learner")
    for name, svc in SERVICES.items():
        assert svc.name == name and svc.package == PACKAGE[name] and svc.sections == sections_read(PACKAGE[name])
        assert svc.restart in RESTART_RULES
    with pytest.raises(ValueError, match="unknown service 'critic'; choose from search, rollout, scorer, learner"):
        service("critic")


def test_every_entry_names_code_in_its_own_service_package():
    for name, svc in SERVICES.items():
        for path in (svc.app_builder, svc.options_fn, svc.driver_class):
            if path is None:
                continue
            assert path.startswith(f"services.{PACKAGE[name]}."), (name, path)
            assert callable(_load(path)), path
        if svc.driver_class is not None:  # every driver is built alike: (handle, cfg)
            assert list(inspect.signature(_load(svc.driver_class)).parameters)[:2] == ["handle", "cfg"]


def test_the_serve_apps_are_one_builder_per_service():
    for name in SERVICES:
        build = getattr(serve_apps, name)
        assert isinstance(build, FunctionType) and build.__name__ == name  # what Serve's import_path accepts
        assert len(inspect.signature(build).parameters) == 1  # Serve passes the application's args
    committed = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    assert [a["import_path"] for a in committed["applications"]] == [f"services.pipeline.serve_apps:{n}"
                                                                       for n in SERVICES]


def test_the_plan_and_the_serve_config_read_the_registry():
    cfg = load_config(TINY)
    options = plan.deployments(cfg)
    assert list(options) == list(SERVICES)
    assert options == {name: svc.options(cfg) for name, svc in SERVICES.items()}
    assert {a.service for a in plan.actors(cfg)} == set(SERVICES)
    apps = plan.serve_config(cfg, TINY)["applications"]
    assert [(a["name"], a["route_prefix"], a["deployments"][0]["name"]) for a in apps] == [
        (name, route_prefix(cfg, name), name) for name in SERVICES]


def test_the_version_map_covers_every_service():
    config = replica_config(load_config(TINY))
    versions = {name: deployment_version(config, svc.package) for name, svc in SERVICES.items()}
    assert len(set(versions.values())) == len(SERVICES)


def test_the_pipeline_has_a_place_for_every_service_and_publishes_to_the_policy_holders():
    fields = {f.name for f in dataclasses.fields(Pipeline)}
    assert set(SERVICES) <= fields
    assert POLICY_HOLDERS == ("rollout", "scorer")
    # the learner's default publish targets are the policy holders (wired() renames them with a prefix)
    assert LearnerConfig().publish_to == [f"{n}:{n}" for n in POLICY_HOLDERS]
    w = wired(load_config(TINY, ["ray.app_prefix=p-"]))
    assert w.learner.publish_to == [f"p-{n}:{n}" for n in POLICY_HOLDERS]
    with pytest.raises(ValueError, match="unknown service"):
        application(load_config(TINY), "critic")


def test_pipeline_start_deploys_every_service_at_once_in_registry_order_and_builds_each_driver_by_its_rule(monkeypatch):
    """Pipeline.start without a cluster: what it deploys, in which order, and what each service gets."""
    from services.pipeline import apps

    deployed = []
    monkeypatch.setattr(apps, "prepare_world", lambda cfg: cfg)
    monkeypatch.setattr(apps, "connect", lambda cfg: None)
    monkeypatch.setattr(apps, "check_resources", lambda cfg, services, strict: None)
    monkeypatch.setattr(apps, "application", lambda cfg, name: f"app:{name}")
    monkeypatch.setattr(apps, "deploy_all", lambda targets: deployed.append(
        [(t.app, t.name, t.route_prefix) for t in targets]) or {t.service: (f"handle:{t.service}", 1.0) for t in targets})
    monkeypatch.setattr(apps, "replica_watch", lambda cfg, name: f"watch:{name}")
    pipe = apps.Pipeline.start(load_config(TINY, ["ray.app_prefix=p-"]), ("learner", "scorer", "search"))
    assert deployed == [[("app:search", "p-search", "/p-search"), ("app:scorer", "p-scorer", "/p-scorer"),
                         ("app:learner", "p-learner", None)]]  # in one call: their replicas start side by side
    assert pipe.start_s == {"search": 1.0, "scorer": 1.0, "learner": 1.0}
    assert pipe.apps == ["p-search", "p-scorer", "p-learner"] and pipe.rollout is None
    assert pipe.search == "handle:search"  # no driver: the bare handle
    for name in ("scorer", "learner"):
        driver = getattr(pipe, name)
        assert type(driver) is _load(SERVICES[name].driver_class) and driver.handle == f"handle:{name}"
        assert driver.watch == pipe.watches[name] == f"watch:{name}"
    assert pipe.scorer.before_retry == pipe.resync  # restart rule "resync"
    assert not hasattr(pipe.learner, "before_retry")  # "resume": its calls are never retried
    assert pipe.cfg.learner.publish_to == ["p-rollout:rollout", "p-scorer:scorer"]


def _module_imports(path: Path) -> set[str]:
    """The services.* modules a file imports, at any depth (function bodies too)."""
    here = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module) if p)
            out |= {f"{module}.{a.name}" for a in node.names} | {module}
    return {m for m in out if m.startswith("services.")}


def test_services_pipeline_has_no_import_circle():
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p
               for p in sorted((ROOT / "services" / "pipeline").glob("*.py"))}
    graph = {m: _module_imports(p) & set(modules) for m, p in modules.items()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in graph:
        visit(m)


FUNCTION_IMPORTS_WITH_REASONS = ("services/cli.py", "services/pipeline/apps.py", "services/pipeline/plan.py",
                                 "services/pipeline/serve_apps.py", "services/pipeline/registry.py")


@pytest.mark.parametrize("rel", FUNCTION_IMPORTS_WITH_REASONS)
def test_an_import_inside_a_function_says_why(rel):
    """Imports sit at the top; one inside a function (a heavy library: torch, Ray, vLLM) carries its reason
    as a comment on its line."""
    path = ROOT / rel
    lines = path.read_text().splitlines()
    silent = [f"{rel}:{node.lineno}: {lines[node.lineno - 1].strip()}"
              for fn in ast.walk(ast.parse(path.read_text())) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))
              if "#" not in lines[node.lineno - 1] and "#" not in lines[node.end_lineno - 1]]
    assert not silent, "move these imports to the top, or say why they wait:\n" + "\n".join(sorted(set(silent)))


def test_mempo_help_loads_no_heavy_library():
    heavy = ("torch", "ray", "vllm", "transformers", "pandas", "fastapi")
    probe = (f"import sys, services.cli, services.pipeline.registry; "
             f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
