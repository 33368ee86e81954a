"""The bearer token through Serve's real HTTP proxy: the search service deployed with a token file
(``ray.http_token_file``) answers 401 without the token or with a wrong one, 200 with it, /health
open; hostile Authorization headers (hypothesis) never get a 5xx, and a replica told to require a
token that it cannot find fails its start with the setting named."""

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

TOKEN = "search-token-" + "5f" * 16
QUERY = {"queries": ["university located in"], "topk": 2}


@pytest.fixture(scope="module")
def locked(serve_http, tiny_cfg, world, tmp_path_factory):
    from ray import serve

    from services.config import load_config
    from services.search_tool.service import search_app

    token_file = tmp_path_factory.mktemp("secret") / "token"
    token_file.write_text(TOKEN + "\n")
    cfg = load_config("deploy/configs/tiny.yaml", [f"world.dir={tiny_cfg.world.dir}", "search.num_cpus=0",
                                                   "ray.http_auth=token", f"ray.http_token_file={token_file}"])
    serve.run(search_app(cfg), name="search-locked", route_prefix="/locked")
    with httpx.Client(base_url=f"{serve_http}/locked", timeout=30) as client:
        yield client
    serve.delete("search-locked")


def test_the_token_is_asked_for_on_every_route_but_health(locked):
    for headers in ({}, {"Authorization": "Bearer " + "0" * 40}, {"Authorization": f"Basic {TOKEN}"}):
        r = locked.post("/retrieve", json=QUERY, headers=headers)
        assert r.status_code == 401 and r.json()["field"] == "authorization", r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
    assert locked.get("/docs").status_code == 401
    assert locked.get("/health").status_code == 200
    r = locked.post("/retrieve", json=QUERY, headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200 and len(r.json()["result"][0]) == 2


HEADER_BYTES = st.one_of(
    st.binary(max_size=80).filter(lambda b: b"\r" not in b and b"\n" not in b),
    st.builds(lambda pre, t, post: pre + t + post,
              st.sampled_from([b"Bearer ", b"bearer ", b"Bearer  ", b"Bearer\t", b"Token ", b"", b"Bearer"]),
              st.sampled_from([TOKEN.encode(), TOKEN.encode()[:-1], TOKEN.upper().encode(), b"", b"\xff" * 40]),
              st.sampled_from([b"", b" ", b"\x00", b"=", b"\xc3\xa9", b",Bearer x"])),
    st.integers(1, 20_000).map(lambda n: b"Bearer " + b"a" * n))


def test_hostile_authorization_headers_never_get_a_5xx(locked):
    seen = {}

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(value=HEADER_BYTES, twice=st.booleans())
    def one(value, twice):
        headers = [(b"authorization", value)] + ([(b"Authorization", f"Bearer {TOKEN}".encode())] if twice else [])
        try:
            r = locked.post("/retrieve", json=QUERY, headers=headers)
        except httpx.LocalProtocolError:  # the client itself will not send it (e.g. a NUL byte)
            return
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (value[:40], r.text)
        ok = value.strip().partition(b" ")[0].lower() == b"bearer" and \
            value.strip().partition(b" ")[2].strip() == TOKEN.encode() and not twice
        assert r.status_code == (200 if ok else 401) or r.status_code == 400, (value[:40], r.status_code)

    one()
    assert seen.get(401, 0) > 100, seen


def test_a_replica_that_must_have_a_token_and_finds_none_fails_its_start_naming_the_setting(serve_http, tiny_cfg,
                                                                                            world, monkeypatch):
    from ray import serve

    from services.config import load_config
    from services.pipeline.start_errors import ServiceStartError, deploy
    from services.search_tool.service import search_app

    cfg = load_config("deploy/configs/tiny.yaml", [f"world.dir={tiny_cfg.world.dir}", "search.num_cpus=0",
                                                   "ray.http_auth=token", "ray.http_token_env=MEMPO_TEST_NO_SUCH_VAR"])
    try:
        with pytest.raises(ServiceStartError, match="AuthConfigError.*MEMPO_TEST_NO_SUCH_VAR"):
            deploy(search_app(cfg), name="search-tokenless", route_prefix="/tokenless", service="search")
    finally:
        serve.delete("search-tokenless")
