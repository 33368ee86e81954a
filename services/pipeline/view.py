"""``mempo view``: one self-contained HTML page of a run, to see what the agent remembered and what the
memory reward said about it.

    mempo view runs/tiny                 # -> runs/tiny/view.html: open it from file:// (no network)
    mempo view runs/tiny --serve         # serve it on loopback (prints the URL); with a scorer running
                                         # (mempo serve --apps scorer ...) the page re-scores edited memories

Built only from what a run already writes: metrics.jsonl (curves), eval.json and samples.json (the
held-out table and decoded episodes, from ``mempo eval --report`` or ``make run``), groups.jsonl (the
training groups ``mempo train`` samples per step, ``train.sample_groups``) and pipeline.yaml (the
context rule). The data is inlined into the page with the page's script and style
(services/pipeline/view_page.html), so the file opens anywhere. A missing file, a run still in
progress or a truncated line becomes a note on the page, never a traceback.

With ``--serve``, POST /api/score on the view's server forwards the body to the scorer's REST
endpoint (``--scorer``, default the config's Serve port: http://127.0.0.1:<ray.http_port>/scorer/score),
so the page and the scorer need not share an origin.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from services.common.rest_auth import auth_headers
from services.pipeline.report import COLUMNS, DIAGNOSTICS, curve_series

PAGE = Path(__file__).with_name("view_page.html")
MAX_GROUPS = 400  # training groups put into the page (the latest steps' when a run has more)
MAX_BODY = 1 << 20  # bytes a re-score request may carry


def read_jsonl(path: Path, notes: list[str]) -> list[dict]:
    """Rows of a JSONL file; a line that does not parse (a run writing it, a disk that filled) is
    skipped and named in ``notes``."""
    if not path.is_file():
        return []
    rows = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            notes.append(f"{path.name} line {i} is not complete JSON (truncated?); skipped")
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            notes.append(f"{path.name} line {i} is not a JSON object; skipped")
    return rows


def _read_json(path: Path, notes: list[str], what: str) -> dict:
    if not path.is_file():
        notes.append(f"no {path.name}: {what}")
        return {}
    try:
        data = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError as e:
        notes.append(f"{path.name} is not valid JSON ({e.msg} at line {e.lineno}); its panel is empty")
        return {}
    if not isinstance(data, dict):
        notes.append(f"{path.name} is not a JSON object; its panel is empty")
        return {}
    return data


def load_run(run_dir: str | Path) -> dict:
    """Everything the page shows, as plain data, with ``notes`` saying what is missing."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a directory (give a run directory, e.g. runs/tiny)")
    notes: list[str] = []
    config = {}
    if (run / "pipeline.yaml").is_file():
        try:
            config = yaml.safe_load((run / "pipeline.yaml").read_text()) or {}
        except yaml.YAMLError:
            notes.append("pipeline.yaml does not parse; the context rule is unknown")
    else:
        notes.append("no pipeline.yaml: not a `mempo train` run directory, or it never started")
    rows = read_jsonl(run / "metrics.jsonl", notes)
    if not (run / "metrics.jsonl").is_file():
        notes.append("no metrics.jsonl: no curves (run `mempo train` into this directory)")
    metrics = {kind: [r for r in rows if r.get("kind") == kind] for kind in ("train", "eval", "sft")}
    steps = (config.get("train") or {}).get("steps")
    done = max((r.get("step", 0) for r in metrics["train"]), default=0)
    if steps and done < steps:
        notes.append(f"training reached step {done} of {steps}: in progress, or stopped (run the same "
                     f"`mempo train` to resume); the page shows what is there")
    evals = _read_json(run / "eval.json", notes, "no held-out table (run `mempo eval --report` or `make run`)")
    samples = _read_json(run / "samples.json", notes, "no decoded held-out episodes (written by `mempo eval --report`)")
    groups = read_jsonl(run / "groups.jsonl", notes)
    if not (run / "groups.jsonl").is_file():
        notes.append("no groups.jsonl: no training groups (written by `mempo train` when train.sample_groups > 0)")
    elif len(groups) > MAX_GROUPS:
        notes.append(f"groups.jsonl holds {len(groups)} groups; the page shows the latest {MAX_GROUPS}")
        groups = groups[-MAX_GROUPS:]
    rollout = config.get("rollout") or {}
    return {
        "run_dir": str(run), "notes": notes, "memory_window": rollout.get("memory_window", 1),
        "system_prompt": rollout.get("system_prompt"),
        "columns": [[label, key, *_digits(fmt)] for label, key, fmt in COLUMNS],
        "diagnostics": [[label, key] for label, key in DIAGNOSTICS],
        "curves": [{"title": title, "kind": kind, "series": [[key, label] for key, label in series]}
                   for title, kind, series in curve_series(metrics)],
        "metrics": metrics, "eval": {k: v for k, v in evals.items() if k != "search_disabled"},
        "samples": samples, "groups": groups,
    }


