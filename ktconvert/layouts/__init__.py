"""Pure index math: kernel tile orders and NUMA splits. numpy only; no I/O."""
