"""The rollout's search client: real calls through the handle and HTTP, retries, failure observations."""

import asyncio

import pytest

from services.config import load_config
from services.rollout.search_client import SearchClient


def _cfg(**kw):
    return load_config("deploy/configs/tiny.yaml", [f"search.{k}={v}" for k, v in kw.items()]).search


@pytest.mark.slow
def test_observation_through_handle_and_http(search_service):
    handle, url = search_service
    for client in (SearchClient.from_handle(handle, _cfg()), SearchClient.from_url(url, _cfg())):
        text, ok = asyncio.run(client.observation("Gerkville city country"))
        assert ok and text.startswith("<information>\nDoc 1 (Title: ") and text.endswith("\n</information>")
        assert text.count("\nDoc ") == 3  # topk 3
        assert client.stats == {"calls": 1, "failures": 0, "retries": 0}


def test_unreachable_service_gives_a_failed_observation_after_retries():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = SearchClient.from_url(f"http://127.0.0.1:{port}", _cfg(retries=2, retry_backoff_s=0.01, timeout_s=2))
    text, ok = asyncio.run(client.observation("anything"))
    assert not ok
    assert text.startswith("<information>\nSearch failed:") and "ConnectError" in text
    assert client.stats == {"calls": 1, "failures": 1, "retries": 2}


def test_hanging_service_times_out_and_is_retried():
    async def run():
        async def never_answer(reader, writer):
            await asyncio.sleep(30)

        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = SearchClient.from_url(f"http://127.0.0.1:{port}", _cfg(retries=1, retry_backoff_s=0.01, timeout_s=0.3))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        text, ok = await client.observation("anything")
        elapsed = loop.time() - t0
        server.close()
        return text, ok, client.stats, elapsed

    text, ok, stats, elapsed = asyncio.run(run())
    assert not ok and "Search failed" in text
    assert stats == {"calls": 1, "failures": 1, "retries": 1}
    assert elapsed < 5
