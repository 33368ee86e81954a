"""Shared pieces of the mempo services: the message protocol, its codec, the config tree."""
