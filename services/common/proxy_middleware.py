"""Serve's HTTP proxy, one change: a request whose replica died before answering gets a 503 with
Retry-After, not a bare 500.

When a replica dies while it holds a request (a crash, a lost node, `mempo chaos` killing it),
Serve's proxy gets the actor's error and answers nothing itself, so the server behind it sends a
plain 500. mempo's endpoints are read-only (scoring, retrieval): nothing was done that a second try
would do twice, and Serve is already starting a replacement. ``LostReplicaRetry`` wraps the proxy's
ASGI app and answers such a request ``503 {"error": ..., "field": "replica"}`` with ``Retry-After: 1``
(the shape of every mempo error, services/common/http.py). A response the replica itself started,
whatever its status, passes through untouched; so does a client that went away.

    RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=services.common.proxy_middleware:proxy_middlewares
        in the environment of the nodes that run Serve's proxies: every node mempo starts has it
        (services/common/local_ray.py SERVE_NODE_ENV); on a cluster of yours, set it on its nodes
"""

from __future__ import annotations

import json
import logging

from starlette.middleware import Middleware

log = logging.getLogger("mempo.proxy")

BODY = json.dumps({"error": "the replica serving this request stopped before it answered; nothing was done: "
                            "send the request again", "field": "replica"}).encode()


class LostReplicaRetry:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        disconnected = False

        async def watch_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def watch_receive():
            nonlocal disconnected
            message = await receive()
            disconnected = disconnected or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, watch_receive, watch_send)
        except Exception:  # the proxy raised before answering: the same case, logged
            if started:
                raise
            log.warning("request %s failed in the proxy before any answer; 503", scope.get("path"), exc_info=True)
        if not started and not disconnected:
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                    (b"content-length", str(len(BODY)).encode())]})
            await send({"type": "http.response.body", "body": BODY})


def proxy_middlewares() -> list[Middleware]:
    """The middlewares mempo gives Serve's HTTP proxies (also the callback Serve's environment variable names)."""
    return [Middleware(LostReplicaRetry)]
