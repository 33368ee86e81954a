"""mempo scorer service."""
