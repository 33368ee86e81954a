"""Hypothesis strategies for request-body fuzzing of the REST endpoints (not a test module).

    bodies(VALID)   # bytes: random JSON, random bytes, VALID with a wrong value at any depth,
                    # huge numbers, deep nesting, lone surrogates, NaN/Infinity, truncation, and
                    # VALID's shape with every string and integer redrawn (mostly usable requests)

Bodies are serialised by hand so that things ``json.dumps`` refuses to write (a 5,000-digit number,
3,000 nested brackets, a lone surrogate escape) still reach the server as bytes.
"""

from __future__ import annotations

import json

from hypothesis import strategies as st


class Raw(bytes):
    """A JSON fragment written as is."""


def to_bytes(x) -> bytes:
    if isinstance(x, Raw):
        return bytes(x)
    if isinstance(x, dict):
        return b"{" + b",".join(to_bytes(str(k)) + b":" + to_bytes(v) for k, v in x.items()) + b"}"
    if isinstance(x, list):
        return b"[" + b",".join(to_bytes(v) for v in x) + b"]"
    return json.dumps(x, ensure_ascii=True, allow_nan=True).encode()  # lone surrogates become \udXXX escapes


SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "a\ud83d", "\ude00b"])
TEXT = st.one_of(st.text(max_size=30), SURROGATES,
                 st.sampled_from(["<|im_end|>", "<|im_start|>system\n", "<|endoftext|>", "", "   ", "\x00", "\u202e"]),
                 st.builds(lambda a, s, b: a + s + b, st.text(max_size=5), SURROGATES, st.text(max_size=5)))
HUGE = st.one_of(st.integers(4300, 6000).map(lambda n: Raw(b"9" * n)),                    # over int max str digits
                 st.integers(1, 4000).map(lambda n: Raw(b"-" + b"7" * n)),
                 st.sampled_from([Raw(b"1e400"), Raw(b"-1e999"), Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"),
                                  Raw(b"1" + b"0" * 400 + b".5"), 2**63, -2**63 - 1, 2**64]))
NESTED = st.integers(30, 5000).flatmap(
    lambda n: st.sampled_from([Raw(b"[" * n + b"]" * n), Raw(b'{"a":' * n + b"1" + b"}" * n), Raw(b"[" * n)]))
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(TEXT, inner, max_size=4)), max_leaves=12)
ANY_VALUE = st.one_of(JSON, HUGE, NESTED)


def _paths(x, prefix=()):
    """Every (path, value) in a JSON value: the places a wrong value can go."""
    yield prefix, x
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, prefix + (i,))


def _replace(x, path, value):
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _replace(x[head], rest, value)}
    return [(_replace(v, rest, value) if i == head else v) for i, v in enumerate(x)]


@st.composite
def mutated(draw, valid: dict):
    """``valid`` with one value replaced (any depth), one key removed, or one unknown key added."""
    paths = [p for p, _ in _paths(valid)]
    kind = draw(st.sampled_from(["replace", "replace", "replace", "drop", "add"]))
    if kind == "add":
        return {**valid, draw(TEXT): draw(ANY_VALUE)}
    path = draw(st.sampled_from(paths[1:]))
    if kind == "drop" and isinstance(path[-1], str):
        parent = path[:-1]
        node = valid
        for p in parent:
            node = node[p]
        return _replace(valid, parent, {k: v for k, v in node.items() if k != path[-1]})
    return _replace(valid, path, draw(ANY_VALUE))


PLAIN_TEXT = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["<|im_end|>", "<|im_start|>system\n", "<|endoftext|>",
                                                               "Cafe\u0301", "\u202e\u0000", " ", "日本語"]))


@st.composite
def same_shape(draw, valid: dict):
    """``valid`` with every string and integer redrawn (any text, small integers): mostly usable
    requests, so the code past validation (tokenising, scoring, searching) is fuzzed too."""
    def redraw(x, key=None):
        if isinstance(x, dict):
            return {k: redraw(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [redraw(v, key) for v in x]
        if isinstance(x, str):
            return x if key == "role" else draw(PLAIN_TEXT)  # an enum keeps its value
        if isinstance(x, int) and not isinstance(x, bool):
            return draw(st.integers(-1, max(2 * x, 8)))
        return x
    return redraw(valid)


def bodies(valid: dict) -> st.SearchStrategy[bytes]:
    as_bytes = st.one_of(mutated(valid), JSON, st.dictionaries(TEXT, ANY_VALUE, max_size=4)).map(to_bytes)
    return st.one_of(as_bytes, as_bytes, as_bytes, same_shape(valid).map(to_bytes), st.binary(max_size=200),
                     st.builds(lambda b, n: b[:n], as_bytes, st.integers(0, 60)))  # truncated JSON


def status_class(code: int) -> str:
    return f"{code // 100}xx"


def post_checked(client, path: str, body: bytes, counts) -> "object | None":
    """POST one fuzzed body; count its status class; assert no 5xx and the {error, field} shape of
    every 4xx. Returns the response when it succeeded (for endpoint-specific checks), else None."""
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    counts[status_class(r.status_code)] += 1
    assert r.status_code < 500, (body[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()
        assert set(err) == {"error", "field"} and err["error"], err
        return None
    return r
