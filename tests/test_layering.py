"""The packages of services/ import only downward, function-local imports included.

    common < algorithm < config < serve_version < {search_tool, rollout, scorer, learner} < world < pipeline < cli

common imports nothing above it. services/config.py composes the config tree (and says which sections
each service reads); services/serve_version.py versions a service's deployment by those sections.
The four services stand side by side on one floor above them: each imports common and itself,
never another service (they talk only through the protocol's messages, by handle or over HTTP), so
each can be read, tested and redeployed alone. What two of them share lives below them: in common
``token_text`` (the rollout's and the scorer's token positions), ``rewards``, ``passage_format`` and
the protocol; in algorithm (pure functions, importing only common) MemPO's rules: the memory reward
the scorer computes, the retention labels it writes and the learner reads, the advantages and the loss.

No service imports the world: the pipeline builds it and deploys concrete paths
(services/common/paths.py). The world sits above the services but uses their code only where it
must (``WORLD_USES``): it writes the search tool's BM25 index, and records the oracle's episodes
exactly as the rollout records its own.

Every import goes to a strictly lower floor, so no chain of imports can come back to where it
started: there are no import cycles between packages. One exception, by design: each package declares
its own config section in ``services/<package>/settings.py``, and services/config.py composes
them into one tree. A settings module imports only the config leaves (``CONFIG_LEAVES``: common's
and the algorithm's rule tables, which import no config), so the composition's upward imports cannot come back either.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("search_tool", "rollout", "scorer", "learner")
FLOORS = (("common",), ("algorithm",), ("config",), ("serve_version",), SERVICES, ("world",), ("pipeline",), ("cli",))
FLOOR = {name: i for i, floor in enumerate(FLOORS) for name in floor}
# The services' modules the world may import, each with its reason; nothing else of theirs.
WORLD_USES = {
    "services.search_tool.bm25_index": "the world builds the index the search tool loads; its oracle searches it",
    "services.rollout.records": "oracle transcripts become episodes exactly as the rollout records its own",
}


# The composition (services/config.py) and the only modules a settings module may import.
COMPOSITION = "services/config.py"
CONFIG_LEAVES = ("services.common.config_fields", "services.common.choices", "services.common.turn_format",
                 "services.algorithm.memory_reward", "services.algorithm.memory_advantage", "services.algorithm.outcome")


def _composes(module: str, where: str) -> bool:
    """An import of a package's settings module by the config composition."""
    return where.startswith(COMPOSITION + ":") and module.startswith("services.") and module.endswith(".settings")


def _package(module: str) -> str | None:
    """'services.rollout.agent' -> 'rollout'; None for anything outside services."""
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 and parts[1] != "__init__" else None


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, at any depth (function bodies too)."""
    here = list(path.relative_to(root).parts[:-1])  # the file's package, e.g. ["services", "rollout"]
    out = []
    tree = ast.parse(path.read_text(), str(path))
    # ``if TYPE_CHECKING:`` imports are for annotations only: never run, no dependency
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from services import world`` imports the package named after "import"
            out += [(node.lineno, f"{module}.{a.name}" if module == "services" else module) for a in node.names]
    return out


def module_imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported module, 'file:line') for every import of another package."""
    edges = []
    for path in sorted((root / "services").rglob("*.py")):
        own = _package(".".join(path.relative_to(root).with_suffix("").parts))
        if own is None:  # services/__init__.py
            continue
        for line, module in _imports(path, root):
            other = _package(module)
            if other is not None and other != own:
                edges.append((own, module, f"{path.relative_to(root)}:{line}"))
    return edges


def package_imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported package, 'file:line') for every cross-package import."""
    return [(own, _package(module), where) for own, module, where in module_imports(root)]


def test_every_package_has_a_floor():
    found = {p.stem if p.is_file() else p.name for p in (ROOT / "services").iterdir()
             if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert found == set(FLOOR), f"add new packages to FLOORS: {sorted(found ^ set(FLOOR))}"


def test_packages_import_only_downward():
    order = " < ".join("{" + ", ".join(f) + "}" if len(f) > 1 else f[0] for f in FLOORS)
    wrong = [f"{where}: {own} imports {other}" + (" (side by side)" if FLOOR[other] == FLOOR[own] else "")
             for own, other, where in package_imports()
             if FLOOR[other] >= FLOOR[own] and not _composes(f"services.{other}.settings", where)]
    assert not wrong, f"imports against the floors {order}:\n" + "\n".join(wrong)


def test_the_services_import_no_other_service():
    sideways = [f"{where}: {own} imports {other}" for own, other, where in package_imports()
                if own in SERVICES and other in SERVICES]
    assert not sideways, ("a service imports another; move what they share into services/common/:\n"
                          + "\n".join(sideways))


def test_the_world_uses_the_services_only_where_it_must():
    used = {(module, where) for own, module, where in module_imports() if own == "world" and _package(module) in SERVICES}
    extra = sorted(f"{where}: world imports {module}" for module, where in used if module not in WORLD_USES)
    assert not extra, "the world imports a service module outside WORLD_USES (move it to common):\n" + "\n".join(extra)
    assert {m for m, _ in used} == set(WORLD_USES), "WORLD_USES names a module the world no longer imports"


def test_the_check_sees_function_local_relative_and_package_imports(tmp_path):
    probe = tmp_path / "services" / "rollout" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from services import scorer\n\n\ndef f():\n    from services.world.build import build_world\n\n\n"
                     "from ..learner import loss\nfrom . import agent\nimport services.common.codec\n")
    edges = {(own, other) for own, other, _where in package_imports(tmp_path)}
    assert edges == {("rollout", "scorer"), ("rollout", "world"), ("rollout", "learner"), ("rollout", "common")}
    modules = {module for _own, module, _where in module_imports(tmp_path)}
    assert modules == {"services.scorer", "services.world.build", "services.learner", "services.common.codec"}


def test_common_imports_nothing_above_it():
    # the config is composed above common (services/config.py), so common stands on its own
    outside = [f"{where}: common imports {module}" for own, module, where in module_imports() if own == "common"]
    assert not outside, "common imports beyond itself:\n" + "\n".join(outside)


def test_the_config_composition_imports_only_settings_modules_that_cannot_import_it_back():
    upward = [(module, where) for own, module, where in module_imports()
              if own == "config" and FLOOR[_package(module)] > FLOOR["config"]]
    assert upward and all(_composes(module, where) for module, where in upward), upward
    settings = sorted((ROOT / "services").glob("*/settings.py"))
    assert {f"services.{p.parent.name}.settings" for p in settings} == {m for m, _ in upward} | {"services.common.settings"}
    # a settings module, and each config leaf, imports only config leaves (never services.config)
    for path in settings + [ROOT / (leaf.replace(".", "/") + ".py") for leaf in CONFIG_LEAVES]:
        wrong = [f"{path.relative_to(ROOT)}:{line}: {module}" for line, module in _imports(path, ROOT)
                 if module.startswith("services") and module not in CONFIG_LEAVES]
        assert not wrong, "a settings module or config leaf imports beyond the config leaves:\n" + "\n".join(wrong)
