"""Architecture manifests (manifests/*.toml, shipped as ``ktconvert.manifests``) and config.json resolution.

Everything family-specific is data in a manifest; this module only knows the schema and the MoE layer rules
(``first_dense_freq``, ``sparse_step``, ``all``). Pure: it reads the manifest files and nothing else.

Extra manifest directories come from the environment variable ``KTCONVERT_MANIFEST_PATH`` (os.pathsep-separated);
a manifest there claiming a model_type already known replaces the shipped one.
"""
from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterable

from ktconvert.errors import ManifestError
from ktconvert.architectures.config_checks import check_tensors, check_values, mtp_count
from ktconvert.architectures.expert_names import ExpertLayout, parse_experts

MANIFEST_PATH_ENV = "KTCONVERT_MANIFEST_PATH"

# [config] fields: (required, default). A default of None means "derived" (see _resolve_fields).
CONFIG_FIELDS: dict[str, tuple[bool, Any]] = {
    "n_layers": (True, None),
    "n_experts": (True, None),
    "hidden": (True, None),
    "intermediate": (True, None),
    "experts_per_tok": (True, None),
    "first_dense": (False, 0),
    "layer_freq": (False, 1),
    "sparse_step": (False, 1),
    "mlp_only_layers": (False, ()),
    "mtp_layers": (False, 0),
    "n_shared": (False, 0),
    "shared_intermediate": (False, None),   # default: intermediate * n_shared
}
TOP_KEYS = {"family", "model_types", "text_config", "name_prefixes", "mtp_prefix", "notes", "config", "defaults",
            "moe_layers", "experts", "components", "tiny", "gguf_architectures", "transformers_aliases", "linears"}
# [linears]: the SGLang LinearBase modules of the GPU checkpoint, by kind; each regex matches the end of an HF module
# name from a dot on. A manifest without the table gets SGLang's usual names (DEFAULT_LINEARS).
LINEAR_KINDS = ("attention", "shared", "dense")
DEFAULT_LINEARS: dict[str, tuple[str, ...]] = {
    "attention": (r"(self_attn|linear_attn|attention)\.[^.]*proj[^.]*",),
    "shared": (r"(mlp\.)?shared_experts?\.(gate|up|down|gate_up)_proj",),
    "dense": (r"mlp\.(gate|up|down|gate_up)_proj",),
}
TINY_KEYS = {"config", "attention", "linear_attention", "attn_bias", "qk_norm", "q_gate", "sinks", "router",
             "router_bias", "router_bias_fp32", "shared", "shared_gate", "dense_mlp", "mtp", "extra_tensors",
             "name_prefix", "fused_transposed", "null_keys"}
DEFAULT_PREFIXES = ("model.",)


@dataclass(frozen=True)
class Manifest:
    """One family's manifest. ``config_keys[field]`` are the config.json keys tried in order."""

    family: str
    model_types: tuple[str, ...]
    source: str
    config_keys: dict[str, tuple[str, ...]]
    defaults: dict[str, Any]
    moe_rule: str
    experts: ExpertLayout
    components: dict[str, tuple[str, ...]]
    text_config: str | None = None
    name_prefixes: tuple[str, ...] = DEFAULT_PREFIXES
    notes: str = ""
    tiny: dict[str, dict] = field(default_factory=dict)
    mtp_prefix: str = ""     # MTP layer k lives at "<mtp_prefix>layers.{k}." (Qwen3-Next: "mtp."), or at mtp_prefix
                             # itself where it holds {k} (DeepSeek-V4: "mtp.{k}."), not at layer n_layers + k under
                             # the name prefix
    gguf_architectures: dict[str, str] = field(default_factory=dict)    # GGUF general.architecture -> model_type
    transformers_aliases: dict[str, str] = field(default_factory=dict)  # model_type -> the one transformers runs
    linears: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_LINEARS))

    def linear_kind(self, module: str) -> str | None:
        """The [linears] kind of HF module `module` (module-level linear_kind with this manifest's table)."""
        return linear_kind(module, self.linears)

    def mtp_layer_regex(self) -> str:
        """Regex of MTP layer k's name prefix (mtp_prefix set), k captured: "<mtp_prefix>layers.(\\d+)." or
        mtp_prefix with (\\d+) for {k}."""
        template = self.mtp_prefix if "{k}" in self.mtp_prefix else self.mtp_prefix + "layers.{k}."
        return re.escape(template).replace(re.escape("{k}"), r"(\d+)")


