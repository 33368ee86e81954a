"""msgpack encoding of typed messages: the wire format between mempo's services.

A message is a dataclass (see ``services/common/messages.py``) whose fields are annotated with
plain types: ``int``, ``float``, ``str``, ``bool``, ``bytes``, ``np.ndarray``, ``torch.Tensor``,
``list[T]``, ``dict[str, T]``, ``Optional[T]``, ``Union[...]`` of scalars, or another message
dataclass. The envelope is ``{"schema": SCHEMA_VERSION, "kind": <class name>, "body": {...}}``.

Arrays never become lists of numbers: a numpy array travels as msgpack ext type 1 holding a small
header (dtype, shape) and the raw C-contiguous bytes; decoding is ``np.frombuffer`` over those
bytes (no per-element work; the result is read-only, copy it to write). torch tensors travel as
ext type 2 the same way, so bfloat16 weights survive the trip.

Any problem on the way in or out (wrong schema version, wrong kind, truncated bytes, a missing or
mistyped field, an array of the wrong dtype or rank) raises :class:`ProtocolError`, which names the
field path, e.g. ``TrajectoryBatch.groups[2].episodes[0].turns[1].response_ids``.
"""

from __future__ import annotations

import dataclasses
import struct
import types
import typing
import warnings
from typing import Any, TypeVar, Union

import msgpack
import numpy as np

SCHEMA_VERSION = 1
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
    head = msgpack.packb([dtype, list(shape)])
    return struct.pack("<I", len(head)) + head + bytes(raw)


def _unpack_array(data: bytes) -> tuple[str, tuple[int, ...], memoryview]:
    if len(data) < 4:
        raise ValueError("array header is truncated")
    (hlen,) = struct.unpack_from("<I", data)
    if 4 + hlen > len(data):
        raise ValueError("array header is truncated")
    dtype, shape = msgpack.unpackb(data[4 : 4 + hlen])
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise ValueError("array header is malformed")
    return dtype, tuple(shape), memoryview(data)[4 + hlen :]


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
        count = int(np.prod(shape)) if shape else 1
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
        count = int(np.prod(shape)) if shape else 1
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


def _to_tree(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_tree(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_tree(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_tree(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(value: Any, tp: Any, path: str, meta: dict | None = None) -> Any:
    """Validate ``value`` (a decoded msgpack tree, or a live object) against annotation ``tp``;
    return the typed value (nested dataclasses instantiated). Raises ProtocolError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check(value, arg, path, meta)
            except ProtocolError:
                pass
        raise ProtocolError(path, f"expected {_type_name(tp)}, got {type(value).__name__}")
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ProtocolError(path, f"expected a list, got {type(value).__name__}")
        return [_check(v, item_tp, f"{path}[{i}]", meta) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ProtocolError(path, f"expected a mapping, got {type(value).__name__}")
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(path, f"mapping keys must be str, got {type(k).__name__}")
            out[k] = _check(v, val_tp, f"{path}[{k!r}]", meta)
        return out
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is np.ndarray:
        if not isinstance(value, np.ndarray):
            raise ProtocolError(path, f"expected an ndarray, got {type(value).__name__}")
        if meta:
            if meta.get("dtype") and value.dtype != np.dtype(meta["dtype"]):
                raise ProtocolError(path, f"expected dtype {meta['dtype']}, got {value.dtype}")
            if meta.get("ndim") is not None and value.ndim != meta["ndim"]:
                raise ProtocolError(path, f"expected {meta['ndim']}-d array, got shape {value.shape}")
        return value
    if getattr(tp, "__module__", "").startswith("torch") and _type_name(tp) == "Tensor":
        if not isinstance(value, _torch().Tensor):
            raise ProtocolError(path, f"expected a torch.Tensor, got {type(value).__name__}")
        return value
    if tp is bool:
        if not isinstance(value, (bool, np.bool_)):
            raise ProtocolError(path, f"expected bool, got {type(value).__name__}")
        return bool(value)
    if tp is int:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise ProtocolError(path, f"expected int, got {type(value).__name__}")
        return int(value)
    if tp is float:
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ProtocolError(path, f"expected float, got {type(value).__name__}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(path, f"expected str, got {type(value).__name__}")
        return value
    if tp is bytes:
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ProtocolError(path, f"expected bytes, got {type(value).__name__}")
        return bytes(value)
    raise ProtocolError(path, f"unsupported field type {_type_name(tp)}")


def _build(cls: type[T], value: Any, path: str) -> T:
    if isinstance(value, cls):
        live = value
        value = {f.name: getattr(live, f.name) for f in dataclasses.fields(cls) if hasattr(live, f.name)}
        if len(value) != len(dataclasses.fields(cls)):  # an attribute was deleted from the instance
            raise ProtocolError(f"{path}.{next(f.name for f in dataclasses.fields(cls) if f.name not in value)}", "missing field")
    if not isinstance(value, dict):
        raise ProtocolError(path, f"expected a {cls.__name__} mapping, got {type(value).__name__}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(value) - set(fields)
    if unknown:
        raise ProtocolError(f"{path}.{sorted(map(str, unknown))[0]}", "unknown field")
    kwargs = {}
    for name, f in fields.items():
        fpath = f"{path}.{name}"
        if name not in value:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if has_default:
                continue
            raise ProtocolError(fpath, "missing field")
        kwargs[name] = _check(value[name], hints[name], fpath, dict(f.metadata) or None)
    return cls(**kwargs)


def validate(msg: Any) -> None:
    """Check a live message against its declared types (raises ProtocolError)."""
    cls = type(msg)
    if cls.__name__ not in _REGISTRY:
        raise ProtocolError(cls.__name__, "not a registered message type")
    _build(cls, msg, cls.__name__)


# ---------------------------------------------------------------------------------------------
# public API


def encode(msg: Any) -> bytes:
    """Message -> msgpack bytes (validated first, so a bad message fails here, not at the peer)."""
    validate(msg)
    cls = type(msg)
    env = {"schema": SCHEMA_VERSION, "kind": cls.__name__, "body": _to_tree(msg)}
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
    return _build(cls, env["body"], cls.__name__)


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
