"""One pass: inputs, options, targets, planning, the read loop, outputs and the journal."""