@dataclass(frozen=True)
class ModelInfo:
    """A config.json resolved against its manifest.

    moe_layers: decoder layers with routed experts (MTP excluded); mtp_layers: n_layers .. n_layers+mtp-1.
    first_dense: leading layers without routed experts. config: the dict the fields came from (text_config if nested).
    name_prefix: prefix in front of every manifest pattern ("model.", "model.language_model.", ...).
    """

    family: str
    model_type: str
    n_layers: int
    moe_layers: tuple[int, ...]
    mtp_layers: tuple[int, ...]
    n_experts: int
    hidden: int
    intermediate: int
    experts_per_tok: int
    n_shared: int
    shared_intermediate: int
    first_dense: int
    name_prefix: str
    manifest: Manifest
    config: dict

    def minimal_config(self) -> dict:
        """A config.json for outputs of a source that has none (GGUF): model_type and the dims, under the
        family's own key names (the first key its manifest tries for each field)."""
        fields = {"n_layers": self.n_layers, "n_experts": self.n_experts, "hidden": self.hidden,
                  "intermediate": self.intermediate, "experts_per_tok": self.experts_per_tok}
        config = {"model_type": self.model_type}
        for name, value in fields.items():
            keys = self.manifest.config_keys.get(name)
            if keys:
                config[keys[0]] = value
        return config

    @property
    def fused(self) -> bool:
        """Whether the family usually stores its experts fused (a hint: sources detect the layout)."""
        return self.manifest.experts.form == "fused"

    def layer_name(self, pattern: str, layer: int, **fields) -> str:
        """Full tensor name of manifest `pattern` ({L} and `fields`) for decoder layer `layer`; an MTP layer of a
        family with an ``mtp_prefix`` is ``<mtp_prefix>layers.{layer - n_layers}``."""
        prefix, index = self.name_prefix, layer
        if self.manifest.mtp_prefix and layer >= self.n_layers:
            prefix, index = self.manifest.mtp_prefix, layer - self.n_layers
            if "{k}" in prefix:                   # patterns start with "layers.{L}.": the MTP layer's own prefix
                return prefix.format(k=index) + pattern.format(L=index, **fields)[len(f"layers.{index}."):]
        return prefix + pattern.format(L=index, **fields)

    def expert_names(self, layer: int, expert: int) -> dict[str, str]:
        """Per-expert names: {"gate": name, "up": name, "down": name} of one expert."""
        lay = self.manifest.experts
        return {role: self.layer_name(lay.pattern, layer, E=expert, proj=proj) for role, proj in lay.proj.items()}

    def fused_names(self, layer: int) -> dict[str, str]:
        """The family's own fused names: {"gate_up", "down"} plus "gate_up_bias"/"down_bias" where declared."""
        lay = self.manifest.experts
        names = {"gate_up": lay.gate_up, "down": lay.down, "gate_up_bias": lay.gate_up_bias,
                 "down_bias": lay.down_bias}
        return {k: self.layer_name(v, layer) for k, v in names.items() if v}

    def experts_prefixes(self, layer: int) -> list[str]:
        """Full MoE expert prefixes of `layer` where fused tensors may be (ExpertLayout.experts_prefixes)."""
        return [self.layer_name(p, layer) for p in self.manifest.experts.experts_prefixes()]

    def layer_of(self, name: str) -> int | None:
        """The decoder layer tensor `name` belongs to (MTP layers numbered n_layers + k; the MTP module's own
        tensors under mtp_prefix, e.g. ``mtp.fc``, count as the first MTP layer's), None outside layers."""
        match = re.match(re.escape(self.name_prefix) + r"layers\.(\d+)\.", name)
        if match:
            return int(match.group(1))
        mtp = self.manifest.mtp_prefix
        if not mtp or not name.startswith(mtp.split("{k}")[0]):
            return None
        match = re.match(self.manifest.mtp_layer_regex(), name)
        return self.n_layers + (int(match.group(1)) if match else 0)


# ---------------------------------------------------------------- loading

def _fail(source: str, message: str, **kw) -> ManifestError:
    return ManifestError(message, file=source, **kw)


