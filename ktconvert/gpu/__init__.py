"""The GPU side of KTransformers: the SGLang-KT ``--model`` checkpoint (gpu-format.md §8).

Modules (mirroring ``cpu/``): ``plan`` (``GpuOptions``, ``plan_gpu`` -> ``GpuPlan``: everything checked before OUT
exists), ``output`` (``GpuOutput``: the streaming writer, an ``output.Output``), ``convert`` (``convert_gpu``, the
GPTQ hook contract); ``layout`` (which tensor goes where), ``experts`` (compressed-tensors RTN W4A16/W8A16 of
routed experts), ``linears`` (128x128 block FP8 / BF16 linears), ``config`` (minimal quantization_config, ignore
matchers), ``verify`` (``check_gpu_checkpoint``), ``gptq`` (the GPTQ hook).
"""
