"""Every command README.md shows works as written, checked without running anything heavy.

For each shell line in the README's code blocks:

- ``mempo SUB ...`` (or ``.venv/bin/mempo``, ``python -m services.world`` / ``services.config``):
  ``mempo SUB --help`` exits 0, and the line's own arguments go through the CLI's own parser
  (``services.cli.main``; each subcommand's argparse parser is stopped right after it parses, and
  ``load_config`` right after it validates, so nothing deploys, trains or builds). The config file
  and ``key=value`` overrides are validated by the function the CLI applies them with
  (``services.cli._load`` -> ``services.config.load_config``): an unknown field fails.
- ``make TARGET [VAR=value ...]``: TARGET is a Makefile target and VAR a variable the Makefile
  reads; ``CONFIG=`` must exist, ``ARGS="..."`` overrides are validated like the CLI's and
  ``VARIANTS=`` (like ``--variants``) names registered baselines.
- ``curl http://HOST:PORT/PATH -d BODY``: HOST:PORT is where ``mempo serve`` listens by default,
  PATH is a service's route prefix (``services.pipeline.apps.route_prefix``) plus one of its
  FastAPI routes, and BODY is JSON that validates against one of the request models the route
  documents (its OpenAPI requestBody).
- any other line (``serve deploy``, ``kubectl apply``, ``python bench/...``): the repository paths it
  names exist.

Also every repository path and local link the README mentions (code or prose) exists, with the
heading a link's #anchor names, and no doc names a relative path that leaves the repository (a
file a user's clone does not have). A failure names the README line. No Ray, no model: a few seconds (importing the scorer's module imports torch).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import re
import shlex
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAKEFILE = ROOT / "Makefile"
TOOLS = ("mempo", "make", "curl", "python", "serve", "kubectl", "ray", "tensorboard")
PY_MODULES = {"services.world": ["world"], "services.config": ["config"], "services.cli": []}
PATH_ROOTS = ("deploy/", "docs/", "bench/", "services/", "tests/", "scripts/")


def _tokens(text: str) -> list[str] | None:
    try:
        return shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on on the next line
        return None


def readme_commands() -> list[tuple[int, str, list[str]]]:
    """(line number, the command's text, its argv) of every shell command in README.md's code blocks."""
    out: list[tuple[int, str, list[str]]] = []
    lines = README.read_text().splitlines()
    in_block, lang, i = False, "", 0
    variables: dict[str, list[str]] = {}  # shell variables assigned earlier in the block
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            in_block, lang = not in_block, line.strip()[3:].strip()
            variables = {}
            i += 1
            continue
        if not in_block or lang not in ("", "bash", "sh", "shell", "console") or not line.strip():
            i += 1
            continue
        start, text = i + 1, line.strip().removeprefix("$ ")
        argv = None
        while True:  # join continued lines: a trailing backslash or an open quote
            if not text.endswith("\\"):
                argv = _tokens(text)
                if argv is not None or i + 1 >= len(lines):
                    break
            i += 1
            text = text.removesuffix("\\") + ("\n" if not text.endswith("\\") else " ") + lines[i].strip()
        i += 1
        if argv and len(argv) == 1 and (assign := re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(.*)", argv[0], re.S)):
            variables[assign[1]] = assign[2].split()  # D="a=1 b=2": $D below expands to its words
            continue
        argv = [w for token in (argv or []) for w in (variables[token[1:]] if token[1:] in variables
                                                        and token.startswith("$") else [token])]
        for part in _commands(argv):  # a && b: two commands
            while part and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", part[0]):  # FOO=bar mempo ...
                part = part[1:]
            if part and Path(part[0]).name in TOOLS:
                out.append((start, text, part))
    return out


def _commands(argv: list[str]) -> list[list[str]]:
    """The commands of one line: ``a && b`` is two."""
    out = [[]]
    for token in argv:
        if token == "&&":
            out.append([])
        else:
            out[-1].append(token)
    return out


COMMANDS = readme_commands()


def where(n: int, text: str) -> str:
    return f"README.md line {n}: `{text.splitlines()[0]}{' ...' if chr(10) in text else ''}`"


def by_tool(*tools: str) -> list:
    picked = []
    for n, text, argv in COMMANDS:
        tool = Path(argv[0]).name
        if tool == "python" and len(argv) > 2 and argv[1] == "-m" and argv[2] in PY_MODULES:
            tool = "mempo"
        if tool in tools:
            picked.append(pytest.param(n, text, argv, id=f"README.md:{n}"))
    return picked


def mempo_argv(argv: list[str]) -> list[str]:
    """The arguments ``services.cli.main`` gets for a README line."""
    if Path(argv[0]).name == "python":
        return PY_MODULES[argv[2]] + argv[3:]
    return argv[1:]


class _Parsed(BaseException):
    """Raised right after a subcommand's parser accepted the line (BaseException: main() catches none)."""

    def __init__(self, namespace):
        self.namespace = namespace


class _Loaded(BaseException):
    """Raised right after ``load_config`` validated a config (for subcommands without argparse: world, config)."""

    def __init__(self, cfg):
        self.cfg = cfg


@contextlib.contextmanager
def stopped_after_parsing():
    """Patch argparse's entry points and load_config so that a CLI command stops right after it has
    parsed its arguments, or validated its config, before it does anything."""
    import services.cli  # noqa: F401  (and what it imports, so every module holding load_config is loaded)
    import services.world.__main__  # noqa: F401
    from services import config

    real_load = config.load_config

    def parse(original):
        def stop(self, *args, **kwargs):
            raise _Parsed(original(self, *args, **kwargs))
        return stop

    def load(*args, **kwargs):
        raise _Loaded(real_load(*args, **kwargs))

    holders = [m for m in list(sys.modules.values())
               if m is not None and getattr(m, "__dict__", {}).get("load_config") is real_load]
    saved = (argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_intermixed_args)
    argparse.ArgumentParser.parse_args = parse(saved[0])
    argparse.ArgumentParser.parse_intermixed_args = parse(saved[1])
    for m in holders:
        m.load_config = load
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_intermixed_args = saved
        for m in holders:
            m.load_config = real_load


def run_cli(argv: list[str]):
    """(outcome, return code, output) of ``services.cli.main(argv)`` stopped after parsing."""
    from services.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), stopped_after_parsing():
        try:
            return "returned", main(list(argv)), out.getvalue()
        except SystemExit as e:
            return "exit", e.code or 0, out.getvalue()
        except _Parsed as p:
            return p, 0, out.getvalue()
        except _Loaded as p:
            return p, 0, out.getvalue()


