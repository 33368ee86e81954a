"""Type-checked conversion between message dataclasses and plain trees: the core of codec.py.

Each annotation compiles once into a converter (:func:`converter`, cached by annotation, array
metadata and mode): mode "out" turns a live value into a msgpack-able tree (encode), mode "in" turns
a decoded tree into typed objects (decode). Both check types. The hot path formats no strings: a
failure raises :class:`Bad`, and each enclosing container adds its step of the field path to
``Bad.trail`` while the exception unwinds; codec.py turns it into a ProtocolError naming the path.

    converter(TrajectoryBatch, (), "out")(batch)   # -> {"groups": [...], "policy_version": 5, ...}
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

import numpy as np


def hints(cls: type) -> dict[str, Any]:
    """A message class's resolved annotations, cached on the class (codec.message resets them)."""
    if cls.__dict__.get("__hints__") is None:
        cls.__hints__ = typing.get_type_hints(cls)
    return cls.__hints__


def _torch_tensor():
    import torch  # only a message with a tensor field needs torch

    return torch.Tensor


class Bad(Exception):
    """A conversion failed: ``problem`` says why, ``trail`` collects the field path innermost first."""

    def __init__(self, problem: str):
        self.problem = problem
        self.trail: list[str] = []


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _is_tensor_type(tp: Any) -> bool:
    return getattr(tp, "__module__", "").startswith("torch") and _type_name(tp) == "Tensor"


_CONVERTERS: dict[tuple, Any] = {}


def converter(tp: Any, meta: tuple, mode: str):
    """The converter of annotation ``tp`` with array metadata ``meta`` (sorted items) in ``mode``
    ("out": encode, "in": decode), compiled on first use."""
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
            raise Bad(f"expected {name}, got {type(v).__name__}")
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
            raise Bad(f"expected an ndarray, got {type(v).__name__}")
        if v.dtype != dtype:
            raise Bad(f"expected dtype {dtype}, got {v.dtype}")
        if v.ndim != 1:
            raise Bad(f"expected 1-d array, got shape {v.shape}")
        if not v.flags.c_contiguous:
            v = np.ascontiguousarray(v)
        return v.data.cast("B") if v.size else b""

    def into(v):
        if type(v) is not bytes:
            raise Bad(f"expected an array's bytes, got {type(v).__name__}")
        if len(v) % size:
            raise Bad(f"{len(v)} bytes are not a whole number of {dtype} items")
        return np.frombuffer(v, dtype=dtype)
    return out if mode == "out" else into


def _compile(tp: Any, meta: dict, mode: str):
    """The converter of one annotation: containers and messages convert their items with their own
    converters (an array's dtype and rank, ``meta``, pass down to them), arrays and scalars check."""
    origin = typing.get_origin(tp)
    metakey = tuple(sorted(meta.items()))
    if tp is Any:
        return lambda v: v
    if origin is Union or origin is types.UnionType:
        return _compile_union(tp, metakey, mode)
    if origin is list:
        return _compile_list(typing.get_args(tp)[0], metakey, mode)
    if origin is dict:
        return _compile_dict(typing.get_args(tp)[1], metakey, mode)
    if dataclasses.is_dataclass(tp):
        return _compile_dataclass(tp, mode)
    if tp is np.ndarray:
        return _compile_array(meta, mode)
    return _compile_scalar(tp)


def _compile_union(tp: Any, metakey: tuple, mode: str):
    """``Optional[T]`` / ``Union[...]``: None where optional, else the first member that converts."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = len(args) < len(typing.get_args(tp))
    convs = [converter(a, metakey, mode) for a in args]

    def union(v):
        if v is None and optional:
            return None
        for c in convs:
            try:
                return c(v)
            except Bad:
                pass
        raise Bad(f"expected {_type_name(tp)}, got {type(v).__name__}")
    return union


def _compile_list(item_tp: Any, metakey: tuple, mode: str):
    """``list[T]`` (a tuple is accepted): each item converted; a bad one adds ``[i]`` to the path."""
    item = converter(item_tp, metakey, mode)

    def listing(v):
        if not isinstance(v, (list, tuple)):
            raise Bad(f"expected a list, got {type(v).__name__}")
        out = []
        try:
            for x in v:
                out.append(item(x))
        except Bad as e:
            e.trail.append(f"[{len(out)}]")
            raise
        return out
    return listing


def _compile_dict(value_tp: Any, metakey: tuple, mode: str):
    """``dict[str, T]``: str keys, each value converted; a bad one adds ``['key']`` to the path."""
    val = converter(value_tp, metakey, mode)

    def mapping(v):
        if not isinstance(v, dict):
            raise Bad(f"expected a mapping, got {type(v).__name__}")
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise Bad(f"mapping keys must be str, got {type(k).__name__}")
            try:
                out[k] = val(x)
            except Bad as e:
                e.trail.append(f"[{k!r}]")
                raise
        return out
    return mapping


def _compile_array(meta: dict, mode: str):
    """``np.ndarray``: a 1-d field of a declared dtype travels as raw bytes (:func:`_raw_array`); any
    other array is checked against the dtype and rank it declares and travels as ext type 1."""
    dtype = np.dtype(meta["dtype"]) if meta.get("dtype") else None
    ndim = meta.get("ndim")
    if dtype is not None and ndim == 1:  # the schema knows dtype and rank: only the raw bytes travel
        return _raw_array(dtype, mode)

    def array(v):
        if not isinstance(v, np.ndarray):
            raise Bad(f"expected an ndarray, got {type(v).__name__}")
        if dtype is not None and v.dtype != dtype:
            raise Bad(f"expected dtype {dtype}, got {v.dtype}")
        if ndim is not None and v.ndim != ndim:
            raise Bad(f"expected {ndim}-d array, got shape {v.shape}")
        return v
    return array


def _compile_scalar(tp: Any):
    """A torch tensor or a scalar (:func:`_scalar`); any other annotation fails every value."""
    if _is_tensor_type(tp):
        torch_tensor = _torch_tensor()
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
        raise Bad(f"unsupported field type {_type_name(tp)}")
    return unsupported


def _compile_dataclass(cls: type, mode: str):
    """A message: a live instance or a mapping of its fields (no unknown ones; a missing one only where
    it has a default), each field converted by its annotation's converter."""
    annotations = hints(cls)
    fields = dataclasses.fields(cls)
    names = frozenset(f.name for f in fields)
    plan = [(f.name, converter(annotations[f.name], tuple(sorted(f.metadata.items())), mode),
             f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING) for f in fields]

    def convert(v):
        if isinstance(v, cls):
            d = v.__dict__  # a live message (an attribute may have been deleted: then it is missing)
        elif isinstance(v, dict):
            if not names.issuperset(v):
                bad = Bad("unknown field")
                bad.trail.append("." + sorted(map(str, set(v) - names))[0])
                raise bad
            d = v
        else:
            raise Bad(f"expected a {cls.__name__} mapping, got {type(v).__name__}")
        out = {}
        for name, conv, has_default in plan:
            try:
                if name not in d:
                    if has_default:
                        continue
                    raise Bad("missing field")
                out[name] = conv(d[name])
            except Bad as e:
                e.trail.append("." + name)
                raise
        return out if mode == "out" else cls(**out)
    return convert
