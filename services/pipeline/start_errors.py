"""Deploy services with Serve and, when their replicas fail to start, say why at the command line.

``serve.run`` reports a replica that keeps failing in its constructor only as "Deploying application
learner failed: Failed to update the deployments ['learner']"; the exception itself (a missing
checkpoint file, a bad model path, an import error) sits in the deployment's status message and in
Ray's replica logs. ``deploy`` reads that message and raises ``ServiceStartError`` with the cause, the
innermost exception's type and text (which names the setting or path involved, where mempo raised
it), so the CLI prints it:

    handle = deploy(app, name="learner", route_prefix=None, service="learner")
    # error: the learner service failed to start: FileNotFoundError: runs/x/checkpoints/... is missing ...

``deploy_all`` submits several applications in one call, so their replicas start side by side (a vLLM
engine, a scorer and an FSDP group each spend their start in imports and model loads), and returns each
one's handle with the seconds it took to run; ``delete_all`` removes several the same way.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

log = logging.getLogger("mempo.pipeline")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# an exception line at the start of a line: "FileNotFoundError: ...", "pydantic_core.ValidationError: ..."
_EXC = re.compile(r"^([A-Za-z_][\w.]*)(?:\([\w.]+\))?: ")


class ServiceStartError(RuntimeError):
    """A service's replicas failed in start-up; ``cause`` is the innermost exception, ``detail`` the
    deployment's whole status message (the replica's traceback)."""

    def __init__(self, service: str, cause: str, detail: str = ""):
        self.service, self.cause, self.detail = service, cause, detail
        super().__init__(f"the {service} service failed to start: {cause}")


def innermost_exception(message: str) -> str:
    """The last exception raised in a traceback text (Ray's and Serve's wrappers skipped), with the lines
    of its message; "" when the text holds none."""
    lines = _ANSI.sub("", message).splitlines()
    start = None
    for i, line in enumerate(lines):
        m = _EXC.match(line)
        if not m or m.group(1).startswith("ray.") or line.startswith("RuntimeError: Traceback"):
            continue
        start = i
    if start is None:
        return ""
    out = [lines[start]]
    for line in lines[start + 1:]:  # a message of several lines goes on until the next traceback part
        if line.startswith(("  File ", "Traceback ", "The above exception", "During handling")) or _EXC.match(line):
            break
        out.append(line)
    return "\n".join(x for x in out if x.strip()).strip()


def startup_failure(app_name: str) -> tuple[str, str]:
    """(cause, whole message) of the first failed deployment of a Serve application, from ``serve.status()``."""
    from ray import serve  # Ray on use: `mempo --help` imports this module

    status = serve.status().applications.get(app_name)
    if status is None:
        return "", ""
    messages = [d.message for d in status.deployments.values() if d.message and str(d.status).endswith("FAILED")]
    messages = messages or [d.message for d in status.deployments.values() if d.message] or [status.message]
    for message in messages:
        cause = innermost_exception(message)
        if cause:
            return cause, message
    return (messages[0].strip(), messages[0]) if messages else ("", "")


def deploy(app, name: str, route_prefix: str | None, service: str):
    """``serve.run`` that turns a failed start into ``ServiceStartError`` naming the replica's exception."""
    from ray import serve  # Ray on use (see startup_failure)

    try:
        return serve.run(app, name=name, route_prefix=route_prefix)
    except RuntimeError as e:
        if "failed" not in str(e):
            raise
        raise start_failed(name, service, str(e)) from None


def start_failed(name: str, service: str, fallback: str) -> ServiceStartError:
    """The ``ServiceStartError`` of application ``name``, its cause read from Serve's status (``fallback`` when
    the status names none); the whole message is logged at debug level."""
    cause, detail = startup_failure(name)
    if detail:
        log.debug("%s failed to start:\n%s", name, detail)
    return ServiceStartError(service, cause or fallback, detail)


@dataclass
class Target:
    """One application for ``deploy_all``: the bound app, its Serve name and route, the service it runs."""
    app: object
    name: str
    route_prefix: str | None
    service: str


def deploy_all(targets: list[Target], poll_s: float = 0.2) -> dict[str, tuple[object, float]]:
    """Deploy every target in one ``serve.run_many`` call and wait until all run: service -> (handle,
    seconds from the call until its application ran). The first application whose start fails raises
    ``ServiceStartError`` naming its replica's exception (the others keep starting; the caller's
    shutdown removes them, as after a failed ``deploy``)."""
    from ray import serve
    from ray.serve.api import RunTarget

    t0 = time.perf_counter()
    handles = serve.run_many([RunTarget(target=t.app, name=t.name, route_prefix=t.route_prefix) for t in targets],
                             wait_for_applications_running=False)
    waiting = {t.name: (t, h) for t, h in zip(targets, handles)}
    out: dict[str, tuple[object, float]] = {}
    while waiting:
        apps = serve.status().applications
        for name, (target, handle) in list(waiting.items()):
            status = apps.get(name)
            if status is None:  # not listed yet, or deleted while it started (another driver's shutdown)
                if time.perf_counter() - t0 > 30:
                    raise ServiceStartError(target.service, f"its application {name} is gone from Serve's status "
                                                            "while it started (deleted by another driver?)")
                continue
            state = str(status.status)
            if state.endswith("RUNNING"):
                out[target.service] = (handle, time.perf_counter() - t0)
                log.info("%s is up (%.1fs)", name, out[target.service][1])
                del waiting[name]
            elif state.endswith("DEPLOY_FAILED"):
                raise start_failed(name, target.service, status.message or "its application failed")
        if waiting:
            time.sleep(poll_s)
    return out


def delete_all(names: list[str], timeout_s: float = 60.0, poll_s: float = 0.2) -> None:
    """Delete Serve applications side by side and wait until every one is gone (their replicas stop
    together: an engine's and a learner group's shutdowns overlap); a timeout is logged, not raised."""
    from ray import serve

    for name in names:
        serve.delete(name, _blocking=False)
    deadline = time.monotonic() + timeout_s
    while (left := sorted(set(names) & set(serve.status().applications))) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if left:
        log.warning("applications still shutting down after %.0fs: %s", timeout_s, ", ".join(left))