def check_config_args(args: list[str], line: str) -> None:
    """A config file and ``key=value`` overrides, loaded by the function the CLI loads them with."""
    from services import cli

    try:
        cli._load(args)
    except Exception as e:  # ConfigError: an unknown key, a bad value, a missing file
        error = f"{line}: {e}"
    else:
        return
    pytest.fail(error)


def check_variants(spec: str, line: str) -> None:
    """``--variants`` / ``VARIANTS=``: names registered in services/pipeline/compare.py, read by its own parser."""
    from services.pipeline.compare import parse_variants

    try:
        parse_variants(spec)
    except ValueError as e:
        error = f"{line}: {e}"
    else:
        return
    pytest.fail(error)


@pytest.mark.parametrize("n,text,argv", by_tool("mempo"))
def test_mempo_command_parses(n, text, argv):
    line = where(n, text)
    args = mempo_argv(argv)
    assert args, f"{line}: no subcommand"
    sub = args[0]
    outcome, rc, output = run_cli([sub, "--help"])
    assert rc == 0, f"{line}: `mempo {sub} --help` fails (exit {rc}): is `{sub}` a mempo subcommand?\n{output}"
    outcome, rc, output = run_cli(args)
    if isinstance(outcome, _Parsed):
        ns = outcome.namespace
        if isinstance(getattr(ns, "args", None), list):  # a config file and key=value overrides
            check_config_args(ns.args, line)
        if getattr(ns, "variants", None):
            check_variants(ns.variants, line)
        return
    if isinstance(outcome, _Loaded):
        return
    assert rc == 0, f"{line}: `mempo {' '.join(args)}` is refused (exit {rc}):\n{output}"


def makefile_targets_and_vars() -> tuple[set[str], set[str], dict[str, str]]:
    text = MAKEFILE.read_text()
    targets = {g[1] for line in text.splitlines()
               if (g := re.match(r"^([A-Za-z0-9_-][A-Za-z0-9_.-]*)\s*:(?![=])", line))}
    used = set(re.findall(r"\$\(([A-Z_][A-Z0-9_]*)\)", text))
    defaults = dict(re.findall(r"^([A-Z_][A-Z0-9_]*)\s*\?=\s*(.*)$", text, re.M))
    return targets, used, defaults


@pytest.mark.parametrize("n,text,argv", by_tool("make"))
def test_make_command_names_a_target(n, text, argv):
    line = where(n, text)
    targets, used, defaults = makefile_targets_and_vars()
    names = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
    assigned = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
    assert names, f"{line}: no make target"
    for t in names:
        assert t in targets, f"{line}: `make {t}`: no such target in the Makefile ({', '.join(sorted(targets))})"
    for var in assigned:
        assert var in used, f"{line}: `{var}=`: the Makefile never reads $({var})"
    config = assigned.get("CONFIG", defaults.get("CONFIG", "").strip())
    assert (ROOT / config).is_file(), f"{line}: CONFIG={config} does not exist"
    overrides = shlex.split(assigned.get("ARGS", ""))
    if "CONFIG" in assigned or overrides:
        check_config_args([config, *overrides], line)
    if assigned.get("VARIANTS"):
        check_variants(assigned["VARIANTS"], line)


