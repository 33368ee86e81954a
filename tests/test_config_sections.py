"""The section map (services/config.py) is what the packages declare, and it covers
every config section the services' code reads: a scan of each package for ``cfg.<section>``."""

import ast
from pathlib import Path

import pytest

from services.config import MempoConfig
from services.config import sections_read

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("search_tool", "rollout", "scorer", "learner")
SECTION_NAMES = set(MempoConfig.model_fields)
CONFIG_NAMES = {"cfg", "config"}  # what the services call a config (``cfg.x``, ``self.cfg.x``, ``config["x"]``)


def config_reads(package_dir: Path) -> set[str]:
    """"section" or "section.field" for every read of the config tree in the package's code:
    ``cfg.rollout.n`` -> "rollout.n", ``cfg.search`` passed whole -> "search", ``config["ray"]`` -> "ray"."""
    reads = set()
    for path in sorted(package_dir.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            base = node.value if isinstance(node, (ast.Attribute, ast.Subscript)) else None
            is_config = (isinstance(base, ast.Name) and base.id in CONFIG_NAMES) or (
                isinstance(base, ast.Attribute) and base.attr in CONFIG_NAMES)
            if not is_config:
                continue
            if isinstance(node, ast.Attribute):
                section = node.attr
            elif isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                section = node.slice.value
            else:
                continue
            if section not in SECTION_NAMES:
                continue
            up = parents.get(node)
            fields = MempoConfig.model_fields[section].annotation.model_fields
            if isinstance(up, ast.Attribute) and up.value is node and up.attr in fields:
                reads.add(f"{section}.{up.attr}")
            else:
                reads.add(section)
    return reads


def covered(read: str, keep: tuple[str, ...] | None) -> bool:
    return keep is None or read.split(".")[0] in keep or read in keep


def test_each_service_reads_what_its_package_declares():
    assert sections_read("search_tool") == ("search", "world", "ray")
    assert sections_read("rollout") == ("rollout", "model", "engine", "search", "world", "ray", "learner.tempered_logprobs",
                                         "learner.lora")
    assert sections_read("scorer") == ("scorer", "model", "engine", "rollout.system_prompt", "world", "ray",
                                       "learner.lora")
    assert sections_read("learner") is None  # every section: any change restarts it
    with pytest.raises(ValueError, match="unknown service package 'critic'"):
        sections_read("critic")


@pytest.mark.parametrize("package", PACKAGES)
def test_the_code_reads_no_section_its_package_does_not_declare(package):
    keep = sections_read(package)
    reads = config_reads(ROOT / "services" / package)
    assert reads, f"the scan found no config read in services/{package}: it no longer sees how the code reads it"
    missing = sorted(r for r in reads if not covered(r, keep))
    assert not missing, (f"services/{package} reads {missing} but its settings.py READS does not name them: a change "
                         f"there would leave its running replicas on the old value")


def test_the_scan_sees_attribute_chains_whole_sections_and_subscripts(tmp_path):
    (tmp_path / "probe.py").write_text(
        "def f(cfg, self, config):\n"
        "    a = cfg.learner.lr\n"
        "    b = self.cfg.rollout.system_prompt\n"
        "    c = helper(cfg.search)\n"
        "    d = config['ray']['http_port']\n"
        "    e = other.learner.lr\n")
    assert config_reads(tmp_path) == {"learner.lr", "rollout.system_prompt", "search", "ray"}
    assert not covered("learner.lr", sections_read("scorer")) and covered("rollout.system_prompt", sections_read("scorer"))
