"""A client of the scorer's REST endpoint: one memory, or a JSONL file of them graded in bulk.

    mempo score memories.jsonl graded.jsonl --url http://127.0.0.1:8000/scorer --concurrency 8

    from services.scorer.client import ScorerClient
    client = ScorerClient("http://127.0.0.1:8000/scorer")          # token from MEMPO_API_TOKEN, if set
    client.score({"question": "...", "memory": "...", "history": [], "answer": "..."})  # -> ScoreResponse's dict
    for i, answer in client.score_many(requests): ...              # several in flight, in input order

Each input line is one request body of ``POST /score`` (services/scorer/schema.py, the models the
service itself validates with), plus an optional ``id`` that is echoed and not sent. Each output line,
in input order, is ``{"line": i, "id"?, "status": 200, ...the response...}`` or, for a request the
service refused (4xx), ``{"line": i, "status": 422, "error": ..., "field": ...}``; a line that is not
a valid request is refused here the same way (status 0), without a call.

What a long job needs: ``concurrency`` requests in flight; a 503 or 429 is retried after the
``Retry-After`` the service sends (the scorer's admission queue, a replica being replaced), a refused
connection or a timeout after an exponential backoff, up to ``retries`` times each; a 401 stops the
run (the token is missing or wrong: no later line would fare better). Lines are written in input
order as they complete, so the output is always a prefix of the input: an interrupted run (Ctrl-C, a
kill) is run again with the same arguments and continues after the last complete output line,
every line once.
"""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional

import httpx
from services.common.http import HttpError, parse_model
from services.common.rest_auth import auth_headers, read_token
from services.scorer.schema import TextScoreRequest, TokenScoreRequest

log = logging.getLogger("mempo.score")
RETRY_STATUS = (429, 502, 503, 504)
DEFAULT_URL = "http://127.0.0.1:8000/scorer"


class AuthError(RuntimeError):
    """The scorer answered 401: the bearer token is missing or not the service's."""


def score_url(url: str) -> str:
    """The ``POST /score`` endpoint of a scorer URL given with or without its ``/score``."""
    base = url.rstrip("/")
    return base if base.endswith("/score") else f"{base}/score"


def client_token(token_env: str = "MEMPO_API_TOKEN", token_file: str = "") -> Optional[str]:
    """The bearer token a client sends: the file's, else the environment variable's, else None."""
    return read_token("auto", token_env, token_file)


class Invalid(str):
    """An input line that is not a JSON object: its message (it gets an output line of status 0)."""


def validated(body: dict) -> dict:
    """``body`` as the service will validate it (text or token form, the service's own models); an
    HttpError naming the field as the service would."""
    if isinstance(body, Invalid):
        raise HttpError(0, "line", str(body))
    model = TokenScoreRequest if "mem_context_ids" in body else TextScoreRequest
    return parse_model(model, body).model_dump(exclude_none=True)


def retry_after_s(value: Optional[str], default: float) -> float:
    """Seconds a ``Retry-After`` header asks for (delta-seconds or an HTTP date), ``default`` without one."""
    if not value:
        return default
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError):
        return default


@dataclass
class Stats:
    """What a bulk run did: lines written by status, retries, and the time it took."""

    by_status: dict = field(default_factory=dict)
    retries: int = 0
    skipped: int = 0
    seconds: float = 0.0
    r_mem_sum: float = 0.0

    def add(self, out: dict) -> None:
        self.by_status[out["status"]] = self.by_status.get(out["status"], 0) + 1
        if out["status"] == 200:
            self.r_mem_sum += out["r_mem"]

    def summary(self) -> str:
        done = sum(self.by_status.values())
        ok = self.by_status.get(200, 0)
        rate = done / self.seconds if self.seconds else 0.0
        mean = f", mean r_mem {self.r_mem_sum / ok:+.4f}" if ok else ""
        refused = {k: v for k, v in sorted(self.by_status.items()) if k != 200}
        return (f"{done} lines in {self.seconds:.1f}s ({rate:.2f}/s): {ok} scored{mean}"
                + (f", refused {refused} (status 0: not a valid request, no call made)" if refused else "")
                + f", {self.retries} retries" + (f"; {self.skipped} already done before this run" if self.skipped else ""))


