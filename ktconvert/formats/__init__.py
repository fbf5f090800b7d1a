"""Sources (readers of checkpoints) and sinks (writers of outputs). Only this package opens model files."""
