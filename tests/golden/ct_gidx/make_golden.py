"""Golden decompressions of compressed-tensors pack-quantized weights with ``weight_g_idx`` (activation order
"group"), made by compressed-tensors itself.

compressed-tensors 0.19 (the version ktconvert pins) removed ``actorder: group`` and no longer reads ``weight_g_idx``;
0.18.0 is the last release that compresses and decompresses with it. Run this script with that release first on the
path (a plain ``pip download compressed-tensors==0.18.0`` unpacked next to torch is enough):

    PYTHONPATH=/path/to/compressed-tensors-0.18.0 python tests/golden/ct_gidx/make_golden.py

It writes ``ct_gidx.safetensors`` beside itself: for each case ``CASE.weight_packed`` / ``.weight_scale`` /
``.weight_g_idx`` / ``.weight_shape`` [/ ``.weight_zero_point``] exactly as ``PackedQuantizationCompressor.compress``
returns them (the checkpoint tensors), and ``CASE.decompressed``: ``PackedQuantizationCompressor.decompress`` of
those tensors, cast to BF16. Fused cases (``fused_*``) hold E experts stacked along a new first axis; each expert was
compressed and decompressed on its own (compressed-tensors has no fused form).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).parent
# name: (n, k, group_size, bits, symmetric, scale dtype, g_idx kind, experts)
CASES = {
    "g32_identity": (16, 128, 32, 4, True, torch.bfloat16, "identity", 1),
    "g32_permuted": (16, 128, 32, 4, True, torch.bfloat16, "permuted", 1),
    "g64_permuted": (24, 256, 64, 4, True, torch.bfloat16, "permuted", 1),
    "g128_permuted": (8, 512, 128, 4, True, torch.bfloat16, "permuted", 1),
    "g32_interleaved": (16, 128, 32, 4, True, torch.bfloat16, "interleaved", 1),
    "g32_permuted_asym": (16, 128, 32, 4, False, torch.bfloat16, "permuted", 1),
    "g64_permuted_f16": (16, 256, 64, 4, True, torch.float16, "permuted", 1),
    "g32_permuted_int8": (16, 128, 32, 8, True, torch.bfloat16, "permuted", 1),
    "fused_g32_permuted": (16, 128, 32, 4, True, torch.bfloat16, "permuted", 3),
}


def _g_idx(kind: str, k: int, gs: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [k]: column -> group, each group exactly gs columns (what GPTQ's activation order produces)."""
    groups = torch.arange(k, dtype=torch.int32) // gs
    if kind == "identity":
        return groups
    if kind == "interleaved":
        return torch.arange(k, dtype=torch.int32) % (k // gs)
    return groups[torch.randperm(k, generator=gen)]


def _one(n, k, gs, bits, symmetric, dtype, kind, gen):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor as PQC
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme(targets=["Linear"], weights={
        "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": gs,
        "actorder": "group"})
    groups = k // gs
    sd = {"weight": (torch.randn(n, k, generator=gen) * 0.02).to(dtype),
          "weight_scale": (torch.rand(n, groups, generator=gen) * 0.004 + 1e-4).to(dtype),
          "weight_g_idx": _g_idx(kind, k, gs, gen)}
    if not symmetric:
        half = 1 << (bits - 1)
        sd["weight_zero_point"] = torch.randint(-half, half, (n, groups), generator=gen, dtype=torch.int8)
    comp = PQC.compress(sd, scheme)
    comp["weight_g_idx"] = sd["weight_g_idx"]      # kept as the checkpoint stores it
    out = PQC.decompress(dict(comp), scheme)["weight"].to(torch.bfloat16)
    return {name: t for name, t in comp.items() if t is not None}, out


def main() -> int:
    import compressed_tensors

    if compressed_tensors.__version__ != "0.18.0":
        print(f"needs compressed-tensors 0.18.0 first on the path, found {compressed_tensors.__version__}")
        return 1
    gen = torch.Generator().manual_seed(14)
    tensors = {}
    for case, (n, k, gs, bits, symmetric, dtype, kind, experts) in CASES.items():
        parts = [_one(n, k, gs, bits, symmetric, dtype, kind, gen) for _ in range(experts)]
        for name in parts[0][0]:
            stack = [p[0][name] for p in parts]
            tensors[f"{case}.{name}"] = (stack[0] if experts == 1 else torch.stack(stack)).contiguous()
        outs = [p[1] for p in parts]
        tensors[f"{case}.decompressed"] = (outs[0] if experts == 1 else torch.stack(outs)).contiguous()
    save_file(tensors, str(HERE / "ct_gidx.safetensors"),
              metadata={"compressed_tensors": compressed_tensors.__version__, "torch": torch.__version__})
    return 0


if __name__ == "__main__":
    sys.exit(main())
