"""Fair admission to one scorer replica's model: a bounded queue, concurrent scoring, and weight
updates that never overlap scoring.

    gate = Gate(max_queued=16, max_concurrent=2, timeout_s=5.0)
    async with gate.rest():          # a REST request: Busy (-> 503 + Retry-After) when the queue is
        ...                          # full or no slot came within timeout_s; max_concurrent at once
    async with gate.shared():        # a training-path scoring call: no queue limit, no timeout
        ...
    async with gate.exclusive():     # a weight update: waits for every scorer to finish, and new
        ...                          # ones wait for it (it goes first: updates are never starved)

Scoring only reads the model, so scoring calls run side by side (each in its own thread): a short
REST request runs beside a long one instead of waiting behind it, and when every slot is busy it
gets a 503 within ``timeout_s`` rather than waiting indefinitely. A request is scored wholly by one
weight version, because an update waits until no scoring is in flight.
"""

from __future__ import annotations

import asyncio
import math
from contextlib import asynccontextmanager


class Busy(Exception):
    """No scoring slot: the caller should retry after ``retry_after`` seconds."""

    def __init__(self, reason: str, retry_after: int):
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


class Gate:
    def __init__(self, max_queued: int, max_concurrent: int, timeout_s: float):
        self.configure(max_queued, max_concurrent, timeout_s)
        self.cond = asyncio.Condition()
        self.queued = 0        # REST requests admitted: waiting or scoring
        self.rest_active = 0   # REST requests scoring now
        self.active = 0        # every scoring call now (REST and training path)
        self.writers = 0       # weight updates waiting or running
        self.writing = False
        self.stats = {"rejected_full": 0, "rejected_timeout": 0}

    def configure(self, max_queued: int, max_concurrent: int, timeout_s: float) -> None:
        self.max_queued, self.max_concurrent, self.timeout_s = max_queued, max_concurrent, timeout_s

    @property
    def retry_after(self) -> int:
        return max(1, math.ceil(self.timeout_s))

    async def _wait(self, ready, timeout: float | None) -> bool:
        """Wait (holding ``cond``) until ``ready()``; False if ``timeout`` seconds passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not ready():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self.cond.wait(), left)
            except asyncio.TimeoutError:
                pass
        return True

    @asynccontextmanager
    async def rest(self):
        async with self.cond:
            if self.queued >= self.max_queued:
                self.stats["rejected_full"] += 1
                raise Busy(f"{self.queued} requests queued, the limit is {self.max_queued}", self.retry_after)
            self.queued += 1
            try:
                ok = await self._wait(lambda: not self.writers and self.rest_active < self.max_concurrent,
                                      self.timeout_s)
            except BaseException:
                self.queued -= 1
                self.cond.notify_all()
                raise
            if not ok:
                self.queued -= 1
                self.stats["rejected_timeout"] += 1
                raise Busy(f"no scoring slot within {self.timeout_s:g} s", self.retry_after)
            self.rest_active += 1
            self.active += 1
        try:
            yield
        finally:
            async with self.cond:
                self.rest_active -= 1
                self.active -= 1
                self.queued -= 1
                self.cond.notify_all()

    @asynccontextmanager
    async def shared(self):
        async with self.cond:
            await self._wait(lambda: not self.writers, None)
            self.active += 1
        try:
            yield
        finally:
            async with self.cond:
                self.active -= 1
                self.cond.notify_all()

    @asynccontextmanager
    async def exclusive(self):
        async with self.cond:
            self.writers += 1
            try:
                await self._wait(lambda: not self.active and not self.writing, None)
            except BaseException:
                self.writers -= 1
                self.cond.notify_all()
                raise
            self.writing = True
        try:
            yield
        finally:
            async with self.cond:
                self.writing = False
                self.writers -= 1
                self.cond.notify_all()
