"""A steady REST load on the scorer's ``POST /score`` while something else happens (``mempo chaos``).

    load = RestLoad("http://127.0.0.1:8000/scorer/score", bodies, rate=1.0, max_calls=1000)
    load.start(); ...; calls = load.stop()   # [{"t", "status", "seconds", "retry_after", "error"}, ...]

Requests go out at ``rate`` per second (a sender thread each, ``senders`` of them, so a slow answer
does not stop the clock), at most ``max_calls`` in all. Status 0 means no HTTP answer (a refused
connection or the client's timeout), with the exception's name in ``error``. The load counts from the endpoint's
first 200: what comes before it (the app still starting: refused connections, 404) is not recorded.
"""

from __future__ import annotations

import itertools
import threading
import time

import httpx


class RestLoad:
    def __init__(self, url: str, bodies: list[dict], rate: float = 1.0, max_calls: int = 1000,
                 timeout_s: float = 60.0, senders: int = 4):
        if not bodies or rate <= 0:
            raise ValueError("RestLoad needs request bodies and a rate > 0")
        self.url, self.bodies, self.rate, self.max_calls = url, bodies, rate, max_calls
        self.timeout_s, self.senders = timeout_s, senders
        self.calls: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = itertools.count()
        self._answered = threading.Event()  # the endpoint gave a first answer: from then on, every call counts
        self._threads: list[threading.Thread] = []
        self._t0 = 0.0

    def start(self) -> "RestLoad":
        self._t0 = time.time()
        self._threads = [threading.Thread(target=self._send, name=f"rest-load-{i}", daemon=True)
                         for i in range(self.senders)]
        for t in self._threads:
            t.start()
        return self

    def _send(self) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                i = next(self._next)
                if i >= self.max_calls:
                    return
                due = self._t0 + i / self.rate
                if self._stop.wait(max(0.0, due - time.time())):
                    return
                t = time.time()
                record = {"t": t, "status": 0, "seconds": 0.0, "retry_after": None, "error": None}
                try:
                    r = client.post(self.url, json=self.bodies[i % len(self.bodies)])
                    record.update(status=r.status_code, retry_after=r.headers.get("retry-after"))
                    if r.status_code == 200:
                        self._answered.set()
                except httpx.HTTPError as e:
                    record["error"] = type(e).__name__
                record["seconds"] = time.time() - t
                if self._answered.is_set():
                    with self._lock:
                        self.calls.append(record)

    def stop(self) -> list[dict]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 5)
        with self._lock:
            return sorted(self.calls, key=lambda c: c["t"])


def summary(calls: list[dict]) -> dict:
    """Counts by status and latency percentiles (seconds) of the answered calls."""
    by_status: dict[str, int] = {}
    for c in calls:
        by_status[str(c["status"])] = by_status.get(str(c["status"]), 0) + 1
    lat = sorted(c["seconds"] for c in calls if c["status"])
    pct = {f"p{q}": lat[min(len(lat) - 1, int(q / 100 * len(lat)))] if lat else None for q in (50, 90, 99)}
    return {"calls": len(calls), "by_status": by_status, **pct, "max": lat[-1] if lat else None}
