"""The scorer's REST client (services/scorer/client.py, `mempo score`) against an HTTP server that
answers as the scorer's protocol says (503/429 with Retry-After, 401, 422 in the {error, field} shape):
retries, order, resume. Against the real scorer: tests/scorer/test_score_cli.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.scorer.client import AuthError, ScorerClient, done_lines, retry_after_s, score_file, score_url

GOOD = {"question": "Where was Ada born?", "memory": "Ada was born in Kestrel.", "history": [], "answer": "Kestrel"}


class Protocol:
    """A server speaking the scorer's REST protocol: each body's memory says how it is answered."""

    def __init__(self, busy_first: int = 0, retry_after: str = "0.2", token: str | None = None):
        self.busy_left, self.retry_after, self.token = busy_first, retry_after, token
        self.bodies, self.lock = [], threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                with outer.lock:
                    outer.bodies.append((time.monotonic(), body, self.headers.get("authorization")))
                    busy = outer.busy_left > 0
                    outer.busy_left -= busy
                if outer.token and self.headers.get("authorization") != f"Bearer {outer.token}":
                    return self.answer(401, {"error": "no token", "field": "authorization"})
                if busy:
                    return self.answer(503, {"error": "busy", "field": "queue"}, {"Retry-After": outer.retry_after})
                if body["memory"] == "refuse":
                    return self.answer(422, {"error": "too long", "field": "memory"})
                time.sleep(0.05 * (hash(body["question"]) % 3))  # answers come back out of order
                n = len(body["memory"])
                self.answer(200, {"p_mem": 1 / (1 + n), "p_full": 0.0, "r_mem": 1 / (1 + n), "q": body["question"]})

            def answer(self, code, obj, headers=None):
                data = json.dumps(obj).encode()
                self.send_response(code)
                for k, v in {"content-type": "application/json", "content-length": str(len(data)),
                             **(headers or {})}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/scorer"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def protocol():
    servers = []

    def make(**kw):
        servers.append(Protocol(**kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_file_is_graded_in_input_order_with_requests_in_flight(protocol, tmp_path):
    server = protocol()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [dict(GOOD, question=f"q{i}", memory="m" * i) for i in range(30)]
    rows[7] = dict(rows[7], memory="refuse")
    with inp.open("w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(dict(r, id=f"row-{i}") if i % 2 else r) + "\n")
        f.write("not json\n")
        f.write('["a list"]\n')
        f.write(json.dumps({"question": "q", "memory": 3, "answer": "a"}) + "\n")  # refused here, no call
    with ScorerClient(server.url, token="", concurrency=6) as client:
        stats = score_file(inp, out, client, progress=False)
    got = lines(out)
    assert [g["line"] for g in got] == list(range(33))
    assert [g.get("q") for g in got[:30] if g["status"] == 200] == [f"q{i}" for i in range(30) if i != 7]
    assert [g.get("id") for g in got[:4]] == [None, "row-1", None, "row-3"]
    assert got[7] == {"line": 7, "id": "row-7", "status": 422, "error": "too long", "field": "memory"}
    assert [g["status"] for g in got[30:]] == [0, 0, 0] and got[32]["field"] == "memory"
    assert len(server.bodies) == 30  # the 3 bad lines were never sent
    assert all("id" not in b for _, b, _ in server.bodies)
    assert stats.by_status == {200: 29, 422: 1, 0: 3} and "29 scored" in stats.summary()


def test_busy_answers_are_retried_after_their_retry_after(protocol, tmp_path):
    server = protocol(busy_first=3, retry_after="0.3")
    with ScorerClient(server.url, token="", concurrency=1, retries=5, backoff_s=0.01) as client:
        assert client.score(GOOD)["r_mem"] > 0
        assert client.retried == 3
    times = [t for t, _, _ in server.bodies]
    assert all(b - a >= 0.3 for a, b in zip(times, times[1:]))  # the server's Retry-After, not the 0.01 s backoff


def test_retries_end_with_an_error_and_401_stops_the_run(protocol, tmp_path):
    with ScorerClient(protocol(busy_first=10, retry_after="0").url, token="", retries=2, backoff_s=0.01) as client:
        with pytest.raises(RuntimeError, match="503.*after 2 retries"):
            client.score(GOOD)
    server = protocol(token="t" * 20)
    with ScorerClient(server.url, token="", concurrency=2) as client:
        with pytest.raises(AuthError, match="401.*MEMPO_API_TOKEN"):
            client.score(GOOD)
    with ScorerClient(server.url, token="t" * 20) as client:
        assert client.score(GOOD)["p_mem"] > 0
    assert server.bodies[-1][2] == "Bearer " + "t" * 20


def test_an_interrupted_run_goes_on_after_its_last_complete_line_every_line_once(protocol, tmp_path):
    server = protocol()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(dict(GOOD, question=f"q{i}")) + "\n" for i in range(12)))
    with ScorerClient(server.url, token="", concurrency=3) as client:
        score_file(inp, out, client, progress=False)
    full = out.read_text().splitlines()
    out.write_text("\n".join(full[:5]) + "\n" + full[5][:17])  # a kill mid-write: 5 lines and a torn one
    with ScorerClient(server.url, token="", concurrency=3) as client:
        stats = score_file(inp, out, client, progress=False)
    assert out.read_text().splitlines() == full and stats.skipped == 5 and sum(stats.by_status.values()) == 7
    assert done_lines(out) == 12
    with ScorerClient(server.url, token="", concurrency=3) as client:  # nothing left: nothing sent
        n = len(server.bodies)
        score_file(inp, out, client, progress=False)
        assert len(server.bodies) == n
    short = tmp_path / "short.jsonl"
    short.write_text("{}\n")
    with pytest.raises(ValueError, match="not this input's output"):
        score_file(short, out, ScorerClient(server.url, token=""), progress=False)


def test_urls_and_retry_after_forms():
    assert score_url("http://h:8000/scorer") == score_url("http://h:8000/scorer/score/") == "http://h:8000/scorer/score"
    assert retry_after_s("2", 9.0) == 2.0 and retry_after_s(None, 9.0) == 9.0 and retry_after_s("soon", 9.0) == 9.0
    assert 0 <= retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT", 9.0) == 0.0  # a date in the past: now
