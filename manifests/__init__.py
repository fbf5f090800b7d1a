"""Architecture manifests: one TOML file per MoE family, shipped as the package ``ktconvert.manifests``.

Loaded by ``ktconvert.architectures.manifests``; see docs/architecture.md for the keys."""
