"""mempo learner service."""