class ScorerClient:
    """Requests to one scorer (``url``: its base, e.g. ``http://host:8000/scorer``, or ``.../score``).
    Thread-safe; ``concurrency`` bounds the requests ``score_many`` keeps in flight."""

    def __init__(self, url: str = DEFAULT_URL, token: Optional[str] = None, concurrency: int = 8,
                 retries: int = 8, timeout_s: float = 300.0, backoff_s: float = 0.5):
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ValueError("concurrency >= 1, retries >= 0 and timeout_s > 0 are needed")
        self.url = score_url(url)
        self.token = client_token() if token is None else token
        self.concurrency, self.retries, self.backoff_s = concurrency, retries, backoff_s
        self._http = httpx.Client(timeout=timeout_s, headers=auth_headers(self.token),
                                  limits=httpx.Limits(max_connections=concurrency))
        self._lock = threading.Lock()
        self.retried = 0

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ScorerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def post(self, body: dict) -> dict:
        """One request with retries: ``{"status": 200, ...response}`` or ``{"status": 4xx, "error", "field"}``.
        Raises AuthError on 401 and httpx.HTTPError / RuntimeError once the retries are spent."""
        for attempt in range(self.retries + 1):
            wait_s = self.backoff_s * 2 ** attempt * (0.5 + random.random())
            try:
                r = self._http.post(self.url, json=body)
            except httpx.TransportError as e:  # refused, reset, timed out: nothing came back
                if attempt == self.retries:
                    raise
                log.info("POST %s: %s; retry %d in %.1fs", self.url, type(e).__name__, attempt + 1, wait_s)
            else:
                if r.status_code == 401:
                    raise AuthError(f"{self.url} answered 401: " + _error_text(r) + "; set the token in "
                                    "MEMPO_API_TOKEN (or pass --token-file)")
                if r.status_code not in RETRY_STATUS:
                    return _answer(r)
                if attempt == self.retries:
                    raise RuntimeError(f"{self.url} answered {r.status_code} {(r.text or '')[:200]} after "
                                       f"{self.retries} retries")
                wait_s = retry_after_s(r.headers.get("retry-after"), wait_s)
                log.info("POST %s: %d; retry %d in %.1fs", self.url, r.status_code, attempt + 1, wait_s)
            with self._lock:
                self.retried += 1
            time.sleep(wait_s)
        raise AssertionError("unreachable")

    def score(self, body: dict) -> dict:
        """The scorer's answer to one request body (validated here first); ValueError for a request the
        service refused."""
        try:
            out = self.post(validated(body))
        except HttpError as e:
            raise ValueError(f"{e.field}: {e.message}") from None
        if out["status"] != 200:
            raise ValueError(f"{out['status']}: {out.get('field')}: {out.get('error')}")
        return {k: v for k, v in out.items() if k != "status"}

    def score_many(self, bodies: Iterable[dict]) -> Iterator[tuple[int, dict]]:
        """``(index, answer)`` for every body, in input order, with up to ``concurrency`` in flight; an
        answer is ``post``'s (``status`` included), or status 0 with the field for a body that is not a
        valid request. Raises what ``post`` raises (after the requests in flight come back)."""
        done: dict[int, dict] = {}
        inputs = enumerate(bodies)
        nxt = 0
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="score")
        try:
            running: dict = {}
            exhausted = False
            while running or not exhausted:
                while not exhausted and len(running) < 2 * self.concurrency:
                    try:
                        i, body = next(inputs)
                    except StopIteration:
                        exhausted = True
                        break
                    running[pool.submit(self._one, body)] = i
                finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = running.pop(fut)
                    try:
                        done[i] = fut.result()
                    except BaseException:
                        for other in running:
                            other.cancel()
                        raise
                while nxt in done:
                    yield nxt, done.pop(nxt)
                    nxt += 1
        finally:  # an error, Ctrl-C or a consumer that stopped: nothing new starts, nothing waits
            pool.shutdown(wait=False, cancel_futures=True)

    def _one(self, body: dict) -> dict:
        try:
            request = validated(body)
        except HttpError as e:
            return {"status": 0, "error": e.message, "field": e.field}
        return self.post(request)


def _error_text(r: httpx.Response) -> str:
    try:
        body = r.json()
        return f"{body.get('error')} (field {body.get('field')})"
    except ValueError:
        return r.text[:200]


def _answer(r: httpx.Response) -> dict:
    try:
        body = r.json()
    except ValueError:
        body = {"error": r.text[:500], "field": "response"}
    if not isinstance(body, dict):
        body = {"error": f"not a JSON object: {str(body)[:200]}", "field": "response"}
    return {"status": r.status_code, **body}


def done_lines(path: Path) -> int:
    """Complete lines of an earlier run's output (a torn last line, from a kill mid-write, is cut off)."""
    if not path.exists():
        return 0
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with path.open("r+b") as f:
            f.truncate(keep)
    return data[:keep].count(b"\n")


def read_requests(path: Path, skip: int) -> Iterator[tuple[Optional[object], dict]]:
    """``(id, body)`` of each input line after the first ``skip``; a line that is not a JSON object is
    passed on as :class:`Invalid` (it gets its output line of status 0 and keeps the order)."""
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f):
            if n < skip:
                continue
            try:
                body = json.loads(line)
            except json.JSONDecodeError as e:
                yield None, Invalid(f"line {n + 1} is not JSON: {e.msg}")
                continue
            if not isinstance(body, dict):
                yield None, Invalid(f"line {n + 1} is not a JSON object")
                continue
            yield body.pop("id", None), body


def count_lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def score_file(inp: str | Path, out: str | Path, client: ScorerClient, progress: bool = True) -> Stats:
    """Grade every line of ``inp`` into ``out`` (see the module docstring), continuing an earlier,
    interrupted run of the same files; the run's Stats."""
    from tqdm import tqdm  # tqdm on use

    inp, out = Path(inp), Path(out)
    total = count_lines(inp)
    skip = done_lines(out)
    if skip > total:
        raise ValueError(f"{out} has {skip} lines but {inp} only {total}: it is not this input's output")
    stats = Stats(skipped=skip)
    ids: dict[int, object] = {}

    def bodies():
        for k, (id_, body) in enumerate(read_requests(inp, skip)):
            ids[k] = id_
            yield body

    t0 = time.perf_counter()
    retried0 = client.retried
    with out.open("a", encoding="utf-8") as f, tqdm(total=total, initial=skip, unit="line", desc="mempo score",
                                                    disable=not progress, dynamic_ncols=True) as bar:
        for k, answer in client.score_many(bodies()):
            id_ = ids.pop(k, None)
            row = {"line": skip + k, **({"id": id_} if id_ is not None else {}), **answer}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            stats.add(row)
            bar.update(1)
    stats.seconds = time.perf_counter() - t0
    stats.retries = client.retried - retried0
    return stats
