"""Helpers that are not part of the serving path (e.g. building tiny test checkpoints)."""
