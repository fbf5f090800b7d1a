"""Beyond one process: layer-range parts, their merge, and Ray executors."""
