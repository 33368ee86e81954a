"""mempo rollout service."""
