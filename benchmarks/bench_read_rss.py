"""Peak RSS and throughput of reading every routed expert through HFSource; inspect time on many shards.

    python benchmarks/bench_read_rss.py                # ~0.5 GB model (+ the 1000-shard inspect case)
    python benchmarks/bench_read_rss.py --large        # also the ~4 GB model
    python benchmarks/bench_read_rss.py --dir DIR      # keep generated checkpoints in DIR (reused when present)

Each read runs in a fresh subprocess so its peak RSS (VmHWM) counts the read alone. One JSON line per case.
RSS must stay flat as the checkpoint grows: the read holds one expert at a time.
The inspect case writes DeepSeek-V3-sized headers (61 layers, 256 experts, H 7168, I 2048) over 1000 shards as
sparse files (no data written) and times `inspect` on them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SIZES = {"0.5GB": dict(layers=3, experts=64, hidden=1024, intermediate=512),
         "4GB": dict(layers=24, experts=64, hidden=1024, intermediate=512)}


def _config(layers: int, experts: int, hidden: int, intermediate: int) -> dict:
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": layers,
            "num_experts": experts, "hidden_size": hidden, "moe_intermediate_size": intermediate,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 512}


def generate(root: Path, layers: int, experts: int, hidden: int, intermediate: int) -> Path:
    """Qwen3-MoE names, one shard per layer, random BF16 bits, written tensor by tensor (bounded memory)."""
    from ktconvert.formats.st_writer import StreamingSafetensorsWriter

    if (root / "config.json").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map = {}
    for layer in range(layers):
        fname = f"model-{layer + 1:05d}-of-{layers:05d}.safetensors"
        specs = [(f"model.layers.{layer}.mlp.experts.{e}.{p}_proj.weight", "BF16",
                  (hidden, intermediate) if p == "down" else (intermediate, hidden))
                 for e in range(experts) for p in ("gate", "up", "down")]
        with StreamingSafetensorsWriter(root / fname, specs) as writer:
            for name, _, shape in specs:
                bits = rng.integers(0, 1 << 14, size=shape, dtype=np.uint16) + np.uint16(0x3000)
                writer.write(name, bits)
        weight_map.update({name: fname for name, _, _ in specs})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(_config(layers, experts, hidden, intermediate)))
    return root


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def read_all(path: str) -> dict:
    """Read every expert of every MoE layer; runs in the child process."""
    from ktconvert.formats.hf_source import HFSource

    src = HFSource.open(path)
    src.validate()
    rss_open = _vm("VmRSS")
    t0, nbytes, n = time.perf_counter(), 0, 0
    for layer in src.info.moe_layers:
        for e in range(src.info.n_experts):
            ew = src.read_expert(layer, e)
            nbytes += ew.gate.nbytes + ew.up.nbytes + ew.down.nbytes
            n += 1
    secs = time.perf_counter() - t0
    return {"experts_read": n, "bytes_read": nbytes, "seconds": round(secs, 3),
            "GB_per_s": round(nbytes / secs / 1e9, 3), "rss_after_open_MB": round(rss_open / 2**20, 1),
            "peak_rss_MB": round(_vm("VmHWM") / 2**20, 1),
            "one_expert_MB": round(nbytes / n / 2**20, 2), "shards": len(src.files())}


def _drop_cache(path: Path) -> None:
    """Best effort: ask the kernel to forget the files' pages (so GB/s is not only page-cache speed)."""
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_read(name: str, root: Path) -> dict:
    _drop_cache(root)
    out = subprocess.run([sys.executable, __file__, "--read", str(root)], capture_output=True, text=True, check=True)
    size = sum(f.stat().st_size for f in root.glob("*.safetensors"))
    return {"case": f"read_all_experts {name}", "checkpoint_bytes": size, **json.loads(out.stdout)}


