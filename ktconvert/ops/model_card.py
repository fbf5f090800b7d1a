"""The README.md model card ``publish`` uploads, built with huggingface_hub's ``ModelCard`` / ``ModelCardData``.

The metadata block is the library's (so the hub indexes it and ``ModelCard.load`` parses it back): ``library_name``,
``tags``, ``base_model`` with ``base_model_relation: quantized`` where the output quantizes its source (every method
but the BF16 copy, and every GPU checkpoint), and the source repo when it was read from ``hf://`` (ktconvert.json
records hub, repo and revision) or given to ``publish --base-model``. The text is per output kind:

* a CPU output (kt-kernel expert weights): method, NUMA count, layout, quantizer, and the SGLang launch command
  with its ``--kt-*`` flags (the NUMA count must equal ``--kt-threadpool-count``);
* a GPU checkpoint (compressed-tensors experts + linears for SGLang-KT): expert scheme, group size, linears, and the
  launch command with ``--model`` pointing at it.

Both end with the source fingerprint, what was verified before the upload and the command that checks the repo
against its ktconvert.json without downloading weights.
"""
from __future__ import annotations

from ktconvert.formats.out_manifest import sglang_args

LIBRARY = "ktransformers"
UNQUANTIZED_METHODS = ("BF16",)      # CPU methods whose weights are the source's own values


def base_model_of(manifest: dict, base_model: str | None = None) -> str | None:
    """The Hugging Face repo the output was converted from: `base_model` when given, else the recorded hf:// source
    (None for local and ModelScope sources: the hub's base_model names Hugging Face repos)."""
    if base_model:
        return base_model
    source = manifest.get("source", {})
    return source.get("repo") if source.get("hub") == "hf" else None


def card_data(manifest: dict, base_model: str | None = None):
    """huggingface_hub.ModelCardData of the output described by `manifest`."""
    from huggingface_hub import ModelCardData

    kind = manifest.get("kind", "cpu")
    method = str(manifest.get("method", ""))
    tags = [LIBRARY, "kt-kernel", "moe", "ktconvert"]
    if kind == "gpu":
        tags += ["sglang", "compressed-tensors", method.lower()]
    else:
        tags += [method.lower()]
    base = base_model_of(manifest, base_model)
    quantized = kind == "gpu" or method not in UNQUANTIZED_METHODS
    extra = {"base_model_relation": "quantized"} if base and quantized else {}
    return ModelCardData(library_name=LIBRARY, tags=tags, base_model=base, **extra)


def _what(manifest: dict) -> list[str]:
    model = manifest.get("model", {})
    arch = model.get("model_type") or model.get("family", "")
    tool = f"ktconvert {manifest.get('tool_version', '')}".strip()
    if manifest.get("kind") == "gpu":
        gpu = manifest.get("gpu", {})
        return [f"The GPU side of a KTransformers hybrid deployment of a {arch} model: the routed experts as "
                f"compressed-tensors {gpu.get('experts', manifest.get('method', '')).upper()} (group size "
                f"{gpu.get('group_size')}, {gpu.get('algo', manifest.get('quant', 'rtn'))}), the other linears "
                f"{gpu.get('linears', 'as stored')}; written by {tool}. SGLang-KT loads it with `--model`; the cold "
                "experts run on the CPU from kt-kernel weights of the same model."]
    return [f"kt-kernel CPU expert weights of a {arch} model: method {manifest.get('method')}, NUMA count "
            f"{manifest.get('numa')}, layout {manifest.get('layout')}, quantizer {manifest.get('quant', 'rtn')}; "
            f"written by {tool}. The NUMA count is part of the files: `--kt-threadpool-count` must equal it."]


def _launch(manifest: dict, base: str | None) -> list[str]:
    if manifest.get("kind") == "gpu":
        flags = sglang_args(manifest, "/path/to/this/repo")
        note = "with the CPU side's `--kt-*` flags added (its own model card or ktconvert.json states them):"
    else:
        flags = f"--model {base or '/path/to/the/original/model'} " + sglang_args(manifest, "/path/to/this/repo")
        note = "where `--kt-weight-path` is where you downloaded this repo:"
    return [f"Launch SGLang {note}", "", "```", f"python -m sglang.launch_server {flags}", "```", ""]


def model_card(manifest: dict, repo: str, base_model: str | None = None, verified: str | None = None,
               files_root: str | None = None):
    """huggingface_hub.ModelCard for publishing the output folder described by `manifest` as `repo`. `verified`:
    what was checked before the upload (one sentence); files_root: the digest of the file list (ops.hub)."""
    from huggingface_hub import ModelCard

    source = manifest.get("source", {})
    origin = {k: v for k, v in source.items() if k not in ("files", "config_sha256")}
    files = manifest["files"]
    activation = manifest.get("expert_activation")
    lines = [
        f"# {repo.split('/')[-1]}", "", *_what(manifest), "",
        "## Use", "", *_launch(manifest, base_model_of(manifest, base_model)),
        *([f"`{activation}` counts the calibration tokens routed to each expert: with `--kt-gpu-experts-ratio R` "
           "(or `--kt-num-gpu-experts N`) SGLang-KT keeps the most used experts on the GPU.", ""] if activation else []),
        "## Source", "",
        f"- config.json sha256: `{source.get('config_sha256')}`",
        *[f"- {key}: `{value}`" for key, value in sorted(origin.items())],
        f"- source files: {len(source.get('files', {}))}", "",
        "## Files and verification", "",
        f"{len(files)} files, {sum(int(e['bytes']) for e in files.values())} bytes; `ktconvert.json` lists the sha256 "
        f"and git blob SHA-1 of each" + (f" (files root `{files_root}`)." if files_root else "."), "",
        *([verified, ""] if verified else []),
        "Check this repo against it without downloading weights:", "", "```", f"ktconvert verify {repo} --remote",
        "```", "",
    ]
    return ModelCard(f"---\n{card_data(manifest, base_model).to_yaml()}\n---\n\n" + "\n".join(lines))
