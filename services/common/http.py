"""Shared pieces of the services' REST endpoints: one error type, one JSON body reader.

    body = await read_json(request, max_bytes)          # 413 / 400 / 422 as HttpError
    req = parse_model(RetrieveRequest, body)            # 422 naming the offending field
    except HttpError as e: return e.response()          # {"error": ..., "field": ...}
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError


class HttpError(Exception):
    """A client error: HTTP status, the offending field, and what is wrong with it."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.status, self.field, self.message = status, field, message

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.message, "field": self.field}, status_code=self.status)


async def read_json(request: Request, max_bytes: int) -> dict:
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > max_bytes:
        raise HttpError(413, "body", f"request body over {max_bytes} bytes")
    body = await request.body()
    if len(body) > max_bytes:
        raise HttpError(413, "body", f"request body over {max_bytes} bytes")
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, "body", f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise HttpError(422, "body", "must be a JSON object")
    return data


def parse_model(model: type[BaseModel], data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "body"
        raise HttpError(422, field, "unknown field" if err["type"] == "extra_forbidden" else err["msg"]) from None