def _digits(fmt: str) -> list:
    """'{:+.4f}' -> [4, True]: decimals and whether a sign is shown, for the page's number format."""
    spec = fmt.strip("{}:")
    return [int(spec.split(".")[1].rstrip("f")) if "." in spec else 0, spec.startswith("+")]


def render(data: dict) -> str:
    """The page with ``data`` inlined (``</`` escaped so no string can close the script element)."""
    blob = json.dumps(data, allow_nan=False, default=str).replace("</", "<\\/")
    return PAGE.read_text().replace("/*RUN_DATA*/{}", blob, 1)


def _finite(obj):
    """NaN and infinities (a metric of an empty set) as null: the page is JSON-strict."""
    if isinstance(obj, float):
        return obj if obj == obj and abs(obj) != float("inf") else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def write_view(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/view.html``; returns its path."""
    data = _finite(load_run(run_dir))
    out = Path(run_dir) / "view.html"
    out.write_text(render(data), encoding="utf-8")
    return out


def make_server(run_dir: str | Path, port: int, scorer_url: str, token: str | None = None) -> ThreadingHTTPServer:
    """The view's HTTP server on 127.0.0.1:``port`` (0 = any free port), not yet serving: GET / is the
    page, POST /api/score goes to ``scorer_url`` (with ``token`` as its bearer token, when given)."""
    page = write_view(run_dir)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # quiet: one line per request is noise here
            pass

        def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(code)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, code: int, detail: str) -> None:
            self._send(code, json.dumps({"detail": detail}).encode())

        def do_GET(self):
            if self.path in ("/", "/index.html", "/view.html"):
                self._send(200, page.read_bytes(), "text/html; charset=utf-8")
            elif self.path == "/api/status":
                self._send(200, json.dumps({"scorer": scorer_url}).encode())
            else:
                self._error(404, "not found: the page is at /")

        def do_POST(self):
            if self.path != "/api/score":
                return self._error(404, "not found: POST /api/score")
            try:
                length = int(self.headers.get("content-length", ""))
            except ValueError:
                return self._error(411, "a content-length header is required")
            if not 0 < length <= MAX_BODY:
                return self._error(400 if length <= 0 else 413, f"the body must be 1..{MAX_BODY} bytes of JSON")
            body = self.rfile.read(length)
            req = urllib.request.Request(scorer_url, data=body,  # the scorer's bearer token, when it asks for one
                                         headers={"content-type": "application/json", **auth_headers(token)})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    self._send(r.status, r.read())
            except urllib.error.HTTPError as e:  # the scorer's own 4xx/5xx, passed on as it said it
                self._send(e.code, e.read())
            except (urllib.error.URLError, OSError) as e:
                self._error(502, f"no scorer at {scorer_url} ({e}); start one with `mempo serve --apps scorer "
                                 "CONFIG model.path=DIR` or pass --scorer URL")

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve(run_dir: str | Path, port: int, scorer_url: str, token: str | None = None) -> None:
    """Serve the page until Ctrl-C (see :func:`make_server`)."""
    server = make_server(run_dir, port, scorer_url, token)
    print(f"mempo view: http://127.0.0.1:{server.server_address[1]}/ (page {Path(run_dir) / 'view.html'}; "
          f"re-scoring through {scorer_url}); Ctrl-C stops", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
