"""Architecture manifests: one TOML file per MoE family, shipped as the package ``ktconvert.manifests``.

Loaded by ``ktconvert.architecture``; see docs/architecture.md for the keys."""
