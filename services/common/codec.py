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
field path, e.g. ``TrajectoryBatch.groups[2].episodes[0].turns[1].response_ids``. The typed
conversion between messages and plain trees, with those checks, is services/common/codec_convert.py;
this module holds the envelope, the message registry and the array ext types.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from typing import Any, TypeVar

import msgpack
import numpy as np

from services.common.codec_convert import Bad, converter

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


# ---------------------------------------------------------------------------------------------
# arrays as ext types


def _torch():
    """torch, imported on the first tensor: the codec also serves processes that never touch one (the
    driver's prompt batches, REST clients), and importing torch costs them seconds."""
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
# dataclass <-> plain tree, with type checks (services/common/codec_convert.py)


def _convert(cls: type, value: Any, mode: str) -> Any:
    try:
        return converter(cls, (), mode)(value)
    except Bad as e:
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