def _check_keys(source: str, table: dict, allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise _fail(source, f"unknown key {where}{key!r}", expected="one of " + ", ".join(sorted(allowed)))


def _str_list(source: str, value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(source, f"{where} must be a list of strings", found=repr(value))
    return tuple(value)


def _regex_list(source: str, value: Any, where: str) -> tuple[str, ...]:
    """A list of regexes, each compiled once to refuse a bad one naming `where`."""
    patterns = _str_list(source, value, where)
    for pat in patterns:
        try:
            re.compile(pat)
        except re.error as exc:
            raise _fail(source, f"{where}: bad regex {pat!r}: {exc}") from None
    return patterns


def _parse_components(source: str, table: dict) -> dict[str, tuple[str, ...]]:
    return {name: _regex_list(source, patterns, f"[components] {name}") for name, patterns in table.items()}


def _str_table(source: str, table: Any, where: str, values: tuple[str, ...] | None = None,
               keys: tuple[str, ...] | None = None) -> dict[str, str]:
    """A table of strings (``{ name = "value" }``); keys (values) must be among `keys` (`values`) when given."""
    if not isinstance(table, dict) or not all(isinstance(v, str) and v for v in table.values()):
        raise _fail(source, f"{where} must be a table of strings", found=repr(table))
    for key, value in table.items():
        if keys is not None and key not in keys:
            raise _fail(source, f"{where}: {key!r} is not a model_type of this manifest",
                        expected="one of " + ", ".join(keys))
        if values is not None and value not in values:
            raise _fail(source, f"{where} {key}: {value!r} is not a model_type of this manifest",
                        expected="one of " + ", ".join(values))
    return dict(table)


def _parse_linears(source: str, table: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(table, dict):
        raise _fail(source, "[linears] must be a table", found=repr(table))
    _check_keys(source, table, set(LINEAR_KINDS), "[linears] ")
    return {kind: _regex_list(source, table[kind], f"[linears] {kind}") for kind in LINEAR_KINDS if kind in table}


def linear_kind(module: str, linears: dict[str, tuple[str, ...]] = DEFAULT_LINEARS) -> str | None:
    """The kind ("attention", "shared", "dense") under which a [linears] table names HF module `module` (a name
    without ``.weight``; a pattern matches the name's end from a dot or its start), None when SGLang does not build
    it as a LinearBase (routed experts never are)."""
    if ".experts." in module:
        return None
    regexes = _linear_regexes(tuple(linears.items()))
    return next((kind for kind, regex in regexes.items() if regex.search(module)), None)


@lru_cache(maxsize=64)
def _linear_regexes(linears: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, re.Pattern]:
    return {kind: re.compile("|".join(rf"(?:^|\.)(?:{p})$" for p in patterns)) for kind, patterns in linears
            if patterns}


def parse_manifest(text: str, source: str) -> Manifest:
    """Parse one manifest's TOML text. source names the file in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(source, f"not valid TOML: {exc}") from None
    _check_keys(source, data, TOP_KEYS, "")
    for key in ("family", "model_types", "config", "experts"):
        if key not in data:
            raise _fail(source, f"missing key {key!r}")
    config = data["config"]
    _check_keys(source, config, set(CONFIG_FIELDS), "[config] ")
    defaults = data.get("defaults", {})
    _check_keys(source, defaults, set(CONFIG_FIELDS), "[defaults] ")
    rule_table = data.get("moe_layers", {"rule": "all"})
    _check_keys(source, rule_table, {"rule"}, "[moe_layers] ")
    rule = rule_table.get("rule", "all")
    if rule not in MOE_RULES:
        raise _fail(source, "[moe_layers] rule", expected=" or ".join(sorted(MOE_RULES)), found=repr(rule))
    tiny = data.get("tiny", {})
    for model_type, table in tiny.items():
        _check_keys(source, table, TINY_KEYS, f"[tiny.{model_type}] ")
    model_types = _str_list(source, data["model_types"], "model_types")
    return Manifest(
        family=data["family"],
        model_types=model_types,
        source=source,
        config_keys={name: _str_list(source, keys, f"[config] {name}") for name, keys in config.items()},
        defaults=dict(defaults),
        moe_rule=rule,
        experts=parse_experts(source, data["experts"]),
        components=_parse_components(source, data.get("components", {})),
        text_config=data.get("text_config"),
        name_prefixes=_str_list(source, data.get("name_prefixes", list(DEFAULT_PREFIXES)), "name_prefixes"),
        notes=data.get("notes", ""),
        tiny=tiny,
        mtp_prefix=data.get("mtp_prefix", ""),
        gguf_architectures=_str_table(source, data.get("gguf_architectures", {}), "gguf_architectures",
                                      values=model_types),
        transformers_aliases=_str_table(source, data.get("transformers_aliases", {}), "transformers_aliases",
                                        keys=model_types),
        linears=_parse_linears(source, data["linears"]) if "linears" in data else dict(DEFAULT_LINEARS),
    )


def _shipped_manifests():
    """The installed package ktconvert.manifests, or the repository's manifests/ folder when ktconvert runs from a
    source checkout that was never installed (PYTHONPATH=.)."""
    try:
        return resources.files("ktconvert.manifests")
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[1] / "manifests"


def _manifest_files() -> list[tuple[str, str]]:
    """(source name, text) of every manifest: shipped ones first, then KTCONVERT_MANIFEST_PATH directories."""
    files = []
    for entry in sorted(_shipped_manifests().iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            files.append((f"manifests/{entry.name}", entry.read_text(encoding="utf-8")))
    for directory in filter(None, os.environ.get(MANIFEST_PATH_ENV, "").split(os.pathsep)):
        path = Path(directory)
        if not path.is_dir():
            raise ManifestError(f"{MANIFEST_PATH_ENV} entry is not a directory", file=directory)
        for toml in sorted(path.glob("*.toml")):
            files.append((str(toml), toml.read_text(encoding="utf-8")))
    return files


def load_manifests() -> dict[str, Manifest]:
    """model_type -> Manifest for every shipped manifest and every one on KTCONVERT_MANIFEST_PATH (later wins)."""
    by_type: dict[str, Manifest] = {}
    for source, text in _manifest_files():
        manifest = parse_manifest(text, source)
        for model_type in manifest.model_types:
            by_type[model_type] = manifest
    return by_type


def families() -> dict[str, Manifest]:
    """family name -> Manifest."""
    return {m.family: m for m in load_manifests().values()}


def gguf_architectures(manifests: dict[str, Manifest] | None = None) -> dict[str, str]:
    """GGUF ``general.architecture`` -> model_type, from every manifest's ``gguf_architectures`` (later wins)."""
    manifests = load_manifests() if manifests is None else manifests
    return {arch: model_type for m in {id(m): m for m in manifests.values()}.values()
            for arch, model_type in m.gguf_architectures.items()}


def transformers_alias(model_type: str) -> str | None:
    """The model_type whose transformers classes run `model_type`'s checkpoints (a manifest's
    ``transformers_aliases``: Kimi-K2 is DeepSeek-V3 to transformers), None when transformers knows it itself."""
    manifests = load_manifests()
    manifest = manifests.get(model_type)
    return None if manifest is None else manifest.transformers_aliases.get(model_type)


def manifest_for(model_type: str, manifests: dict[str, Manifest] | None = None) -> Manifest:
    """The manifest claiming model_type (a family name works too); ManifestError listing the known ones otherwise.
    manifests: load_manifests() already done by the caller (each call parses every manifest file)."""
    manifests = load_manifests() if manifests is None else manifests
    if model_type in manifests:
        return manifests[model_type]
    by_family = {m.family: m for m in manifests.values()}
    if model_type in by_family:
        return by_family[model_type]
    raise ManifestError(
        f"unknown model_type {model_type!r}", expected="one of " + ", ".join(sorted(manifests)),
        hint=f"add a family by dropping a TOML file into manifests/ or a directory on {MANIFEST_PATH_ENV} "
             "(see docs/architecture.md, 'Architecture manifests')")


# ---------------------------------------------------------------- resolution

def _rule_all(n_layers: int, fields: dict) -> list[int]:
    return list(range(n_layers))


def _rule_first_dense_freq(n_layers: int, fields: dict) -> list[int]:
    first, freq = int(fields["first_dense"]), int(fields["layer_freq"]) or 1
    return [layer for layer in range(n_layers) if layer >= first and layer % freq == 0]


def _rule_sparse_step(n_layers: int, fields: dict) -> list[int]:
    step, dense = int(fields["sparse_step"]) or 1, set(fields["mlp_only_layers"] or ())
    return [layer for layer in range(n_layers) if layer not in dense and (layer + 1) % step == 0]


MOE_RULES: dict[str, Callable[[int, dict], list[int]]] = {
    "all": _rule_all,
    "first_dense_freq": _rule_first_dense_freq,
    "sparse_step": _rule_sparse_step,
}


def _lookup(config: dict, key: str) -> tuple[bool, Any]:
    """Dotted keys walk nested dicts ("quantization_config.weight_block_size")."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node or node[part] is None:
            return False, None
        node = node[part]
    return True, node


def _config_sources(config: dict, manifest: Manifest) -> list[tuple[str, dict]]:
    sub = manifest.text_config
    if sub and isinstance(config.get(sub), dict):
        return [(f"{sub}.", config[sub]), ("", config)]
    return [("", config)]


def _resolve_fields(config: dict, manifest: Manifest) -> tuple[dict[str, Any], dict[str, str]]:
    """(field -> value, field -> where it came from: the config key, or "<field> (default)")."""
    sources = _config_sources(config, manifest)
    fields: dict[str, Any] = {}
    keys: dict[str, str] = {}
    for name, (required, default) in CONFIG_FIELDS.items():
        tried = []
        for key in manifest.config_keys.get(name, ()):
            for where, node in sources:
                found, value = _lookup(node, key)
                tried.append(where + key)
                if found:
                    fields[name], keys[name] = value, where + key
                    break
            if name in fields:
                break
        if name not in fields:
            keys[name] = f"{name} (default)"
            if name in manifest.defaults:
                fields[name] = manifest.defaults[name]
            elif required:
                raise ManifestError(f"config.json has no {name} for family {manifest.family}",
                                    expected="one of the keys " + ", ".join(tried or ["(none listed)"]),
                                    hint=f"manifest {manifest.source}")
            else:
                fields[name] = default
    return fields, keys


def _pick_prefix(manifest: Manifest, tensor_names: Iterable[str] | None) -> str:
    if tensor_names is None:
        return manifest.name_prefixes[0]
    names = list(tensor_names)
    for prefix in manifest.name_prefixes:
        if any(n.startswith(prefix + "layers.") for n in names):
            return prefix
    raise ManifestError(f"no tensor name starts with any layer prefix of family {manifest.family}",
                        expected=", ".join(p + "layers." for p in manifest.name_prefixes),
                        found=", ".join(sorted(names)[:3]) or "no tensors")


def resolve(config: dict, tensor_names: Iterable[str] | None = None) -> ModelInfo:
    """config.json dict (+ optional checkpoint tensor names) -> ModelInfo.

    Every integer field must be an int in range (experts_per_tok at most n_experts); with tensor names, the name
    prefix is picked from them and tensors the config does not describe are refused (a layer past n_layers + MTP,
    an expert past n_experts, routed experts in a dense layer). ManifestError (exit 3) naming the config key and the
    tensor."""
    model_type = config.get("model_type")
    manifests = load_manifests()
    if model_type not in manifests:
        for value in config.values():
            if isinstance(value, dict) and value.get("model_type") in manifests:
                model_type = value["model_type"]
                break
    manifest = manifest_for(str(model_type), manifests)
    fields, keys = _resolve_fields(config, manifest)
    check_values(fields, keys)
    n_layers = fields["n_layers"]
    moe_layers = tuple(MOE_RULES[manifest.moe_rule](n_layers, fields))
    n_shared = fields["n_shared"]
    intermediate = fields["intermediate"]
    shared_i = fields["shared_intermediate"]
    sources = _config_sources(config, manifest)
    names = None if tensor_names is None else list(tensor_names)
    prefix = _pick_prefix(manifest, names)
    if names is not None:
        fields["mtp_layers"] = mtp_count(names, manifest, fields, keys)
        check_tensors(names, prefix, manifest, fields, keys, set(moe_layers))
    return ModelInfo(
        family=manifest.family,
        model_type=str(config.get("model_type", model_type)),
        n_layers=n_layers,
        moe_layers=moe_layers,
        mtp_layers=tuple(range(n_layers, n_layers + int(fields["mtp_layers"]))),
        n_experts=int(fields["n_experts"]),
        hidden=int(fields["hidden"]),
        intermediate=intermediate,
        experts_per_tok=int(fields["experts_per_tok"]),
        n_shared=n_shared,
        shared_intermediate=int(shared_i) if shared_i is not None else intermediate * n_shared,
        first_dense=moe_layers[0] if moe_layers else n_layers,
        name_prefix=prefix,
        manifest=manifest,
        config=sources[0][1],
    )


def component_of(manifest: Manifest, tensor_name: str) -> str:
    """The first [components] category whose regex matches tensor_name (file order), else "other"."""
    for category, patterns in manifest.components.items():
        if any(re.search(p, tensor_name) for p in patterns):
            return category
    return "other"