def _curl_parts(argv: list[str]) -> tuple[str, str | None]:
    url, body, i = None, None, 1
    while i < len(argv):
        a = argv[i]
        if a in ("-d", "--data", "--data-raw", "--data-binary", "--json"):
            body, i = argv[i + 1], i + 2
            continue
        if a in ("-H", "--header", "-X", "--request", "-o", "--output", "-m", "--max-time"):
            i += 2
            continue
        if not a.startswith("-"):
            url = a
        i += 1
    return url, body


SERVICE_MODULES = {"scorer": "services.scorer.service", "search": "services.search_tool.service"}


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")  # FastAPI, building the OpenAPI schema
@pytest.mark.parametrize("n,text,argv", by_tool("curl"))
def test_curl_hits_a_real_route_with_a_valid_body(n, text, argv):
    from services.config import load_config
    from services.pipeline.apps import route_prefix

    line = where(n, text)
    url, body = _curl_parts(argv)
    assert url, f"{line}: no URL"
    u = urlparse(url if "://" in url else f"http://{url}")
    cfg = load_config(ROOT / "deploy/configs/tiny.yaml")
    assert (u.hostname in ("127.0.0.1", "localhost") and (u.port or 80) == cfg.ray.http_port), \
        f"{line}: `mempo serve` listens on {cfg.ray.http_host}:{cfg.ray.http_port}, not {u.netloc}"
    matches = []
    for service, module in SERVICE_MODULES.items():
        prefix = (route_prefix(cfg, service) or "").rstrip("/")
        if u.path.startswith(prefix + "/"):
            matches.append((len(prefix), service, module, u.path[len(prefix):]))
    assert matches, f"{line}: {u.path} is under no service's route prefix"
    _, service, module, sub = max(matches)
    mod = importlib.import_module(module)
    methods = "POST" if body is not None else "GET"
    routes = {(r.path, m) for r in mod.app.routes for m in (getattr(r, "methods", None) or ())}
    assert (sub, methods) in routes, \
        f"{line}: the {service} service has no {methods} {sub} (routes: {sorted(p for p, _ in routes)})"
    if body is None:
        return
    try:
        data = json.loads(body)
    except ValueError as e:
        pytest.fail(f"{line}: the body is not JSON as pasted: {e}")
    post = mod.app.openapi()["paths"][sub]["post"]
    schema = post["requestBody"]["content"]["application/json"]["schema"]
    refs = [s["$ref"] for s in schema.get("oneOf", [schema])]
    models = [getattr(mod, r.rsplit("/", 1)[1]) for r in refs]
    errors = []
    for model in models:
        try:
            model.model_validate(data)
            return
        except Exception as e:  # pydantic.ValidationError
            errors.append(f"{model.__name__}: {e}")
    pytest.fail(f"{line}: the body fits none of {sub}'s request models:\n" + "\n".join(errors))


def mentioned_paths() -> list[tuple[int, str, str]]:
    """(line, path, anchor) of every repository path the README names: in code, in prose and in local links."""
    out = []
    for n, line in enumerate(README.read_text().splitlines(), 1):
        for link in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", link):
                path, _, anchor = link.partition("#")
                out.append((n, path or "README.md", anchor))
        for token in re.findall(r"(?<![\w./-])((?:%s)[\w./-]*\w)" % "|".join(map(re.escape, PATH_ROOTS)), line):
            out.append((n, token, ""))
    return out


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_block = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        m = None if in_block else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m[1].strip().lower()).replace(" ", "-")
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_path_and_link_the_readme_names_exists():
    missing = []
    for n, p, anchor in mentioned_paths():
        if "<" in p or "*" in p or "{" in p:
            continue
        target = ROOT / p
        if not target.exists():
            missing.append(f"README.md line {n}: {p} does not exist")
        elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
            missing.append(f"README.md line {n}: {p} has no heading for #{anchor}")
    assert not missing, "\n".join(missing)


def test_no_doc_names_a_path_outside_the_repository():
    """Docs name paths of this repository only: a relative path (``../x/y.md``, in a link or in prose)
    that resolves outside the checkout names a file a user's clone does not have."""
    docs = [README, ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = []
    for d in docs:
        for n, line in enumerate(d.read_text().splitlines(), 1):
            for rel in re.findall(r"(?<![\w/.])((?:\.\./)+[\w.-]+)", line):
                if not (d.parent / rel).resolve().is_relative_to(ROOT):
                    bad.append(f"{d.relative_to(ROOT)} line {n}: {rel}")
    assert not bad, "names a path outside the repository: " + ", ".join(bad)


def test_the_readme_shows_commands():
    """The parser above finds the README's commands (a guard against it silently finding none)."""
    tools = {Path(a[0]).name for _, _, a in COMMANDS}
    assert {"mempo", "make", "curl"} <= tools, tools
