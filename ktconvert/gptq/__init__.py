"""GPTQ for routed experts through llmcompressor's own functions, one decoder layer at a time.

* ``loop.py``: the layer-streaming calibration loop (meta skeleton, lazy per-layer weights, hidden states carried
  layer to layer, one expert's Hessians at a time) -> ``LayerStream``.
* ``calibration.py``: ``--calibration FILE`` (jsonl of {"text": ...} or {"input_ids": [...]}).
* ``amx.py``: the CPU variant (per-row scales mapped 1:1 onto kt-kernel's AMXINT4/AMXINT8 files).

Heavy imports (torch, transformers, llmcompressor) happen inside functions.
"""
