"""Serve's proxy with mempo's middleware: a request whose replica died before answering is a 503 with
Retry-After (found by `mempo chaos`: a scorer replica killed with a REST request in flight gave a 500);
every answer a replica started passes through as it was."""

import asyncio
import json
import os

import httpx
import pytest

from services.common.proxy_middleware import LostReplicaRetry


def _call(app, disconnect: bool = False) -> list[dict]:
    sent = []

    async def receive():
        return {"type": "http.disconnect"} if disconnect else {"type": "http.request", "body": b"{}"}

    async def send(message):
        sent.append(message)

    asyncio.run(LostReplicaRetry(app)({"type": "http", "path": "/score"}, receive, send))
    return sent


def test_no_answer_from_the_proxy_becomes_a_503_with_retry_after():
    async def proxy_that_lost_its_replica(scope, receive, send):
        return None  # what Serve's proxy does after the replica's actor error: nothing sent

    start, body = _call(proxy_that_lost_its_replica)
    assert start["status"] == 503 and (b"retry-after", b"1") in start["headers"]
    assert json.loads(body["body"])["field"] == "replica"


def test_an_answer_the_replica_started_passes_through_and_a_gone_client_gets_nothing():
    async def replica_500(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})

    assert [m.get("status") for m in _call(replica_500)] == [500, None]  # ours to fix, not to hide

    async def client_left(scope, receive, send):
        await receive()  # the proxy sees the disconnect and gives up

    assert _call(client_left, disconnect=True) == []


@pytest.mark.slow
def test_a_replica_that_dies_mid_request_is_a_503_through_serves_real_proxy(serve_http):
    from fastapi import FastAPI
    from ray import serve

    app = FastAPI()

    @serve.deployment(max_ongoing_requests=2)
    @serve.ingress(app)
    class Dies:
        @app.post("/")
        async def crash(self):
            os._exit(1)  # the replica's process dies with the request in it

    serve.run(Dies.bind(), name="proxy-dies", route_prefix="/proxy-dies")
    try:
        r = httpx.post(f"{serve_http}/proxy-dies/", json={}, timeout=60)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", (r.status_code, r.text)
        assert r.json()["field"] == "replica"
    finally:
        serve.delete("proxy-dies")
