"""search.url: its validation, and the HTTP search client against a tiny Search-R1 server started here
(http.server on 127.0.0.1, a free port): the wire format, non-200 answers, bodies that are not JSON or
not Search-R1's shape, timeouts, retries, and the same accounting as the handle path. No Ray."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.config import ConfigError, load_config
from services.rollout.search_client import SearchAnswerError, SearchClient, retrieve_url

DOCS = [{"id": "7", "contents": '"Zentrix Labs"\nZentrix Labs was founded by Ada Quell.'},
        {"id": "9", "contents": '"Kalton"\nKalton is a city in Gerkville.'}]


def _cfg(*overrides: str):
    return load_config("deploy/configs/tiny.yaml", list(overrides))


def _search(**kw):
    return _cfg(*(f"search.{k}={v}" for k, v in kw.items())).search


# -- the setting ---------------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/retrieve",
                                 "https://search.example.org/api/retrieve", "http://localhost", "http://[::1]:9000"])
def test_accepted_urls_are_kept_as_given(url):
    assert _cfg(f"search.url={url}").search.url == url


def test_the_default_is_the_in_cluster_service():
    assert _cfg().search.url == ""


@pytest.mark.parametrize("url, why", [
    ("127.0.0.1:8000", "scheme must be http or https, not 'missing'"),
    ("ftp://h/retrieve", "scheme must be http or https, not 'ftp'"),
    ("http://:8000", "no host"),
    ("http://h:port", "Port could not be cast"),
    ("http://h:70000", "Port out of range"),
    ("http://user:pw@h:8000", "no user or password"),
    ("http://h:8000/retrieve?x=1", "no query or fragment"),
    ("http://h:8000/re trieve", "no whitespace"),
])
def test_other_urls_are_refused_naming_the_setting(url, why):
    with pytest.raises(ConfigError) as e:
        _cfg(f"search.url={url}")
    assert "search.url:" in str(e.value) and why in str(e.value) and "http(s)://host[:port][/path]" in str(e.value)


@pytest.mark.parametrize("url, endpoint", [
    ("http://h:1", "http://h:1/retrieve"), ("http://h:1/", "http://h:1/retrieve"),
    ("http://h:1/retrieve", "http://h:1/retrieve"), ("http://h:1/retrieve/", "http://h:1/retrieve"),
    ("http://h:1/ext-search", "http://h:1/ext-search/retrieve"),
])
def test_with_or_without_retrieve_the_client_posts_to_retrieve(url, endpoint):
    assert retrieve_url(url) == endpoint
    assert SearchClient.from_url(url, _search()).url == endpoint


# -- a tiny Search-R1 server -----------------------------------------------------------------------

class Server:
    """A Search-R1 /retrieve server whose answers the test chooses (``answers``: one per request, the
    last one repeated); records every request body, path and client port."""

    def __init__(self):
        self.answers: list = ["ok"]
        self.requests: list[dict] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: a reused client shows as one port

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "body": body, "port": self.client_address[1]})
                kind = server.answers[min(len(server.requests), len(server.answers)) - 1]
                status, payload = 200, None
                if kind == "ok":
                    payload = {"result": [[{"document": d, "score": 1.0 - i / 10} for i, d in enumerate(DOCS)]
                                          for _ in body["queries"]]}
                elif kind == "plain":  # Search-R1 without return_scores
                    payload = {"result": [DOCS for _ in body["queries"]]}
                elif kind == "500":
                    status, payload = 500, {"error": "index exploded"}
                elif kind == "not json":
                    payload = "<html>proxy error</html>"
                elif kind == "no result":
                    payload = {"results": []}
                elif kind == "short":
                    payload = {"result": []}
                elif kind == "no contents":
                    payload = {"result": [[{"document": {"id": "1", "text": "x"}, "score": 1}] for _ in body["queries"]]}
                elif kind == "slow":
                    time.sleep(3.0)
                    payload = {"result": [[] for _ in body["queries"]]}
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


def _observe(client: SearchClient, *queries: str) -> list[tuple[str, bool]]:
    async def run():
        try:
            return [await client.observation(q) for q in queries]
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_search_r1_answers_become_the_observation(server):
    client = SearchClient.from_url(server.url + "/retrieve", _search())
    [(text, ok)] = _observe(client, "Zentrix Labs founded by")
    assert ok
    assert text == ("<information>\nDoc 1 (Title: Zentrix Labs) Zentrix Labs was founded by Ada Quell.\n"
                    "Doc 2 (Title: Kalton) Kalton is a city in Gerkville.\n</information>")
    assert server.requests == [{"path": "/retrieve", "port": server.requests[0]["port"],
                                "body": {"queries": ["Zentrix Labs founded by"], "topk": 3, "return_scores": True}}]
    assert client.stats == {"calls": 1, "failures": 0, "retries": 0}


def test_hits_carry_documents_and_scores_and_plain_documents_are_taken(server):
    client = SearchClient.from_url(server.url, _search())
    server.answers = ["ok", "plain"]

    async def run():
        try:
            return await client.search(["a", "b"], 2), await client.search(["c"])
        finally:
            await client.aclose()

    scored, plain = asyncio.run(run())
    assert [[h["document"]["id"] for h in hits] for hits in scored] == [["7", "9"], ["7", "9"]]
    assert scored[0][0]["score"] == 1.0
    assert plain == [[{"document": d, "score": None} for d in DOCS]]
    assert [r["body"]["topk"] for r in server.requests] == [2, 3]


def test_one_connection_pool_serves_every_call(server):
    client = SearchClient.from_url(server.url, _search())

    async def run():
        try:
            first = client._client()
            await asyncio.gather(*(client.search([f"q{i}"]) for i in range(3)))
            for i in range(3):
                await client.search([f"r{i}"])
            return first is client._client()
        finally:
            await client.aclose()

    assert asyncio.run(run())
    assert len(server.requests) == 6
    # the sequential calls after the concurrent ones reuse kept-alive connections
    assert {r["port"] for r in server.requests[3:]} <= {r["port"] for r in server.requests[:3]}


@pytest.mark.parametrize("answer, reason", [
    ("500", "answered HTTP 500: {\"error\": \"index exploded\"}"),
    ("not json", "answered a body that is not JSON"),
    ("no result", "expected a JSON object with a 'result' list"),
    ("short", "'result' has 0 lists for 1 queries"),
    ("no contents", "result[0][0].document: expected a document with a string 'contents'"),
])
def test_a_wrong_answer_is_retried_then_counted_as_a_failed_call(server, answer, reason):
    server.answers = [answer]
    client = SearchClient.from_url(server.url, _search(retries=2, retry_backoff_s=0.01))
    [(text, ok)] = _observe(client, "anything")
    assert not ok
    assert text.startswith("<information>\nSearch failed: the search service did not answer (SearchAnswerError: ")
    assert reason in text
    assert len(server.requests) == 3  # the first try and two retries
    assert client.stats == {"calls": 1, "failures": 1, "retries": 2}


def test_the_search_raises_the_answer_error():
    async def run(client):
        with pytest.raises(SearchAnswerError, match="HTTP 500"):
            await client.search(["q"])
        await client.aclose()

    s = Server()
    try:
        s.answers = ["500"]
        asyncio.run(run(SearchClient.from_url(s.url, _search(retries=0))))
    finally:
        s.close()


def test_a_failed_try_then_an_answer_counts_a_retry_only(server):
    server.answers = ["500", "ok"]
    client = SearchClient.from_url(server.url, _search(retries=2, retry_backoff_s=0.01))
    [(text, ok)] = _observe(client, "anything")
    assert ok and "Doc 1 (Title: Zentrix Labs)" in text
    assert client.stats == {"calls": 1, "failures": 0, "retries": 1}


def test_a_slow_server_times_out_on_every_try(server):
    server.answers = ["slow"]
    client = SearchClient.from_url(server.url, _search(retries=1, retry_backoff_s=0.01, timeout_s=0.5))
    t0 = time.perf_counter()
    [(text, ok)] = _observe(client, "anything")
    elapsed = time.perf_counter() - t0
    assert not ok and "Search failed" in text and "Timeout" in text
    assert client.stats == {"calls": 1, "failures": 1, "retries": 1}
    # two tries of 0.5 s each, not the server's 3 s each (a loaded machine may not have logged both yet)
    assert 1.0 <= elapsed < 5.0 and 1 <= len(server.requests) <= 2


class FailingHandle:
    """A Serve handle whose search always raises, as a dead search replica's does."""

    class _Method:
        async def remote(self, queries, topk):
            raise RuntimeError("replica died")

    search = _Method()


def test_both_paths_count_a_failure_alike(server):
    server.answers = ["500"]
    cfg = _search(retries=1, retry_backoff_s=0.01)
    by_handle, by_url = SearchClient.from_handle(FailingHandle(), cfg), SearchClient.from_url(server.url, cfg)
    [(h_text, h_ok)] = _observe(by_handle, "q")
    [(u_text, u_ok)] = _observe(by_url, "q")
    assert (h_ok, u_ok) == (False, False)
    prefix = "<information>\nSearch failed: the search service did not answer ("
    assert h_text.startswith(prefix) and u_text.startswith(prefix)
    assert by_handle.stats == by_url.stats == {"calls": 1, "failures": 1, "retries": 1}
