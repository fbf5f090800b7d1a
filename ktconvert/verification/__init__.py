"""``ktconvert verify``: checks of a finished output folder.

Modules: ``run`` (``verify(out, ...)``: the checks in order, ``render``), ``folder`` (the one walk of an output:
every shard header parsed once), ``structure`` (tensors / .kt files and byte counts as kt-kernel's loader finds
them), ``hashes`` (every file and tensor against ``ktconvert.json``), ``reader`` (kt-kernel's CPU files read the
way its loader reads them), ``numeric_amx`` / ``numeric_inplace`` (the converted experts run on random probes and
compared with the source), ``calibrated`` (``--calibration``: the same on the hidden states calibration tokens
produce in the source, the model's own routing, optionally side by side with a second output).
"""
