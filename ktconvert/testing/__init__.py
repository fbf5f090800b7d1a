"""Test fixtures that ship with the package: seeded tiny checkpoints and a local hub stand-in."""
