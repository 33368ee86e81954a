"""The packages of services/ import only downward, function-local imports included.

    common < search_tool < rollout < scorer < learner < world < pipeline < cli

A package may import itself and the packages below it. The services (common .. learner) never
import the world: the pipeline builds it and deploys concrete paths (services/common/paths.py).
The world generates with the services' code (BM25 index, rewards, formatting). A strict order over
packages also rules out import cycles between them.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("common", "search_tool", "rollout", "scorer", "learner", "world", "pipeline", "cli")
RANK = {name: i for i, name in enumerate(LAYERS)}


def _package(module: str) -> str | None:
    """'services.rollout.agent' -> 'rollout'; None for anything outside services."""
    parts = module.split(".")
    return parts[1] if parts[0] == "services" and len(parts) > 1 and parts[1] != "__init__" else None


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, at any depth (function bodies too)."""
    here = list(path.relative_to(root).parts[:-1])  # the file's package, e.g. ["services", "rollout"]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from services import world`` imports the package named after "import"
            out += [(node.lineno, f"{module}.{a.name}" if module == "services" else module) for a in node.names]
    return out


def package_imports(root: Path = ROOT) -> list[tuple[str, str, str]]:
    """(importing package, imported package, 'file:line') for every cross-package import."""
    edges = []
    for path in sorted((root / "services").rglob("*.py")):
        own = _package(".".join(path.relative_to(root).with_suffix("").parts))
        if own is None:  # services/__init__.py
            continue
        for line, module in _imports(path, root):
            other = _package(module)
            if other is not None and other != own:
                edges.append((own, other, f"{path.relative_to(root)}:{line}"))
    return edges


def test_every_package_has_a_layer():
    found = {p.stem if p.is_file() else p.name for p in (ROOT / "services").iterdir()
             if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert found == set(LAYERS), f"add new packages to LAYERS: {sorted(found ^ set(LAYERS))}"


def test_packages_import_only_downward():
    upward = [f"{where}: {own} imports {other}" for own, other, where in package_imports() if RANK[other] > RANK[own]]
    assert not upward, "imports against the layer order " + " < ".join(LAYERS) + ":\n" + "\n".join(upward)


def test_the_check_sees_function_local_relative_and_package_imports(tmp_path):
    probe = tmp_path / "services" / "rollout" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text("from services import scorer\n\n\ndef f():\n    from services.world.build import build_world\n\n\n"
                     "from ..learner import loss\nfrom . import agent\nimport services.common.codec\n")
    edges = {(own, other) for own, other, _where in package_imports(tmp_path)}
    assert edges == {("rollout", "scorer"), ("rollout", "world"), ("rollout", "learner"), ("rollout", "common")}
