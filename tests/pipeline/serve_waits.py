"""Test waits that follow Serve's own events, not one machine's speed.

    wait_while_serve_replaces(lambda: len(replicas()) == 2, "e2e-rollout", "rollout")

polls ``done()`` for as long as Serve is starting a replica of the deployment (a cold vLLM start takes
seconds on a fast machine, minutes on a loaded one): it fails only when nothing has been starting for
``quiet_s`` (Serve is not replacing anything, so ``done()`` will not come), or past a ceiling far above
any start-up (a hang).
"""

from __future__ import annotations

import time

from services.common.replicas import STARTING_STATES


def replica_states(app: str, deployment: str) -> dict:
    from ray import serve

    status = serve.status().applications.get(app)
    d = status.deployments.get(deployment) if status is not None else None
    return dict(d.replica_states) if d is not None else {}


def wait_while_serve_replaces(done, app: str, deployment: str, quiet_s: float = 30.0, ceiling_s: float = 1800.0,
                              poll_s: float = 0.5):
    t0 = last_busy = time.monotonic()
    while True:
        value = done()
        if value:
            return value
        now = time.monotonic()
        states = replica_states(app, deployment)
        if any(states.get(s, 0) for s in STARTING_STATES):
            last_busy = now
        assert now - last_busy < quiet_s, f"{app}: nothing starting for {quiet_s:g}s and not done; Serve says {states}"
        assert now - t0 < ceiling_s, f"{app}: still not done after {ceiling_s:g}s; Serve says {states}"
        time.sleep(poll_s)
