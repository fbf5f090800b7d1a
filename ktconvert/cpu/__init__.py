"""The CPU (kt-kernel) output: options, plan, conversion."""
