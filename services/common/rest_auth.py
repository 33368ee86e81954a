"""A bearer token on the services' REST routes: strangers who reach Serve's HTTP port get 401.

On a laptop every listener is on loopback and no token is needed. On a cluster Serve's HTTP proxy
listens on every interface of a node, so anyone who reaches the port could run the scorer (a GPU per
request) or the search service. With a token configured every route of those apps asks for

    Authorization: Bearer <token>

and answers ``401 {"error": ..., "field": "authorization"}`` with ``WWW-Authenticate: Bearer``
without it or with a wrong one (compared in constant time, before the body is read). ``/health``
stays open so load balancers and Kubernetes probes need no secret.

Where the token comes from (``ray.http_auth``, ``ray.http_token_env``, ``ray.http_token_file``): an
environment variable of the replica's node (``MEMPO_API_TOKEN`` by default; on KubeRay from a
Secret) or a file (a mounted Secret), never the config file itself. ``http_auth: token`` makes a
replica that finds no token refuse to start, naming where it looked; ``auto`` (the default) closes
the routes when a token is found and leaves them open otherwise.

    install_auth(app)                    # beside install_error_handlers, before @serve.ingress
    configure_auth(cfg.ray)              # in the replica's __init__: reads the token or raises
    headers = auth_headers(token)        # a client's side (mempo score, mempo view --serve)

The token lives in this module for the replica's process (each Serve replica is a process of its
own): Serve freezes a copy of the app at ``@serve.ingress``, and the middleware reads the module's
state at call time, so the copy and the replica agree.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import string
from pathlib import Path
from typing import Optional

log = logging.getLogger("mempo.auth")

OPEN_PATHS = ("/health",)  # probes need no secret; every other path (routes, /docs, unknown ones) is closed
MIN_TOKEN_CHARS = 16
_TOKEN_CHARS = set(string.ascii_letters + string.digits + "-._~+/=")  # RFC 6750 b64token
_TOKEN: Optional[bytes] = None  # this process's token; None = routes open


class AuthConfigError(ValueError):
    """The configured token is missing (``http_auth: token``), unreadable or unusable."""


def check_token(token: str, where: str) -> str:
    """``token`` stripped of surrounding whitespace, or an AuthConfigError naming ``where`` it came from."""
    token = token.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise AuthConfigError(f"the REST token from {where} has {len(token)} characters; use at least "
                              f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 32`)")
    bad = sorted(set(token) - _TOKEN_CHARS)
    if bad:
        raise AuthConfigError(f"the REST token from {where} holds {''.join(bad)[:10]!r}: a bearer token is "
                              f"letters, digits and -._~+/= only (e.g. `openssl rand -hex 32`)")
    return token


def read_token(auth: str, token_env: str, token_file: str) -> Optional[str]:
    """The token these settings name (a file first, then the environment variable), or None when there is
    none and ``auth`` is "auto". An AuthConfigError when ``auth`` is "token" and none is found, when the file
    cannot be read, or when the token is too short or holds characters a header cannot carry."""
    if auth == "none":
        return None
    if token_file:
        path = Path(token_file).expanduser()
        try:
            return check_token(path.read_text(), f"ray.http_token_file={token_file}")
        except OSError as e:
            raise AuthConfigError(f"ray.http_token_file={token_file}: cannot read it ({e.strerror or e})") from None
    value = os.environ.get(token_env, "") if token_env else ""
    if value.strip():
        return check_token(value, f"the environment variable {token_env}")
    if auth == "token":
        raise AuthConfigError(f"ray.http_auth=token but no token: set the environment variable {token_env or '(none)'} "
                              "on every node that runs a REST replica (ray.http_token_env names it) or mount a file "
                              "and name it in ray.http_token_file")
    return None


def configure_auth(ray_cfg) -> bool:
    """Read this replica's token from ``ray_cfg`` (a RayConfig) and close the routes with it; True when
    closed. Raises AuthConfigError (the replica does not start) on a token the settings require but
    cannot find or use."""
    global _TOKEN
    token = read_token(ray_cfg.http_auth, ray_cfg.http_token_env, ray_cfg.http_token_file)
    _TOKEN = token.encode() if token else None
    return _TOKEN is not None


def set_token(token: Optional[str]) -> None:
    """Close the routes with ``token`` (None opens them): for an app run in-process (tests)."""
    global _TOKEN
    _TOKEN = check_token(token, "set_token").encode() if token else None


def auth_headers(token: Optional[str]) -> dict[str, str]:
    """The request headers a client sends with ``token`` ({} without one)."""
    return {"authorization": f"Bearer {token}"} if token else {}


def _presented(headers: list[tuple[bytes, bytes]]) -> Optional[bytes]:
    """The credentials of the request's one ``Authorization: Bearer`` header, or None (absent, another
    scheme, several Authorization headers)."""
    values = [v for k, v in headers if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, credentials = values[0].strip().partition(b" ")
    if scheme.lower() != b"bearer":  # the scheme is case-insensitive (RFC 7235)
        return None
    return credentials.strip() or None


def _body(message: str) -> bytes:
    return json.dumps({"error": message, "field": "authorization"}).encode()


class BearerAuth:
    """ASGI middleware: with a token set (``configure_auth``), every HTTP request but ``OPEN_PATHS`` must
    carry it, or is answered 401 before the app (or its body) is touched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        token = _TOKEN
        if token is None or scope["type"] != "http" or _path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        got = _presented(scope.get("headers") or [])
        if got is not None and hmac.compare_digest(got, token):
            return await self.app(scope, receive, send)
        if got is None:
            body, challenge = _body("this endpoint needs 'Authorization: Bearer <token>'"), b'Bearer realm="mempo"'
        else:
            body = _body("the bearer token is not this service's")
            challenge = b'Bearer realm="mempo", error="invalid_token"'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", challenge),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _path(scope) -> str:
    """The request's path inside the app (without the route prefix Serve mounts it at)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path.rstrip("/") or "/"


def install_auth(app) -> None:
    """Put :class:`BearerAuth` in front of a FastAPI app (before ``@serve.ingress`` freezes it)."""
    app.add_middleware(BearerAuth)
