"""Calibration tokens streamed through a checkpoint one decoder layer at a time, and GPTQ for routed experts
on that stream (llmcompressor's own functions for the GPU checkpoint, a fixed-grid solve for kt-kernel's files).

* ``skeleton.py``: the meta-device transformers model (experts linearised), torch helpers.
* ``inputs.py``: the recording forward that gives layer 0's hidden states and every layer's keyword arguments.
* ``stream.py``: ``DecoderStream``: per-layer weights from safetensors, the layer's own forward, layer freed.
* ``hessians.py``: per-expert routes, Hessians and the llmcompressor GPTQ solve of one Linear.
* ``determinism.py``: the CPU kernels pinned (``pin_process``, ``deterministic_cpu``) so the bytes do not depend on
  the host's instruction set or cores.
* ``loop.py``: ``LayerStream`` (GPTQ on the stream; ``ExpertSolver``: its per-expert part, no forward),
  ``GpuQuantizer``; ``distributed.py``: the same stream with each layer's forward split by calibration sample and
  its experts by owner (``DistributedStream``; on Ray: ktconvert.distributed.ray_gptq); ``cpu.py``: the AMX variant
  (``mse``-searched per-row scales mapped 1:1 onto kt-kernel's AMXINT4/AMXINT8 files, codes from ``grid.py``).
* ``groups.py``: ``GroupQuantizer``, the same for in-place methods that declare a grouped grid (``gptq_grid``:
  GPTQ_INT4's -8..7 per group, F16 steps), written as the method's own tensors.
* ``holdout.py``: the fit / held-out split and the per-expert choice between GPTQ and the data-free codes.
* ``calibration.py``: ``--calibration FILE`` (jsonl of {"text": ...} or {"input_ids": [...]}).
* ``imatrix.py``: ``--method llamafile --calibration``: llama-imatrix's importance matrix from the float stream
  (``ImatrixStream``), written into OUT and used as ``--imatrix`` uses one.

Heavy imports (torch, transformers, llmcompressor) happen inside functions.
"""