def make_header_only(root: Path, shards: int = 1000) -> Path:
    """DeepSeek-V3-sized tensor headers over `shards` sparse files (header written, data left as holes)."""
    from ktconvert.formats.st_writer import build_header

    if (root / "config.json").is_file():
        return root
    root.mkdir(parents=True, exist_ok=True)
    L, E, H, I, dense = 61, 256, 7168, 2048, 3
    specs = [("model.embed_tokens.weight", "BF16", (129280, H)), ("lm_head.weight", "BF16", (129280, H))]
    for layer in range(L):
        p = f"model.layers.{layer}."
        specs += [(p + n, "BF16", s) for n, s in (("input_layernorm.weight", (H,)),
                                                   ("self_attn.q_a_proj.weight", (1536, H)),
                                                   ("self_attn.o_proj.weight", (H, 16384)))]
        if layer < dense:
            specs += [(p + f"mlp.{q}_proj.weight", "BF16", (18432, H) if q != "down" else (H, 18432))
                      for q in ("gate", "up", "down")]
            continue
        specs += [(p + "mlp.gate.weight", "BF16", (E, H))]
        specs += [(p + f"mlp.experts.{e}.{q}_proj.weight", "BF16", (I, H) if q != "down" else (H, I))
                  for e in range(E) for q in ("gate", "up", "down")]
    bounds = [len(specs) * i // shards for i in range(shards + 1)]
    weight_map = {}
    for i in range(shards):
        chunk = specs[bounds[i]:bounds[i + 1]]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        header, spans = build_header(chunk, None)
        with open(root / fname, "wb") as f:
            f.write(header)
            f.truncate(max((e for _, e in spans.values()), default=len(header)))
        weight_map.update({n: fname for n, _, _ in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": L, "n_routed_experts": E, "hidden_size": H,
           "moe_intermediate_size": I, "num_experts_per_tok": 8, "first_k_dense_replace": dense,
           "moe_layer_freq": 1, "n_shared_experts": 1, "num_nextn_predict_layers": 0}
    (root / "config.json").write_text(json.dumps(cfg))
    return root


_TIMING_CHILD = """
import json, sys, time
t = time.perf_counter()
from ktconvert.run.inspection import inspect
from ktconvert.cpu.plan import plan
first_import = time.perf_counter() - t
runs = {"inspect": [], "plan": []}
for _ in range(3):
    t = time.perf_counter(); r = inspect(sys.argv[1]); runs["inspect"].append(time.perf_counter() - t)
    t = time.perf_counter(); plan(sys.argv[1], "amxint4", numa=2); runs["plan"].append(time.perf_counter() - t)
print(json.dumps({"import": first_import, "runs": runs, "tensors": r["tensors"], "files": r["files"]}))
"""


def bench_inspect(root: Path) -> dict:
    """inspect and plan in a fresh process: import time, then best and worst of 3 runs (others share the CPU)."""
    out = subprocess.run([sys.executable, "-c", _TIMING_CHILD, str(root)], capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout)
    r = lambda xs: [round(min(xs), 3), round(max(xs), 3)]  # noqa: E731
    return {"case": "inspect/plan header-only DeepSeek-V3 shape", "shards": res["files"],
            "tensors": res["tensors"], "import_seconds": round(res["import"], 3),
            "inspect_seconds_min_max": r(res["runs"]["inspect"]), "plan_seconds_min_max": r(res["runs"]["plan"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--large", action="store_true", help="also the ~4 GB model")
    ap.add_argument("--dir", default=None, help="where to keep the generated checkpoints")
    ap.add_argument("--read", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.read:
        print(json.dumps(read_all(args.read)))
        return
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        base = Path(args.dir) if args.dir else Path(tmp)
        print(json.dumps(bench_inspect(make_header_only(base / "headers-1000"))), flush=True)
        for name, dims in SIZES.items():
            if name == "4GB" and not args.large:
                continue
            root = generate(base / f"model-{name}", **dims)
            print(json.dumps(bench_read(name, root)), flush=True)


if __name__ == "__main__":
    main()
