"""Embedded example models (tiny seeded checkpoints of every family) for demo and tests."""
