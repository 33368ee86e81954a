"""Deploy one service with Serve and, when its replicas fail to start, say why at the command line.

``serve.run`` reports a replica that keeps failing in its constructor only as "Deploying application
learner failed: Failed to update the deployments ['learner']"; the exception itself (a missing
checkpoint file, a bad model path, an import error) sits in the deployment's status message and in
Ray's replica logs. ``deploy`` reads that message and raises ``ServiceStartError`` with the cause, the
innermost exception's type and text (which names the setting or path involved, where mempo raised
it), so the CLI prints it:

    handle = deploy(app, name="learner", route_prefix=None, service="learner")
    # error: the learner service failed to start: FileNotFoundError: runs/x/checkpoints/... is missing ...
"""

from __future__ import annotations

import logging
import re

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
        cause, detail = startup_failure(name)
        if detail:
            log.debug("%s failed to start:\n%s", name, detail)
        raise ServiceStartError(service, cause or str(e), detail) from None
