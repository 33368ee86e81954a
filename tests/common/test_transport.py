"""Messages through the Ray object store (services/common/transport.py): one actor puts a batch,
another fetches it by ref, and every side sees the same bits."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest

import services.common.messages as M
from services.common.codec import ProtocolError, encode, same
from services.common.transport import decode_payload, get_message, get_message_async, put_message


def build_batch(seed: int, groups: int = 3, episodes: int = 4, turns: int = 3) -> M.TrajectoryBatch:
    """A small but realistic TrajectoryBatch: growing contexts, int32 tokens, float32 logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = M.Prompt(uid=f"train-{seed}-{g}",
                          messages=[M.ChatMessage("system", "You are a search agent."),
                                    M.ChatMessage("user", f"Where was person {g} born?; Who founded company {g}?")],
                          golds=[[f"City {g}", f"city {g}"], [f"Person {g + 1}"]], extra={"k": 2, "hops": 2})
        eps = []
        for e in range(episodes):
            prompt_ids = rng.integers(0, 2048, int(rng.integers(40, 80)), dtype=np.int32)
            history = [prompt_ids]
            trs = []
            n_turns = int(rng.integers(1, turns + 1))
            for t in range(n_turns):
                full_prefix = np.concatenate(history)
                ctx = full_prefix if t == 0 else np.concatenate([prompt_ids, trs[-1].response_ids, history[-1]])
                resp = rng.integers(0, 2048, int(rng.integers(20, 60)), dtype=np.int32)
                last = t == n_turns - 1
                obs = np.zeros(0, np.int32) if last else rng.integers(0, 2048, int(rng.integers(10, 40)), dtype=np.int32)
                trs.append(M.TurnRecord(
                    turn=t, context_ids=ctx, response_ids=resp,
                    response_logprobs=np.log(rng.uniform(0.05, 1.0, len(resp))).astype(np.float32),
                    mem_start=-1 if t == 0 else 0, mem_end=-1 if t == 0 else int(rng.integers(5, 15)),
                    action="answer" if last else "search", action_text=f"query {g} {e} {t}",
                    observation_ids=obs, full_prefix_len=len(full_prefix), policy_version=7, finish_reason="stop"))
                history += [resp, obs]
            eps.append(M.Episode(uid=f"{prompt.uid}/{e}", sample=e, prompt_ids=prompt_ids, full_ids=np.concatenate(history),
                                 turns=trs, answer=f"City {g}; Person {g + 1}", finish_reason="answer",
                                 tool_calls=n_turns - 1))
        out.append(M.RolloutGroup(prompt=prompt, episodes=eps))
    return M.TrajectoryBatch(groups=out, policy_version=7, step=3, metrics={"rollout/time_s": 1.25})


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


@pytest.fixture(scope="module")
def actors(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Producer:
        def produce(self, seed: int):
            batch = build_batch(seed)
            ref = put_message(batch)
            return [ref], _digest(encode(batch))  # wrapped in a list: it stays a ref

    @ray.remote(num_cpus=0)
    class Consumer:
        def consume(self, refs):
            (ref,) = refs
            assert isinstance(ref, ray.ObjectRef)
            batch = get_message(ref, M.TrajectoryBatch, timeout=60)
            turns = sum(len(ep.turns) for grp in batch.groups for ep in grp.episodes)
            return encode(batch), turns

        def consume_resolved(self, payload):
            # a top-level ref argument arrives as the bytes themselves
            assert isinstance(payload, bytes)
            return encode(decode_payload(payload, M.TrajectoryBatch))

        def consume_wrong(self, refs):
            try:
                get_message(refs[0], M.TrajectoryBatch, timeout=60)
            except ProtocolError as e:
                return type(e).__name__, e.field
            return "no error", ""

    producer, consumer = Producer.remote(), Consumer.remote()
    yield producer, consumer
    ray.kill(producer)
    ray.kill(consumer)


def test_batch_through_two_actors_is_bit_identical(ray_cluster, actors):
    ray = ray_cluster
    producer, consumer = actors
    refs, producer_digest = ray.get(producer.produce.remote(11), timeout=120)
    assert isinstance(refs, list) and isinstance(refs[0], ray.ObjectRef)

    local = build_batch(11)
    assert sum(len(ep.turns) for g in local.groups for ep in g.episodes) > 6
    local_bytes = encode(local)
    assert _digest(local_bytes) == producer_digest  # the producer built the same bytes

    # the driver decodes the producer's ref
    fetched = get_message(refs[0], M.TrajectoryBatch, timeout=60)
    assert same(fetched, local)
    assert ray.get(refs[0]) == local_bytes

    # the consumer fetches by ref, decodes, re-encodes: same bytes
    consumer_bytes, turns = ray.get(consumer.consume.remote(refs), timeout=120)
    assert consumer_bytes == local_bytes
    assert turns == sum(len(ep.turns) for g in local.groups for ep in g.episodes)

    # and a top-level ref arrives resolved, which decode_payload handles
    assert ray.get(consumer.consume_resolved.remote(refs[0]), timeout=120) == local_bytes

    # a different seed gives a different batch
    assert not same(build_batch(12), fetched)


def test_decode_payload_accepts_ref_or_bytes(ray_cluster):
    batch = build_batch(5, groups=1, episodes=2, turns=2)
    ref = put_message(batch)
    assert same(decode_payload(ref, M.TrajectoryBatch), batch)
    assert same(decode_payload(ray_cluster.get(ref), M.TrajectoryBatch), batch)
    assert same(asyncio.run(_fetch_async(ref)), batch)


async def _fetch_async(ref):
    return await get_message_async(ref, M.TrajectoryBatch)


def test_get_message_of_another_kind_raises(ray_cluster, actors):
    ray = ray_cluster
    ref = put_message(M.Metrics(stage="scorer", step=1, values={"x": 1.0}))
    with pytest.raises(ProtocolError) as ei:
        get_message(ref, M.TrajectoryBatch, timeout=60)
    assert ei.type is ProtocolError and ei.value.field == "TrajectoryBatch.kind"
    assert "Metrics" in str(ei.value)
    with pytest.raises(ProtocolError):
        asyncio.run(_fetch_async(ref))

    _, consumer = actors
    assert ray.get(consumer.consume_wrong.remote([ref]), timeout=120) == ("ProtocolError", "TrajectoryBatch.kind")


def test_get_message_rejects_non_refs_and_non_bytes(ray_cluster):
    raw = encode(build_batch(1, groups=1, episodes=1, turns=1))
    with pytest.raises(ProtocolError, match="ObjectRef"):
        get_message(raw, M.TrajectoryBatch)  # bytes, not a ref
    with pytest.raises(ProtocolError, match="expected bytes"):
        get_message(ray_cluster.put({"not": "bytes"}), M.TrajectoryBatch, timeout=60)
    with pytest.raises(ProtocolError) as ei:
        get_message(ray_cluster.put(raw[: len(raw) // 2]), M.TrajectoryBatch, timeout=60)
    assert ei.type is ProtocolError
