"""The shared JSON body reader and error shape: every unusable body is one 4xx, never an exception
that would become a 500; FastAPI's own errors and /docs in the same shape."""

import asyncio
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from services.common.http import HttpError, document_body, install_error_handlers, parse_model, read_json


def _request(body: bytes, chunks: int = 1, content_length: bool = True) -> Request:
    size = max(1, len(body) // chunks)
    parts = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0)

    headers = [(b"content-length", str(len(body)).encode())] if content_length else []
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def _read(body: bytes, max_bytes: int = 10_000, **kw):
    return asyncio.run(read_json(_request(body, **kw), max_bytes))


def _error(body: bytes, **kw) -> HttpError:
    with pytest.raises(HttpError) as e:
        _read(body, **kw)
    return e.value


@pytest.mark.parametrize("body,status,field", [
    (b"{not json", 400, "body"),
    (b"", 400, "body"),
    (b'{"topk": ' + b"7" * 5000 + b"}", 400, "body"),                  # over Python's int max str digits
    (b"[" * 5000 + b"]" * 5000, 400, "body"),                           # RecursionError in the parser
    (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "body"),          # parses, deeper than MAX_DEPTH
    (b'{"x": NaN}', 400, "body"),
    (b'{"x": -Infinity}', 400, "body"),
    (b'{"x": 1e400}', 400, "body"),                                      # overflows to inf
    (b'{"q": "\xff\xfe"}', 400, "body"),                                 # invalid UTF-8
    (b"[1, 2]", 422, "body"),
    (b'"text"', 422, "body"),
    (b'{"queries": ["ok", "bad \\ud800 surrogate"]}', 422, "queries.1"),
    (b'{"history": [{"role": "user", "content": "\\udfff"}]}', 422, "history.0.content"),
    (b'{"\\ud800": 1}', 422, "\\ud800"),                                 # a key: named escaped
])
def test_unusable_bodies_are_one_4xx(body, status, field):
    e = _error(body)
    assert (e.status, e.field) == (status, field), e.message
    r = e.response()
    assert r.status_code == status and json.loads(r.body) == {"error": e.message, "field": field}


def test_size_limit_holds_without_content_length_and_while_streaming():
    body = json.dumps({"q": "x" * 5000}).encode()
    assert _error(body, max_bytes=1000).status == 413
    assert _error(body, max_bytes=1000, chunks=10, content_length=False).status == 413
    assert _read(body, max_bytes=10_000, chunks=7, content_length=False) == {"q": "x" * 5000}


def test_valid_text_passes_untouched():
    body = '{"q": "Café \\u00e9 日本 \\ud83d\\ude00 <|im_end|>", "n": 3, "f": 1.5}'.encode()
    assert _read(body) == {"q": "Café é 日本 😀 <|im_end|>", "n": 3, "f": 1.5}


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr


class Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: StrictStr | list[StrictStr]
    turns: list[Inner] = []
    topk: StrictInt | None = None


@pytest.mark.parametrize("data,field", [
    ({"question": 3}, "question"),
    ({"question": ["a", 3]}, "question.1"),             # the deepest error, union tags dropped
    ({"question": "a", "topk": True}, "topk"),           # a bool is not an int
    ({"question": "a", "topk": 2.0}, "topk"),
    ({"question": "a", "turns": [{"role": 1}]}, "turns.0.role"),
    ({"question": "a", "bogus-key": 1}, "bogus-key"),
    ({}, "question"),
])
def test_parse_model_names_the_field(data, field):
    with pytest.raises(HttpError) as e:
        parse_model(Outer, data)
    assert e.value.status == 422 and e.value.field == field


def test_fastapi_errors_share_the_shape_and_docs_show_the_body():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/thing")
    async def thing(request: Request):
        return await read_json(request, 100)

    document_body(app, "/thing", Outer)
    client = TestClient(app)
    r = client.get("/thing")
    assert r.status_code == 405 and set(r.json()) == {"error", "field"}
    r = client.get("/nowhere")
    assert r.status_code == 404 and r.json()["field"] == "request"
    schema = client.get("/openapi.json").json()
    body = schema["paths"]["/thing"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/Outer"}
    assert {"Outer", "Inner"} <= set(schema["components"]["schemas"])


def test_a_body_that_never_arrives_is_a_503_with_retry_after_not_a_hang():
    # what a replica gets when Serve's proxy re-sends a request after its first replica died: the
    # headers, and no body (the dead replica had taken it); found by `mempo chaos`
    async def receive():
        await asyncio.sleep(3600)

    request = Request({"type": "http", "method": "POST", "path": "/",
                       "headers": [(b"content-length", b"12")]}, receive)
    with pytest.raises(HttpError) as e:
        asyncio.run(read_json(request, 10_000, timeout_s=0.2))
    assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
    assert "did not arrive within 0.2s (0 of 12 bytes)" in e.value.message
    assert _read(b'{"a": 1}') == {"a": 1}  # a body that is there is read as before
