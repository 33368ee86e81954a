"""msgpack encoding of typed messages: the wire format between mempo's services.

A message is a dataclass (see ``services/common/messages.py``) whose fields are annotated with
plain types: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``np.ndarray``, ``torch.Tensor``,
``list[T]``, ``dict[str, T]``, ``Optional[T]``, ``Union[...]`` of scalars, or another message
dataclass. The envelope is ``{"schema": SCHEMA_VERSION, "kind": <class name>, "body": {...}}``.

Arrays never become lists of numbers. A 1-d array field with a declared dtype (``array_field("int32")``:
nearly every array of a trajectory) travels as msgpack bin, its raw little-endian bytes alone; the
schema supplies dtype and rank, and decoding is ``np.frombuffer`` over them (a byte count that is not
a whole number of items is a ProtocolError). Any other numpy array travels as msgpack ext type 1:
a small header (dtype, shape) and the raw C-contiguous bytes. Decoded arrays are read-only views;
copy one to write. torch tensors travel as ext type 2 the same way, so bfloat16 weights survive.

Any problem on the way in or out (wrong schema version, wrong kind, truncated bytes, a missing or
mistyped field, an array of the wrong dtype or rank) raises :class:`ProtocolError`, which names the
field path, e.g. ``TrajectoryBatch.groups[2].episodes[0].turns[1].response_ids``.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import types
import typing
import warnings
from typing import Any, TypeVar, Union

import msgpack
import numpy as np

SCHEMA_VERSION = 2  # 2: 1-d arrays of a declared dtype travel as bare bytes (msgpack bin)
_EXT_NDARRAY = 1
_EXT_TENSOR = 2

T = TypeVar("T")
_REGISTRY: dict[str, type] = {}


class ProtocolError(ValueError):
    """A message could not be encoded or decoded; ``field`` is the dotted path of the problem."""

    def __init__(self, field: str, problem: str):
        self.field = field
        self.problem = problem
        super().__init__(f"{field}: {problem}")


def message(cls: type[T]) -> type[T]:
    """Class decorator: make ``cls`` a dataclass and register it as a wire message kind."""
    cls = dataclasses.dataclass(cls)
    _REGISTRY[cls.__name__] = cls
    cls.__hints__ = None  # resolved lazily (forward references)
    return cls


def array_field(dtype: str | None, ndim: int | None = 1, **kw: Any) -> Any:
    """A dataclass field holding an ndarray of the given dtype (None = any) and rank (None = any)."""
    return dataclasses.field(metadata={"dtype": dtype, "ndim": ndim}, **kw)


def _hints(cls: type) -> dict[str, Any]:
    if cls.__dict__.get("__hints__") is None:
        cls.__hints__ = typing.get_type_hints(cls)
    return cls.__hints__


# ---------------------------------------------------------------------------------------------
# arrays as ext types


def _torch():
    import torch

    return torch


def _pack_array(dtype: str, shape: tuple[int, ...], raw: bytes | memoryview) -> bytes:
    """ext payload: u8 len(dtype), dtype (ascii), u8 ndim, ndim x i64 shape, raw C-order bytes."""
    name = dtype.encode("ascii")
    head = struct.pack(f"<B{len(name)}sB{len(shape)}q", len(name), name, len(shape), *shape)
    return b"".join((head, raw))


def _unpack_array(data: bytes) -> tuple[str, tuple[int, ...], memoryview]:
    try:
        n = data[0]
        dtype = data[1 : 1 + n].decode("ascii")
        ndim = data[1 + n]
        shape = struct.unpack_from(f"<{ndim}q", data, 2 + n)
    except (IndexError, UnicodeDecodeError, struct.error):
        raise ValueError("array header is truncated or malformed") from None
    if shape and min(shape) < 0:
        raise ValueError("array header has a negative dimension")
    return dtype, shape, memoryview(data)[2 + n + 8 * ndim :]


def _tensor_bytes(t: Any) -> bytes:
    """Raw bytes of a tensor in C order (0-d, empty and bfloat16 tensors included)."""
    t = t.detach().to("cpu").contiguous()
    # .reshape(-1): .view(uint8) refuses 0-d tensors; empty tensors may have odd strides, so skip them
    return t.reshape(-1).view(_torch().uint8).numpy().tobytes() if t.numel() else b""


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.kind in "UVSM":
            raise TypeError(f"arrays of dtype {obj.dtype} cannot be sent")
        arr = obj if obj.flags.c_contiguous else np.ascontiguousarray(obj)  # (ascontiguousarray makes 0-d 1-d)
        return msgpack.ExtType(_EXT_NDARRAY, _pack_array(arr.dtype.str, arr.shape, arr.data.cast("B") if arr.size else b""))
    if isinstance(obj, np.generic):
        return obj.item()
    torch = _torch() if type(obj).__module__.startswith("torch") else None
    if torch is not None and isinstance(obj, torch.Tensor):
        name = str(obj.dtype).removeprefix("torch.")
        return msgpack.ExtType(_EXT_TENSOR, _pack_array(name, tuple(obj.shape), _tensor_bytes(obj)))
    raise TypeError(f"cannot encode {type(obj).__name__}")


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_NDARRAY:
        dtype, shape, raw = _unpack_array(data)
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise ValueError("object arrays are not allowed")
        count = math.prod(shape)
        if count * dt.itemsize != len(raw):
            raise ValueError(f"array payload has {len(raw)} bytes, header says {count} x {dt.itemsize}")
        return np.frombuffer(raw, dtype=dt, count=count).reshape(shape)
    if code == _EXT_TENSOR:
        torch = _torch()
        dtype, shape, raw = _unpack_array(data)
        tdt = getattr(torch, dtype, None)
        if not isinstance(tdt, torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        itemsize = torch.empty((), dtype=tdt).element_size()
        count = math.prod(shape)
        if count * itemsize != len(raw):
            raise ValueError(f"tensor payload has {len(raw)} bytes, header says {count} x {itemsize}")
        if count == 0:
            return torch.empty(shape, dtype=tdt)
        with warnings.catch_warnings():  # read-only buffer: torch warns, the tensor shares memory
            warnings.simplefilter("ignore")
            return torch.frombuffer(raw, dtype=tdt, count=count).reshape(shape)
    raise ValueError(f"unknown msgpack ext type {code}")


# ---------------------------------------------------------------------------------------------
# dataclass <-> plain tree, with type checks
#
# Each annotation compiles once into a converter: mode "out" turns a live value into a msgpack-able
# tree (encode), mode "in" turns a decoded tree into typed objects (decode). Both check types. The
# hot path formats no strings: a failure raises _Bad, and each enclosing container adds its step of
# the field path while the exception unwinds.


class _Bad(Exception):
    def __init__(self, problem: str):
        self.problem = problem
        self.trail: list[str] = []


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_tensor_type(tp: Any) -> bool:
    return getattr(tp, "__module__", "").startswith("torch") and _type_name(tp) == "Tensor"


_CONVERTERS: dict[tuple, Any] = {}


def _converter(tp: Any, meta: tuple, mode: str):
    key = (tp, meta, mode)
    conv = _CONVERTERS.get(key)
    if conv is None:
        conv = _CONVERTERS[key] = _compile(tp, dict(meta), mode)
    return conv


def _scalar(exact: type, check, name: str, cast):
    """A scalar converter: a value of exactly ``exact`` passes as is (the hot path); anything else
    must pass ``check`` (numpy scalars, subclasses, ints for floats) and is cast."""
    def conv(v):
        if type(v) is exact:
            return v
        if not check(v):
            raise _Bad(f"expected {name}, got {type(v).__name__}")
        return cast(v)
    return conv


def _raw_array(dtype: np.dtype, mode: str):
    """A 1-d array field of a declared dtype travels as msgpack bin: its raw little-endian bytes,
    nothing else (dtype and rank come from the schema). Out: check the array, hand over its buffer.
    In: bytes of a whole number of items -> a read-only ``np.frombuffer`` view."""
    dtype = dtype.newbyteorder("<")  # the wire is little-endian
    size = dtype.itemsize

    def out(v):
        if not isinstance(v, np.ndarray):
            raise _Bad(f"expected an ndarray, got {type(v).__name__}")
        if v.dtype != dtype:
            raise _Bad(f"expected dtype {dtype}, got {v.dtype}")
        if v.ndim != 1:
            raise _Bad(f"expected 1-d array, got shape {v.shape}")
        if not v.flags.c_contiguous:
            v = np.ascontiguousarray(v)
        return v.data.cast("B") if v.size else b""

    def into(v):
        if type(v) is not bytes:
            raise _Bad(f"expected an array's bytes, got {type(v).__name__}")
        if len(v) % size:
            raise _Bad(f"{len(v)} bytes are not a whole number of {dtype} items")
        return np.frombuffer(v, dtype=dtype)
    return out if mode == "out" else into


def _compile(tp: Any, meta: dict, mode: str):
    origin = typing.get_origin(tp)
    metakey = tuple(sorted(meta.items()))
    if tp is Any:
        return lambda v: v
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        convs = [_converter(a, metakey, mode) for a in args]

        def union(v):
            if v is None and optional:
                return None
            for c in convs:
                try:
                    return c(v)
                except _Bad:
                    pass
            raise _Bad(f"expected {_type_name(tp)}, got {type(v).__name__}")
        return union
    if origin is list:
        item = _converter(typing.get_args(tp)[0], metakey, mode)

        def listing(v):
            if not isinstance(v, (list, tuple)):
                raise _Bad(f"expected a list, got {type(v).__name__}")
            out = []
            try:
                for x in v:
                    out.append(item(x))
            except _Bad as e:
                e.trail.append(f"[{len(out)}]")
                raise
            return out
        return listing
    if origin is dict:
        val = _converter(typing.get_args(tp)[1], metakey, mode)

        def mapping(v):
            if not isinstance(v, dict):
                raise _Bad(f"expected a mapping, got {type(v).__name__}")
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise _Bad(f"mapping keys must be str, got {type(k).__name__}")
                try:
                    out[k] = val(x)
                except _Bad as e:
                    e.trail.append(f"[{k!r}]")
                    raise
            return out
        return mapping
    if dataclasses.is_dataclass(tp):
        return _compile_dataclass(tp, mode)
    if tp is np.ndarray:
        dtype = np.dtype(meta["dtype"]) if meta.get("dtype") else None
        ndim = meta.get("ndim")
        if dtype is not None and ndim == 1:  # the schema knows dtype and rank: only the raw bytes travel
            return _raw_array(dtype, mode)

        def array(v):
            if not isinstance(v, np.ndarray):
                raise _Bad(f"expected an ndarray, got {type(v).__name__}")
            if dtype is not None and v.dtype != dtype:
                raise _Bad(f"expected dtype {dtype}, got {v.dtype}")
            if ndim is not None and v.ndim != ndim:
                raise _Bad(f"expected {ndim}-d array, got shape {v.shape}")
            return v
        return array
    if _is_tensor_type(tp):
        torch_tensor = _torch().Tensor
        return _scalar(torch_tensor, lambda v: isinstance(v, torch_tensor), "a torch.Tensor", lambda v: v)
    if tp is bool:
        return _scalar(bool, lambda v: isinstance(v, np.bool_), "bool", bool)
    if tp is int:
        return _scalar(int, lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)), "int", int)
    if tp is float:
        return _scalar(float, lambda v: isinstance(v, (int, float, np.integer, np.floating))
                       and not isinstance(v, (bool, np.bool_)), "float", float)
    if tp is str:
        return _scalar(str, lambda v: isinstance(v, str), "str", str)
    if tp is bytes:
        return _scalar(bytes, lambda v: isinstance(v, (bytes, bytearray, memoryview)), "bytes", bytes)

    def unsupported(v):
        raise _Bad(f"unsupported field type {_type_name(tp)}")
    return unsupported


def _compile_dataclass(cls: type, mode: str):
    hints = _hints(cls)
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields)
    plan = [(f.name, _converter(hints[f.name], tuple(sorted(f.metadata.items())), mode),
             f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING) for f in fields]

    def convert(v):
        if isinstance(v, cls):
            d = v.__dict__  # a live message (an attribute may have been deleted: then it is missing)
        elif isinstance(v, dict):
            if not names.issuperset(v):
                bad = _Bad("unknown field")
                bad.trail.append("." + sorted(map(str, set(v) - names))[0])
                raise bad
            d = v
        else:
            raise _Bad(f"expected a {cls.__name__} mapping, got {type(v).__name__}")
        out = {}
        for name, conv, has_default in plan:
            try:
                if name not in d:
                    if has_default:
                        continue
                    raise _Bad("missing field")
                out[name] = conv(d[name])
            except _Bad as e:
                e.trail.append("." + name)
                raise
        return out if mode == "out" else cls(**out)
    return convert


def _convert(cls: type, value: Any, mode: str) -> Any:
    try:
        return _converter(cls, (), mode)(value)
    except _Bad as e:
        raise ProtocolError(cls.__name__ + "".join(reversed(e.trail)), e.problem) from None


def validate(msg: Any) -> None:
    """Check a live message against its declared types (raises ProtocolError)."""
    cls = type(msg)
    if cls.__name__ not in _REGISTRY:
        raise ProtocolError(cls.__name__, "not a registered message type")
    _convert(cls, msg, "out")


# ---------------------------------------------------------------------------------------------
# public API


def encode(msg: Any) -> bytes:
    """Message -> msgpack bytes (validated first, so a bad message fails here, not at the peer)."""
    cls = type(msg)
    if cls.__name__ not in _REGISTRY:
        raise ProtocolError(cls.__name__, "not a registered message type")
    env = {"schema": SCHEMA_VERSION, "kind": cls.__name__, "body": _convert(cls, msg, "out")}
    try:
        return msgpack.packb(env, default=_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(cls.__name__, f"cannot encode: {e}") from None


def decode(data: bytes | bytearray | memoryview, expected: type[T] | None = None) -> T:
    """msgpack bytes -> message. ``expected`` (a message class) also checks the kind."""
    where = expected.__name__ if expected is not None else "message"
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(where, f"expected bytes, got {type(data).__name__}")
    try:
        env = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types on bad input
        raise ProtocolError(where, f"malformed payload ({type(e).__name__}: {e})") from None
    if not isinstance(env, dict):
        raise ProtocolError(where, "malformed payload (no envelope)")
    schema = env.get("schema")
    if type(schema) is not int or schema != SCHEMA_VERSION:  # (an array here must not reach `!=`)
        raise ProtocolError(f"{where}.schema", f"schema version {schema!r} is not supported (this build speaks {SCHEMA_VERSION})")
    kind = env.get("kind")
    if not isinstance(kind, str) or kind not in _REGISTRY:
        raise ProtocolError(f"{where}.kind", f"unknown message kind {kind!r}")
    if expected is not None and kind != expected.__name__:
        raise ProtocolError(f"{where}.kind", f"expected a {expected.__name__}, got a {kind}")
    if set(env) != {"schema", "kind", "body"}:
        raise ProtocolError(where, f"unexpected envelope keys {sorted(map(str, env))}")
    cls = _REGISTRY[kind]
    return _convert(cls, env["body"], "in")


def registered_messages() -> dict[str, type]:
    """Every message kind known to this build, by name."""
    return dict(_REGISTRY)


def same(a: Any, b: Any) -> bool:
    """Bit-identical comparison of two messages (arrays by dtype, shape and bytes)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a).__module__.startswith("torch"):
        torch = _torch()
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and _tensor_bytes(a) == _tensor_bytes(b))
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    return type(a) is type(b) and a == b
