"""The services and the config sections their replicas read: the half of the service registry that
the services themselves need (a leaf: the standard library only).

The pipeline's registry (services/pipeline/registry.py) builds on this table: it adds each service's
app builder, deployment options, driver and restart rule, and lists the services in the same order.
A service's Serve code version (services/common/serve_version.py) covers only its sections, so a
config change restarts exactly the services that read what changed (``mempo compare`` keeps the rest).

Each entry is a section (``"search"``) or a single field of one (``"rollout.system_prompt"``); None
means every section. Checked by grepping each service package for ``cfg.<section>``;
tests/common/test_serve_version.py pins what a baseline's change restarts. ``world`` resolves a path
still named 'world'; ``ray`` holds the call timeouts; the scorer reads only the system prompt of the
rollout section (its REST default). The learner reads the whole config and restarts on any change.
"""

from __future__ import annotations

# In the order the pipeline deploys them: search first (the agent calls it), then the policy copies,
# then the learner that feeds them.
SECTIONS: dict[str, tuple[str, ...] | None] = {
    "search": ("search", "world", "ray"),
    "rollout": ("model", "engine", "rollout", "search", "world", "ray"),
    "scorer": ("model", "engine", "scorer", "rollout.system_prompt", "world", "ray"),
    "learner": None,
}


def sections_of(service: str) -> tuple[str, ...] | None:
    """The config sections ``service``'s replicas read (None: every one); a ValueError for a name that
    is not a service."""
    if service not in SECTIONS:
        raise ValueError(f"unknown service {service!r}; choose from {', '.join(SECTIONS)}")
    return SECTIONS[service]
