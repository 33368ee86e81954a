"""Moving encoded messages through the Ray object store.

Stages hand each other ``ObjectRef``s to msgpack bytes, so a payload is written once and read
by whoever needs it; the driver forwards refs without decoding them. The services themselves
call the codec and Ray directly (docs/architecture.md); these helpers serve the tests.

    ref = put_message(batch)                     # encode + ray.put -> ObjectRef
    batch = get_message(ref, TrajectoryBatch)    # ray.get + decode (kind checked)
    batch = decode_payload(payload, TrajectoryBatch)  # inside a task/actor that got the bytes

Note (docs/architecture.md, Platform notes): an ObjectRef passed as a *top-level* argument to a
Ray task, actor or Serve handle arrives resolved (the callee gets the bytes); wrapped in a list it
stays a ref.
"""

from __future__ import annotations

from typing import Any, TypeVar

import ray

from services.common.codec import ProtocolError, decode, encode

T = TypeVar("T")


def put_message(msg: Any) -> "ray.ObjectRef":
    """Encode ``msg`` and put the bytes in the object store."""
    return ray.put(encode(msg))


def decode_payload(payload: Any, expected: type[T]) -> T:
    """Decode a payload that may be bytes or an already-fetched ObjectRef value."""
    if isinstance(payload, ray.ObjectRef):
        payload = ray.get(payload)
    return decode(payload, expected)


def get_message(ref: "ray.ObjectRef", expected: type[T], timeout: float | None = None) -> T:
    """Fetch the bytes behind ``ref`` and decode them as ``expected``."""
    if not isinstance(ref, ray.ObjectRef):
        raise ProtocolError(expected.__name__, f"expected an ObjectRef, got {type(ref).__name__}")
    return decode(ray.get(ref, timeout=timeout), expected)


async def get_message_async(ref: "ray.ObjectRef", expected: type[T]) -> T:
    """``get_message`` for asyncio code (Serve replicas, async actors)."""
    if not isinstance(ref, ray.ObjectRef):
        raise ProtocolError(expected.__name__, f"expected an ObjectRef, got {type(ref).__name__}")
    return decode(await ref, expected)
