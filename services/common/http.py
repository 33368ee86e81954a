"""Shared pieces of the services' REST endpoints: one error type, one JSON body reader, docs.

    body = await read_json(request, max_bytes)          # 413 / 400 / 422 as HttpError
    req = parse_model(RetrieveRequest, body)            # 422 naming the offending field
    except HttpError as e: return e.response()          # {"error": ..., "field": ...}

Every way a body can be unusable is a 4xx with that one shape, never a 5xx: a body over the byte
limit (413, checked while it streams in), bytes that are not UTF-8 JSON, a number with more digits
than Python parses (ValueError), nesting deeper than the parser's recursion limit (RecursionError)
or than ``MAX_DEPTH`` (checked by a loop, not by recursion), NaN / Infinity / an overflowing float (400), a
string with a lone UTF-16 surrogate such as ``"\\ud800"`` (422 naming the field: it would break
the tokenizer or any UTF-8 encoder later), and anything that is not a JSON object (422). A body that
does not arrive (``BODY_TIMEOUT_S``) is a 503 with Retry-After: the one 5xx, and safe to send again.
``install_error_handlers`` gives FastAPI's own errors (404, 405, a validation error) the same
shape, and ``document_body`` puts a request model into the OpenAPI schema (/docs) without letting
FastAPI parse the body itself.
"""

from __future__ import annotations

import asyncio
import json
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

MAX_DEPTH = 64  # nesting of a request body; ours need 3
# How long a replica waits for a request's body. Serve's proxy holds the whole body when it sends a request on,
# so it comes at once; but a request the proxy re-sends after its first replica died reaches the new replica
# with no body at all (the dead one had taken it: seen in `mempo chaos`), and would wait until the client
# gave up. After this many seconds it is answered 503 with Retry-After: nothing was done, send it again.
BODY_TIMEOUT_S = 15.0
# pydantic adds the tried member of a union (``str``, ``list[str]``) to an error's location
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "tuple", "set", "none"}


class HttpError(Exception):
    """A client error: HTTP status, the offending field, and what is wrong with it."""

    def __init__(self, status: int, field: str, message: str, headers: dict | None = None):
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message, self.headers = status, field, message, headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message, "field": self.field}, status_code=self.status,
                            headers=self.headers)


class ErrorBody(BaseModel):
    """Every 4xx (and 503) answer: what is wrong, and with which field or limit."""

    error: str
    field: str


ERROR_RESPONSES = {code: {"model": ErrorBody, "description": text} for code, text in (
    (400, "The body is not JSON (or holds NaN/Infinity, or a number too long to parse)."),
    (413, "The body or the work it asks for is over a limit."),
    (422, "A field is missing, unknown, of the wrong type or out of range."))}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"number {text[:40]} overflows a float")
    return x


def _check_tree(data) -> None:
    """Walk the parsed body without recursion: nesting deeper than MAX_DEPTH is a 400, and a string
    (key or value) that is not valid Unicode text (a lone surrogate) is a 422 naming it."""
    stack = [("", data, 0)]
    while stack:
        path, x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise HttpError(400, "body", f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(x, dict):
            texts = [(f"{path}.{k}" if path else str(k), k) for k in x]
            stack.extend((f"{path}.{k}" if path else str(k), v, depth + 1) for k, v in x.items())
        elif isinstance(x, list):
            texts = []
            stack.extend((f"{path}.{i}" if path else str(i), v, depth + 1) for i, v in enumerate(x))
        else:
            texts = [(path, x)] if isinstance(x, str) else []
        for where, s in texts:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as e:
                raise HttpError(422, where.encode("utf-8", "backslashreplace").decode() or "body",
                                f"not valid Unicode text (lone surrogate at character {e.start}); "
                                f"send UTF-8 text") from None


async def read_json(request: Request, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> dict:
    """The request body as a JSON object, or an HttpError (see the module docstring); a body that has
    not arrived within ``timeout_s`` is a 503 with Retry-After (``BODY_TIMEOUT_S``)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise HttpError(413, "body", f"request body over {max_bytes} bytes")
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise HttpError(413, "body", f"request body over {max_bytes} bytes")
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout_s)
    except asyncio.TimeoutError:
        got = sum(map(len, chunks))
        raise HttpError(503, "body", f"the request body did not arrive within {timeout_s:g}s ({got} of "
                                     f"{length or 'unknown'} bytes); nothing was done: send the request again",
                        {"Retry-After": "1"}) from None
    body = b"".join(chunks)
    try:
        data = json.loads(body, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits, NaN
        raise HttpError(400, "body", f"not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise HttpError(422, "body", "must be a JSON object")
    _check_tree(data)
    return data


def _field(loc) -> str:
    parts = [str(p) for p in loc if isinstance(p, int) or not (p in _TYPE_TAGS or (p.endswith("]") and "[" in p))]
    return ".".join(parts) or "body"


def parse_model(model: type[BaseModel], data: dict):
    """``model`` validated from ``data``, or a 422 naming the (deepest) offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        err = max(errors, key=lambda x: len(_field(x["loc"]).split(".")))  # first of the deepest
        msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
        raise HttpError(422, _field(err["loc"]), msg) from None


def install_error_handlers(app: FastAPI) -> None:
    """FastAPI's own errors (unknown path, wrong method, a declared body that fails) in our shape."""

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return JSONResponse({"error": str(exc.detail), "field": "request"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        err = (exc.errors() or [{"loc": (), "msg": "invalid request"}])[0]
        loc = [p for p in err.get("loc", ()) if p != "body"]
        return JSONResponse({"error": str(err.get("msg")), "field": _field(loc)}, status_code=422)


def document_body(app: FastAPI, path: str, *models: type[BaseModel]) -> None:
    """Show ``models`` (one of them) as the JSON request body of POST ``path`` in /openapi.json and
    /docs. The route itself keeps reading the body with ``read_json``: FastAPI never parses it."""
    from fastapi.openapi.utils import get_openapi  # FastAPI on use (the OpenAPI page alone)
    from pydantic.json_schema import models_json_schema  # the same

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _, defs = models_json_schema([(m, "validation") for m in models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
            body = refs[0] if len(refs) == 1 else {"oneOf": refs}
            post = schema.get("paths", {}).get(path, {}).get("post")
            if post is not None:
                post["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
