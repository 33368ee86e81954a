"""The REST routes' bearer token (services/common/rest_auth.py): where the token comes from, and the
middleware's answers, on an app run in-process (the real proxy: tests/search_tool/test_auth.py and
tests/scenarios/test_serve_deploy.py)."""

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from services.common import rest_auth
from services.common.rest_auth import AuthConfigError, BearerAuth, auth_headers, read_token, set_token

TOKEN = "tok-" + "a1" * 12


@pytest.fixture
def client():
    app = FastAPI()
    rest_auth.install_auth(app)
    reached = []

    @app.post("/score")
    async def score(request: Request):
        reached.append(await request.body())
        return {"ok": True}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok"}

    set_token(TOKEN)
    with TestClient(app) as c:
        c.reached = reached
        yield c
    set_token(None)


def test_without_the_token_every_route_but_health_is_401_before_the_body_is_read(client):
    for headers in ({}, {"authorization": "Bearer wrong-token-0000000000"}, {"authorization": f"Basic {TOKEN}"},
                    {"authorization": TOKEN}, {"authorization": "Bearer"}, {"authorization": "Bearer "},
                    {"authorization": f"Bearer {TOKEN}x"}, {"authorization": f"Bearer {TOKEN[:-1]}"}):
        r = client.post("/score", json={"big": "x" * 10_000}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["field"] == "authorization" and r.headers["www-authenticate"].startswith("Bearer")
    assert client.get("/docs").status_code == 401 and client.get("/nowhere").status_code == 401
    assert client.reached == []  # no handler ran, no body was read
    assert client.get("/health").status_code == 200 and client.head("/health/").status_code == 200


def test_the_token_opens_every_route_and_the_scheme_is_case_insensitive(client):
    for auth in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN} "):
        assert client.post("/score", json={}, headers={"authorization": auth}).status_code == 200, auth
    assert client.post("/score", json={}, headers=auth_headers(TOKEN)).status_code == 200
    # two Authorization headers (one right): refused, no guessing which one counts
    r = client.post("/score", json={}, headers=[("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer x")])
    assert r.status_code == 401


def test_without_a_token_the_routes_are_open(client):
    set_token(None)
    assert client.post("/score", json={}).status_code == 200


def test_odd_authorization_bytes_get_401_never_5xx(client):
    for raw in (b"\xff\xfe", b"Bearer \xe9\xe8" + b"a" * 30, b"Bearer " + b"a" * 100_000, b"\x00Bearer x",
                b"Bearer\t" + TOKEN.encode(), b"Bearer " + TOKEN.encode() + b"\x00"):
        r = client.post("/score", json={}, headers=[(b"authorization", raw)])
        assert r.status_code == 401, raw[:20]


def test_the_token_comes_from_a_file_first_then_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMPO_API_TOKEN", raising=False)
    assert read_token("auto", "MEMPO_API_TOKEN", "") is None  # auto without one: open
    assert read_token("none", "MEMPO_API_TOKEN", str(tmp_path / "missing")) is None  # none: never read
    with pytest.raises(AuthConfigError, match="MEMPO_API_TOKEN.*ray.http_token_file"):
        read_token("token", "MEMPO_API_TOKEN", "")
    monkeypatch.setenv("MEMPO_API_TOKEN", f"  {TOKEN}\n")
    assert read_token("token", "MEMPO_API_TOKEN", "") == TOKEN
    f = tmp_path / "token"
    f.write_text("from-the-file-" + "b" * 20 + "\n")
    assert read_token("auto", "MEMPO_API_TOKEN", str(f)) == "from-the-file-" + "b" * 20
    with pytest.raises(AuthConfigError, match="cannot read it"):
        read_token("auto", "MEMPO_API_TOKEN", str(tmp_path / "missing"))


def test_a_token_too_short_or_with_characters_a_header_cannot_carry_is_refused(monkeypatch):
    for bad, what in (("short", "at least 16"), ("a" * 20 + " b", "letters, digits"), ("é" * 20, "letters, digits"),
                      ("a" * 20 + "\n" + "b", "letters, digits")):
        monkeypatch.setenv("MY_TOKEN", bad)
        with pytest.raises(AuthConfigError, match=what):
            read_token("auto", "MY_TOKEN", "")


def test_both_rest_services_put_the_middleware_in_front():
    from services.scorer.service import app as scorer_app
    from services.search_tool.service import app as search_app

    for app in (scorer_app, search_app):
        assert any(m.cls is BearerAuth for m in app.user_middleware), app.title
