"""Adapters for other tools (lm-evaluation-harness); each imports its tool, so import the one you use."""
