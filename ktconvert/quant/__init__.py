"""Pure math: float matrices to integers + scales and back. numpy only; no I/O."""
