"""Property-based fuzzing of POST /retrieve over real HTTP (Serve): no generated body gets a 5xx,
every 4xx is the {error, field} JSON shape, and a fixed valid request answers identically before
and after. Counts by status class are printed (pytest -s)."""

from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.fuzz_bodies import bodies, post_checked

pytestmark = pytest.mark.slow

VALID = {"queries": ["Gerkville city country", "Teabe Media founded by"], "topk": 3, "return_scores": True}
EXAMPLES = 1500
COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def client(search_service):
    _, url = search_service
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


def test_fuzzed_bodies_never_get_a_5xx(client):
    before = client.post("/retrieve", json=VALID)
    assert before.status_code == 200

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(VALID))
    def one(body):
        r = post_checked(client, "/retrieve", body, COUNTS)
        if r is not None:
            assert len(r.json()["result"]) >= 1

    one()
    print(f"\n/retrieve fuzz: {sum(COUNTS.values())} bodies, by status class {dict(sorted(COUNTS.items()))}")
    after = client.post("/retrieve", json=VALID)
    assert after.status_code == 200 and after.content == before.content
    assert COUNTS["5xx"] == 0 and sum(COUNTS.values()) >= EXAMPLES * 0.9
