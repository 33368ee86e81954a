"""The scorer's admission gate with simulated work: a short request runs beside a long one, a full
queue or a long wait is a prompt Busy, and weight updates never overlap scoring."""

import asyncio
import time

import pytest

from services.scorer.admission import Busy, Gate


async def _job(gate: Gate, seconds: float, log: list, name: str):
    t0 = time.perf_counter()
    try:
        async with gate.rest():
            log.append(("start", name))
            await asyncio.sleep(seconds)
            log.append(("end", name))
        return name, "ok", time.perf_counter() - t0
    except Busy as e:
        return name, f"busy:{e.retry_after}", time.perf_counter() - t0


def test_a_short_request_is_not_stuck_behind_a_long_one():
    async def main():
        gate, log = Gate(max_queued=4, max_concurrent=2, timeout_s=0.5), []
        long = asyncio.create_task(_job(gate, 1.0, log, "long"))
        await asyncio.sleep(0.05)
        short = await _job(gate, 0.01, log, "short")
        return short, await long, log

    short, long, log = asyncio.run(main())
    assert short[1] == "ok" and short[2] < 0.3          # served while the long one still runs
    assert log.index(("end", "short")) < log.index(("end", "long"))
    assert long[1] == "ok"


def test_when_every_slot_is_busy_the_wait_ends_in_a_prompt_busy():
    async def main():
        gate, log = Gate(max_queued=4, max_concurrent=1, timeout_s=0.2), []
        long = asyncio.create_task(_job(gate, 1.0, log, "long"))
        await asyncio.sleep(0.05)
        short = await _job(gate, 0.01, log, "short")
        await long
        return short, gate

    short, gate = asyncio.run(main())
    assert short[1] == "busy:1" and 0.15 < short[2] < 0.5   # 503 after timeout_s, not after the long one
    assert gate.stats["rejected_timeout"] == 1 and gate.queued == 0


def test_a_full_queue_answers_busy_at_once():
    async def main():
        gate, log = Gate(max_queued=2, max_concurrent=1, timeout_s=5.0), []
        jobs = [asyncio.create_task(_job(gate, 0.3, log, f"j{i}")) for i in range(2)]
        await asyncio.sleep(0.05)
        third = await _job(gate, 0.01, log, "third")
        return third, await asyncio.gather(*jobs), gate

    third, done, gate = asyncio.run(main())
    assert third[1] == "busy:5" and third[2] < 0.05
    assert [d[1] for d in done] == ["ok", "ok"] and gate.stats["rejected_full"] == 1 and gate.queued == 0


def test_weight_updates_wait_for_scoring_and_hold_new_scoring_back():
    async def main():
        gate, events = Gate(max_queued=8, max_concurrent=4, timeout_s=5.0), []

        async def score(name, seconds, shared=False):
            async with (gate.shared() if shared else gate.rest()):
                events.append(("start", name, gate.writing))
                await asyncio.sleep(seconds)
                events.append(("end", name, gate.writing))

        async def update():
            async with gate.exclusive():
                events.append(("start", "update", gate.active))
                await asyncio.sleep(0.1)
                events.append(("end", "update", gate.active))

        first = [asyncio.create_task(score("rest", 0.2)), asyncio.create_task(score("train", 0.2, shared=True))]
        await asyncio.sleep(0.05)
        upd = asyncio.create_task(update())
        await asyncio.sleep(0.01)
        later = asyncio.create_task(score("later", 0.01))
        await asyncio.gather(*first, upd, later)
        return events

    events = asyncio.run(main())
    order = [(kind, name) for kind, name, _ in events]
    assert order.index(("start", "update")) > max(order.index(("end", "rest")), order.index(("end", "train")))
    assert order.index(("start", "later")) > order.index(("end", "update"))  # the update went first
    assert all(flag in (0, False) for _, _, flag in events)  # nothing scored while weights changed


@pytest.mark.parametrize("timeout,expected", [(0.2, 1), (5.0, 5), (7.5, 8)])
def test_retry_after_is_whole_seconds(timeout, expected):
    assert Gate(1, 1, timeout).retry_after == expected
