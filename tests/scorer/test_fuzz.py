"""Property-based fuzzing of POST /scorer/score over real HTTP (Serve): no generated body gets a
5xx, every 4xx is the {error, field} JSON shape, and a fixed valid request (text form and token
form) answers identically before and after. Counts by status class are printed (pytest -s)."""

from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fuzz_bodies import bodies, post_checked

pytestmark = pytest.mark.slow

TEXT = {"question": ["Who founded Teabe Media?", "When?"], "memory": "Teabe Media was founded by Ziosound Caireath.",
        "history": [{"role": "assistant", "content": "<search> Teabe Media founded by </search>"},
                    {"role": "user", "content": "<information>\nDoc 1 (Title: Teabe Media) founded in 1986.\n</information>"}],
        "answer": ["Ziosound Caireath", "1986"], "system": "You are a search agent."}
TOKENS = {"mem_context_ids": [1, 5, 9, 12], "full_context_ids": [1, 5, 9, 12, 40, 41], "continuation_ids": [3, 4, 5, 6],
          "answer_span": [1, 3]}
EXAMPLES = 1000
COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def client(scorer_service):
    _, url, _ = scorer_service
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def test_fuzzed_bodies_never_get_a_5xx(client):
    before = [client.post("/score", json=body) for body in (TEXT, TOKENS)]
    assert [r.status_code for r in before] == [200, 200], [r.text for r in before]

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=st.one_of(bodies(TEXT), bodies(TOKENS)))
    def one(body):
        r = post_checked(client, "/score", body, COUNTS)
        if r is not None:
            assert r.json()["r_mem"] == pytest.approx(r.json()["p_mem"] - r.json()["p_full"], abs=1e-6)

    one()
    print(f"\n/score fuzz: {sum(COUNTS.values())} bodies, by status class {dict(sorted(COUNTS.items()))}")
    after = [client.post("/score", json=body) for body in (TEXT, TOKENS)]
    assert [a.content for a in after] == [b.content for b in before]
    assert COUNTS["5xx"] == 0 and sum(COUNTS.values()) >= EXAMPLES * 0.9
