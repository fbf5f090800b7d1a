"""MoE families: the manifests/ loader and resolver, and expert tensor names."""
