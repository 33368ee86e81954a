"""The msgpack codec (services/common/codec.py): round trips, zero-copy arrays, and that every
malformed input fails with a ProtocolError that names the exact field.

Strategies are derived from the message dataclasses' annotations, so a message kind added to
``services/common/messages.py`` is covered without touching this file.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
import warnings

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays

import services.common.messages as M  # noqa: F401  (registers every message kind)
from services.common import codec
from services.common.codec import SCHEMA_VERSION, ProtocolError, decode, encode, registered_messages, same

SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# dtypes drawn when a field's metadata says dtype=None
ANY_NP_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "float16", "float32", "float64", "bool"]
# torch dtype -> numpy dtype whose bits we draw (bfloat16 has no numpy twin: draw uint16, view)
TORCH_DTYPES = {
    torch.bfloat16: np.uint16,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.bool: np.bool_,
}
INT64 = st.integers(-(2**63), 2**63 - 1)
SHORT_TEXT = st.text(max_size=8)


# ---------------------------------------------------------------------------------------------
# strategies built from annotations


def np_arrays(dtype: str | None, ndim: int | None) -> st.SearchStrategy[np.ndarray]:
    dtypes = st.just(np.dtype(dtype)) if dtype else st.sampled_from([np.dtype(d) for d in ANY_NP_DTYPES])
    if ndim is None:
        shapes = array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
    else:
        shapes = array_shapes(min_dims=ndim, max_dims=ndim, min_side=0, max_side=6)
    return arrays(dtypes, shapes)


@st.composite
def tensors(draw) -> torch.Tensor:
    tdt = draw(st.sampled_from(list(TORCH_DTYPES)))
    arr = draw(arrays(TORCH_DTYPES[tdt], array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))
    t = torch.from_numpy(np.array(arr, copy=True))
    return t.view(tdt) if tdt is torch.bfloat16 else t


def strategy_for(tp: typing.Any, meta: dict | None = None) -> st.SearchStrategy:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = typing.get_args(tp)
        opts = [strategy_for(a, meta) for a in args if a is not type(None)]
        if type(None) in args:
            opts.append(st.none())
        return st.one_of(*opts)
    if origin is list:
        (item,) = typing.get_args(tp)
        return st.lists(strategy_for(item, meta), max_size=3)
    if origin is dict:
        key, val = typing.get_args(tp)
        assert key is str, f"only str keys travel: {tp}"
        return st.dictionaries(SHORT_TEXT, strategy_for(val, meta), max_size=3)
    if dataclasses.is_dataclass(tp):
        return message_strategy(tp)
    if tp is np.ndarray:
        meta = meta or {}
        return np_arrays(meta.get("dtype"), meta.get("ndim", 1))
    if tp is torch.Tensor:
        return tensors()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return INT64
    if tp is float:
        return st.floats()  # NaN and inf included: same() compares bits
    if tp is str:
        return st.text(max_size=12)
    if tp is bytes:
        return st.binary(max_size=12)
    raise AssertionError(f"test has no strategy for field type {tp!r}; extend strategy_for")


_STRATEGIES: dict[type, st.SearchStrategy] = {}


def message_strategy(cls: type) -> st.SearchStrategy:
    if cls not in _STRATEGIES:
        hints = typing.get_type_hints(cls)
        _STRATEGIES[cls] = st.deferred(lambda: st.builds(cls, **{
            f.name: strategy_for(hints[f.name], dict(f.metadata) or None) for f in dataclasses.fields(cls)
        }))
    return _STRATEGIES[cls]


KINDS = sorted(registered_messages())


def test_registry_covers_messages_module():
    for name in ["ChatMessage", "Prompt", "PromptBatch", "TurnRecord", "Episode", "RolloutGroup", "TrajectoryBatch",
                 "MemoryScore", "MemoryScoreBatch", "TrainingBatch", "WeightUpdate", "Metrics"]:
        assert name in KINDS


@pytest.mark.parametrize("kind", KINDS)
@SETTINGS
@given(data=st.data())
def test_round_trip_every_kind(kind, data):
    cls = registered_messages()[kind]
    msg = data.draw(message_strategy(cls))
    raw = encode(msg)
    assert isinstance(raw, bytes)
    out = decode(raw)
    assert type(out) is cls and type(out).__name__ == kind
    assert same(out, msg)
    assert same(decode(raw, expected=cls), msg)
    assert encode(out) == raw  # re-encoding a decoded message is byte-stable


# ---------------------------------------------------------------------------------------------
# arrays: many dtypes, odd shapes, non-contiguous input, zero-copy decode


@pytest.fixture(scope="module")
def any_array_message():
    """A test-only message kind with an untyped array field (removed from the registry after)."""

    @codec.message
    class _CodecTestArrays:
        a: np.ndarray = codec.array_field(None, None)
        t: typing.Optional[torch.Tensor] = None

    yield _CodecTestArrays
    codec._REGISTRY.pop("_CodecTestArrays", None)


BASE = np.arange(-60, 60, dtype=np.int64)
ARRAY_CASES = {
    **{f"{d}-1d": BASE[:24].astype(d) for d in ANY_NP_DTYPES},
    "float32-special": np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 1e-45], np.float32),
    "float64-nan-payload": np.array([0x7FF0000000000123, 0xFFF8000000000001], np.uint64).view(np.float64),
    "complex64": (BASE[:6] + 1j * BASE[6:12]).astype(np.complex64),
    "int32-0d": np.array(-7, np.int32),
    "float64-0d": np.array(3.5),
    "bool-0d": np.array(True),
    "float32-empty": np.zeros(0, np.float32),
    "int64-empty-2d": np.zeros((0, 5), np.int64),
    "int16-2d": BASE.astype(np.int16).reshape(12, 10),
    "float16-3d": BASE.astype(np.float16).reshape(2, 6, 10),
    "int32-big-endian": BASE[:10].astype(">i4"),
    "sliced-step": BASE[::3],
    "sliced-reversed": BASE[::-1].astype(np.float32),
    "transposed": BASE.reshape(12, 10).T,
    "column": BASE.astype(np.float64).reshape(12, 10)[:, 3],
    "fortran": np.asfortranarray(BASE.reshape(10, 12).astype(np.uint8)),
}


@pytest.mark.parametrize("name", list(ARRAY_CASES))
def test_arrays_round_trip_bit_identical(any_array_message, name):
    arr = ARRAY_CASES[name]
    out = decode(encode(any_array_message(a=arr)), expected=any_array_message)
    assert out.a.dtype == arr.dtype and out.a.shape == arr.shape
    assert out.a.tobytes() == arr.tobytes()  # tobytes() is C order, so layout-independent
    assert same(out.a, np.ascontiguousarray(arr).reshape(arr.shape))


@pytest.mark.parametrize("tdt", list(TORCH_DTYPES), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 4), (2, 3, 2)], ids=str)
def test_tensors_round_trip_bit_identical(tdt, shape):
    n = int(np.prod(shape)) if shape else 1
    t = (torch.arange(n, dtype=torch.float64) * 1.37 - 3).to(tdt).reshape(shape)
    msg = M.WeightUpdate(version=3, tensors={"w": t, "w.T": t.T if t.dim() == 2 else t})
    out = decode(encode(msg), expected=M.WeightUpdate)
    assert same(out, msg)
    for k, v in msg.tensors.items():
        assert out.tensors[k].dtype == tdt and tuple(out.tensors[k].shape) == tuple(v.shape)
        assert torch.equal(out.tensors[k], v)


def test_tensor_requires_grad_and_non_contiguous():
    w = torch.randn(4, 6, dtype=torch.float32, requires_grad=True)
    msg = M.WeightUpdate(version=1, tensors={"a": w, "b": w.detach()[:, ::2], "c": w.detach().to(torch.bfloat16).T})
    out = decode(encode(msg))
    assert same(out, msg)
    assert not out.tensors["a"].requires_grad


def _all_arrays(obj):
    if isinstance(obj, np.ndarray):
        yield obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _all_arrays(getattr(obj, f.name))
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _all_arrays(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _all_arrays(v)


def test_decoded_arrays_are_read_only_zero_copy_views(any_array_message):
    batch = make_batch()
    out = decode(encode(batch))
    arrs = list(_all_arrays(out))
    assert len(arrs) == len(list(_all_arrays(batch))) > 10
    for a in arrs:
        assert a.base is not None and not a.flags.owndata
        assert not a.flags.writeable
    with pytest.raises(ValueError):
        arrs[0][...] = 0
    # a 2-d array (reshape of the frombuffer view) is a view too, and copying makes it writable
    big = decode(encode(any_array_message(a=np.arange(40000, dtype=np.float64).reshape(200, 200)))).a
    assert big.base is not None and not big.flags.owndata and not big.flags.writeable
    assert big.copy().flags.writeable


# ---------------------------------------------------------------------------------------------
# a realistic hand-built batch for the error tests


def make_batch(groups: int = 2, episodes: int = 2, turns: int = 2, seed: int = 0) -> M.TrajectoryBatch:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = M.Prompt(uid=f"p{g}", messages=[M.ChatMessage("system", "sys"), M.ChatMessage("user", f"q{g}")],
                          golds=[["a", "b"], ["c"]], extra={"k": 2, "hop": 1.5, "tag": "x", "flag": True})
        eps = []
        for e in range(episodes):
            prompt_ids = rng.integers(0, 2048, 12, dtype=np.int32)
            full = [prompt_ids]
            trs = []
            for t in range(turns):
                ctx = np.concatenate(full)
                resp = rng.integers(0, 2048, 9, dtype=np.int32)
                obs = rng.integers(0, 2048, 5, dtype=np.int32)
                trs.append(M.TurnRecord(turn=t, context_ids=ctx, response_ids=resp,
                                        response_logprobs=-rng.random(9, dtype=np.float32), mem_start=0, mem_end=4,
                                        action="search", action_text="q", observation_ids=obs,
                                        full_prefix_len=len(ctx), policy_version=1, finish_reason="stop"))
                full += [resp, obs]
            eps.append(M.Episode(uid=f"p{g}/{e}", sample=e, prompt_ids=prompt_ids, full_ids=np.concatenate(full),
                                 turns=trs, answer=None if e else "a; c", finish_reason="answer", tool_calls=turns))
        out.append(M.RolloutGroup(prompt=prompt, episodes=eps))
    return M.TrajectoryBatch(groups=out, policy_version=1, step=5, metrics={"t": 0.5})


def _unpack(raw: bytes) -> dict:
    """Bytes -> plain envelope tree with arrays left as msgpack ExtType (no codec involved)."""
    return msgpack.unpackb(raw, raw=False)


def _repack(env: dict) -> bytes:
    return msgpack.packb(env, use_bin_type=True)


def _ext(arr: np.ndarray) -> msgpack.ExtType:
    return codec._default(arr)


# ---------------------------------------------------------------------------------------------
# envelope: schema and kind


def test_typed_arrays_travel_as_raw_bytes_and_bad_lengths_name_the_field():
    batch = make_batch()
    env = _unpack(encode(batch))
    turn = env["body"]["groups"][0]["episodes"][0]["turns"][0]
    assert type(turn["response_ids"]) is bytes  # int32 1-d: no header, the schema knows dtype and rank
    assert turn["response_ids"] == batch.groups[0].episodes[0].turns[0].response_ids.astype("<i4").tobytes()
    turn["response_ids"] = turn["response_ids"][:-1]  # not a whole number of int32 items
    with pytest.raises(ProtocolError) as ei:
        decode(_repack(env))
    assert ei.value.field.endswith("turns[0].response_ids") and "whole number" in str(ei.value)
    turn["response_ids"] = [1, 2, 3]  # numbers, not bytes
    with pytest.raises(ProtocolError, match="bytes"):
        decode(_repack(env))


def test_schema_mismatch_is_protocol_error():
    env = _unpack(encode(make_batch()))
    for bad in [SCHEMA_VERSION + 1, SCHEMA_VERSION - 1, 0, "2", None, 2.0, True, [1, 2]]:
        env["schema"] = bad
        with pytest.raises(ProtocolError) as ei:
            decode(_repack(env))
        assert ei.type is ProtocolError
        assert "schema" in str(ei.value) and ei.value.field.endswith("schema")
    env["schema"] = _ext(np.array([1, 1]))  # an array must not reach a truthiness test
    with pytest.raises(ProtocolError) as ei:
        decode(_repack(env))
    assert ei.type is ProtocolError and ei.value.field == "message.schema"
    del env["schema"]
    with pytest.raises(ProtocolError, match="schema"):
        decode(_repack(env))


def test_wrong_kind_with_expected():
    raw = encode(M.Metrics(stage="rollout", step=1, values={"x": 1.0}))
    with pytest.raises(ProtocolError) as ei:
        decode(raw, expected=M.TrajectoryBatch)
    assert ei.type is ProtocolError and ei.value.field == "TrajectoryBatch.kind"
    assert "Metrics" in str(ei.value)
    env = _unpack(raw)
    env["kind"] = "NoSuchKind"
    with pytest.raises(ProtocolError, match="NoSuchKind"):
        decode(_repack(env))
    env["kind"] = "Metrics"
    env["extra"] = 1
    with pytest.raises(ProtocolError, match="envelope"):
        decode(_repack(env))


def test_non_bytes_input():
    for bad in [None, "text", 3, [1]]:
        with pytest.raises(ProtocolError) as ei:
            decode(bad)
        assert ei.type is ProtocolError
    assert same(decode(bytearray(encode(make_batch()))), make_batch())
    assert same(decode(memoryview(encode(make_batch()))), make_batch())


# ---------------------------------------------------------------------------------------------
# truncated and garbage bytes


def _assert_protocol_error(raw) -> ProtocolError:
    try:
        decode(raw)
    except Exception as e:  # noqa: BLE001 - the point is which type it is
        assert type(e) is ProtocolError, f"{type(e).__name__}: {e}"
        return e
    raise AssertionError("decode accepted bad bytes")


def test_truncated_bytes_always_protocol_error():
    raw = encode(make_batch(groups=1, episodes=2, turns=2))
    cuts = range(len(raw))  # every cut point of a ~1.5 kB message
    assert len(raw) < 5000
    for cut in cuts:
        _assert_protocol_error(raw[:cut])
    big = encode(make_batch(groups=3, episodes=3, turns=3))
    for cut in list(range(64)) + list(range(64, len(big), max(1, len(big) // 400))):
        _assert_protocol_error(big[:cut])


@SETTINGS
@given(st.binary(max_size=300))
def test_random_garbage_bytes(raw):
    _assert_protocol_error(raw)


@SETTINGS
@given(st.data())
def test_mutated_bytes_never_crash(data):
    """Flip/insert/delete bytes of a valid message: either it still decodes, or ProtocolError."""
    raw = bytearray(encode(make_batch(groups=1, episodes=1, turns=2)))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        op = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        if op == "flip":
            raw[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        else:
            del raw[pos]
    try:
        decode(bytes(raw))
    except Exception as e:  # noqa: BLE001
        assert type(e) is ProtocolError, f"{type(e).__name__}: {e}"


_msgpack_values = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=6) | st.binary(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def _ext_garbage(draw):
    code = draw(st.sampled_from([1, 2, 3, 77]))
    if draw(st.booleans()):
        head = msgpack.packb([draw(st.sampled_from(["<i4", "|b1", "<f8", "O", "bfloat16", "float32", "Tensor", "zz"])),
                              draw(st.lists(st.integers(-2, 2**40), max_size=3))])
        body = struct.pack("<I", len(head)) + head + draw(st.binary(max_size=16))
    else:
        body = draw(st.binary(max_size=24))
    return msgpack.ExtType(code, body)


@SETTINGS
@given(st.sampled_from(KINDS), st.dictionaries(st.text(max_size=12), _msgpack_values | _ext_garbage(), max_size=6))
def test_valid_envelope_random_body(kind, body):
    """Past the msgpack layer: a well-formed envelope around a random body decodes or raises ProtocolError."""
    raw = msgpack.packb({"schema": codec.SCHEMA_VERSION, "kind": kind, "body": body}, use_bin_type=True)
    try:
        out = decode(raw)
    except Exception as e:  # noqa: BLE001
        assert type(e) is ProtocolError, f"{type(e).__name__}: {e}"
    else:
        assert type(out).__name__ == kind


@SETTINGS
@given(_ext_garbage())
def test_garbage_array_ext_in_array_field(ext):
    env = _unpack(encode(make_batch(groups=1, episodes=1, turns=1)))
    env["body"]["groups"][0]["episodes"][0]["turns"][0]["response_ids"] = ext
    e = _assert_protocol_error(_repack(env))
    assert e.field in ("message", "TrajectoryBatch.groups[0].episodes[0].turns[0].response_ids")


# ---------------------------------------------------------------------------------------------
# wrong types name the exact dotted field path, on encode and on decode

TURN = "TrajectoryBatch.groups[1].episodes[0].turns[1]"


def _turn(b):
    return b.groups[1].episodes[0].turns[1]


def _as_dict(obj):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _bad_extra_field(b):
    d = _as_dict(_turn(b))
    d["bogus"] = 1
    b.groups[1].episodes[0].turns[1] = d


def _dict_missing_field(b):
    d = _as_dict(_turn(b))
    del d["response_ids"]
    b.groups[1].episodes[0].turns[1] = d




ENCODE_CASES = {
    "str-for-int": (lambda b: setattr(_turn(b), "turn", "1"), f"{TURN}.turn"),
    "bool-for-int": (lambda b: setattr(_turn(b), "mem_start", True), f"{TURN}.mem_start"),
    "float-for-int": (lambda b: setattr(b, "step", 1.5), "TrajectoryBatch.step"),
    "int-for-str": (lambda b: setattr(_turn(b), "action", 3), f"{TURN}.action"),
    "int64-for-int32": (lambda b: setattr(_turn(b), "response_ids", _turn(b).response_ids.astype(np.int64)), f"{TURN}.response_ids"),
    "float64-for-float32": (lambda b: setattr(_turn(b), "response_logprobs", _turn(b).response_logprobs.astype(np.float64)),
                            f"{TURN}.response_logprobs"),
    "2d-for-1d": (lambda b: setattr(_turn(b), "context_ids", _turn(b).context_ids.reshape(1, -1)), f"{TURN}.context_ids"),
    "list-for-array": (lambda b: setattr(_turn(b), "observation_ids", [1, 2]), f"{TURN}.observation_ids"),
    "missing-field-del": (lambda b: delattr(b.groups[1].episodes[0], "uid"), "TrajectoryBatch.groups[1].episodes[0].uid"),
    "missing-field-dict": (_dict_missing_field, f"{TURN}.response_ids"),
    "unknown-field-dict": (_bad_extra_field, f"{TURN}.bogus"),
    "list-for-dict": (lambda b: setattr(b, "metrics", [0.5]), "TrajectoryBatch.metrics"),
    "list-for-prompt-extra": (lambda b: setattr(b.groups[0].prompt, "extra", [1]), "TrajectoryBatch.groups[0].prompt.extra"),
    "bad-dict-value": (lambda b: b.metrics.update(bad="x"), "TrajectoryBatch.metrics['bad']"),
    "dict-for-list": (lambda b: setattr(b.groups[1].episodes[0], "turns", {}), "TrajectoryBatch.groups[1].episodes[0].turns"),
    "list-for-message": (lambda b: b.groups[0].prompt.messages.__setitem__(1, ["user", "q"]),
                         "TrajectoryBatch.groups[0].prompt.messages[1]"),
    "wrong-message-type": (lambda b: b.groups[0].prompt.messages.__setitem__(1, M.Metrics("s", 1, {})),
                           "TrajectoryBatch.groups[0].prompt.messages[1]"),
    "int-for-optional-str": (lambda b: setattr(b.groups[1].episodes[0], "answer", 3), "TrajectoryBatch.groups[1].episodes[0].answer"),
    "none-for-list": (lambda b: setattr(b.groups[0].prompt, "golds", None), "TrajectoryBatch.groups[0].prompt.golds"),
    "int-in-nested-list": (lambda b: b.groups[0].prompt.golds[1].append(7), "TrajectoryBatch.groups[0].prompt.golds[1][1]"),
}


@pytest.mark.parametrize("case", list(ENCODE_CASES))
def test_encode_wrong_types_name_the_field(case):
    mutate, field = ENCODE_CASES[case]
    b = make_batch()
    encode(b)  # fine before
    mutate(b)
    with pytest.raises(ProtocolError) as ei:
        encode(b)
    assert ei.type is ProtocolError
    assert ei.value.field == field, str(ei.value)
    assert str(ei.value).startswith(field + ":")


def _body_turn(env):
    return env["body"]["groups"][1]["episodes"][0]["turns"][1]


DECODE_CASES = {
    "str-for-int": (lambda env: _body_turn(env).__setitem__("turn", "1"), f"{TURN}.turn"),
    "float-for-int": (lambda env: env["body"].__setitem__("policy_version", 1.0), "TrajectoryBatch.policy_version"),
    "int64-for-int32": (lambda env: _body_turn(env).__setitem__("response_ids", _ext(np.arange(9, dtype=np.int64))),
                        f"{TURN}.response_ids"),
    "float64-for-float32": (lambda env: _body_turn(env).__setitem__("response_logprobs", _ext(np.zeros(9))),
                            f"{TURN}.response_logprobs"),
    "2d-for-1d": (lambda env: _body_turn(env).__setitem__("context_ids", _ext(np.zeros((2, 3), np.int32))), f"{TURN}.context_ids"),
    "list-for-array": (lambda env: _body_turn(env).__setitem__("response_ids", [1, 2, 3]), f"{TURN}.response_ids"),
    "tensor-for-array": (lambda env: _body_turn(env).__setitem__("response_ids", _ext(torch.zeros(3, dtype=torch.int32))),
                         f"{TURN}.response_ids"),
    "missing-field": (lambda env: _body_turn(env).pop("response_ids"), f"{TURN}.response_ids"),
    "missing-top-field": (lambda env: env["body"].pop("groups"), "TrajectoryBatch.groups"),
    "unknown-field": (lambda env: _body_turn(env).__setitem__("bogus", 1), f"{TURN}.bogus"),
    "list-for-dict": (lambda env: env["body"].__setitem__("metrics", [0.5]), "TrajectoryBatch.metrics"),
    "list-for-message": (lambda env: env["body"]["groups"][0]["prompt"]["messages"].__setitem__(1, ["user", "q"]),
                         "TrajectoryBatch.groups[0].prompt.messages[1]"),
    "dict-for-list": (lambda env: env["body"]["groups"][1]["episodes"][0].__setitem__("turns", {}),
                      "TrajectoryBatch.groups[1].episodes[0].turns"),
    "bytes-for-str": (lambda env: env["body"]["groups"][1]["episodes"][0].__setitem__("uid", b"p1/0"),
                      "TrajectoryBatch.groups[1].episodes[0].uid"),
    "bad-dict-value": (lambda env: env["body"]["metrics"].__setitem__("bad", "x"), "TrajectoryBatch.metrics['bad']"),
    "list-for-scalar-in-dict": (lambda env: env["body"]["groups"][0]["prompt"]["extra"].__setitem__("k", [1]),
                                "TrajectoryBatch.groups[0].prompt.extra['k']"),
    "none-for-int": (lambda env: _body_turn(env).__setitem__("mem_end", None), f"{TURN}.mem_end"),
}


@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("expected", [None, M.TrajectoryBatch], ids=["any", "expected"])
def test_decode_wrong_types_name_the_field(case, expected):
    mutate, field = DECODE_CASES[case]
    env = _unpack(encode(make_batch()))
    mutate(env)
    with pytest.raises(ProtocolError) as ei:
        decode(_repack(env), expected=expected)
    assert ei.type is ProtocolError
    assert ei.value.field == field, str(ei.value)


def test_unencodable_values():
    b = make_batch()
    b.groups[0].prompt.extra["big"] = 2**70  # an int msgpack cannot carry
    with pytest.raises(ProtocolError) as ei:
        encode(b)
    assert ei.type is ProtocolError and ei.value.field == "TrajectoryBatch"
    with pytest.raises(ProtocolError, match="not a registered message"):
        encode(object())


def test_same_is_strict():
    a, b = make_batch(), make_batch()
    assert same(a, b)
    b.groups[0].episodes[0].turns[0].response_logprobs[0] = np.nextafter(b.groups[0].episodes[0].turns[0].response_logprobs[0],
                                                                         np.float32(0))
    assert not same(a, b)
    assert not same(np.zeros(3, np.int32), np.zeros(3, np.int64))
    assert not same(0.0, -0.0) and same(float("nan"), float("nan"))
    assert not same(torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16))
    assert same(torch.tensor(2.5), torch.tensor(2.5)) and not same(torch.tensor(2.5), torch.tensor([2.5]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode(encode(M.WeightUpdate(version=0, tensors={"x": torch.ones(3)})))  # no read-only buffer warning leaks
