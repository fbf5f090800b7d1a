"""Checks of a config.json resolved against its manifest (``architectures.manifests.resolve``): every integer field
in range, the MTP layer count, and no tensor the config does not describe (a layer past n_layers + MTP, an expert
past n_experts, routed experts in a dense layer). ManifestError naming the config key and the tensor."""
from __future__ import annotations

import re
from typing import Any

from ktconvert.errors import ManifestError

# least value of each integer field; experts_per_tok is also at most n_experts, mlp_only_layers within n_layers
INT_MINIMUM = {"n_layers": 1, "n_experts": 1, "hidden": 1, "intermediate": 1, "experts_per_tok": 1,
               "first_dense": 0, "layer_freq": 1, "sparse_step": 1, "mtp_layers": 0, "n_shared": 0,
               "shared_intermediate": 0}
# far above any model (61 layers, 512 experts, dims of a few thousand); they bound every loop over layers / experts
MAX_LAYERS, MAX_EXPERTS, MAX_DIM = 1 << 12, 1 << 16, 1 << 20
INT_MAXIMUM = {"n_layers": MAX_LAYERS, "mtp_layers": MAX_LAYERS, "n_experts": MAX_EXPERTS, "n_shared": MAX_EXPERTS,
               "hidden": MAX_DIM, "intermediate": MAX_DIM, "shared_intermediate": MAX_DIM}


def _bad_value(keys: dict[str, str], name: str, value, expected: str) -> ManifestError:
    return ManifestError(f"{keys[name]} is not usable", file="config.json", expected=expected, found=repr(value))


def check_values(fields: dict[str, Any], keys: dict[str, str]) -> None:
    """Every integer field an int (not a bool, not 8.5) in range; ManifestError naming the config key."""
    for name, minimum in INT_MINIMUM.items():
        value, maximum = fields[name], INT_MAXIMUM.get(name)
        if value is None and name == "shared_intermediate":
            continue
        if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
            raise _bad_value(keys, name, value, f"an integer >= {minimum}" if maximum is None else
                             f"an integer in [{minimum}, {maximum}]")
    if fields["experts_per_tok"] > fields["n_experts"]:
        raise _bad_value(keys, "experts_per_tok", fields["experts_per_tok"],
                         f"at most {keys['n_experts']} = {fields['n_experts']}")
    dense = fields["mlp_only_layers"]
    if not isinstance(dense, (list, tuple)) or any(type(v) is not int or not 0 <= v < fields["n_layers"]
                                                   for v in dense):
        raise _bad_value(keys, "mlp_only_layers", dense,
                         f"a list of layer indices in [0, {keys['n_layers']} = {fields['n_layers']})")


def _dense_keys(rule: str, keys: dict[str, str], fields: dict[str, Any]) -> str:
    names = {"first_dense_freq": ("first_dense", "layer_freq"), "sparse_step": ("sparse_step", "mlp_only_layers")}
    return ", ".join(f"{keys[n]} = {fields[n]!r}" for n in names.get(rule, ()))


def mtp_count(names: list[str], manifest, fields: dict[str, Any], keys: dict[str, str]) -> int:
    """MTP layers: the config's count, or, when config.json has no count and the family keeps MTP layers under
    mtp_prefix (Qwen3-Next), the number of such layers whose tensors are present."""
    if not manifest.mtp_prefix or not keys["mtp_layers"].endswith("(default)"):
        return fields["mtp_layers"]
    regex = re.compile(manifest.mtp_layer_regex())
    found = {int(m.group(1)) for m in map(regex.match, names) if m}
    return max(found) + 1 if found else fields["mtp_layers"]


def check_tensors(names: list[str], prefix: str, manifest, fields: dict[str, Any],
                   keys: dict[str, str], moe_layers: set[int]) -> None:
    """Tensors the config does not describe are errors, not silently dropped: a decoder layer >= n_layers (+ MTP),
    an expert >= n_experts, routed experts in a layer the config makes dense (any storage layout)."""
    n_layers = fields["n_layers"]
    layers = n_layers + fields["mtp_layers"]
    scopes = [(re.compile(re.escape(prefix) + r"layers\.(\d+)\."), 0, manifest.experts.name_regexes(prefix))]
    if manifest.mtp_prefix:
        experts = manifest.experts.name_regexes(manifest.mtp_prefix)
        if "{k}" in manifest.mtp_prefix:          # the pattern's "layers.{L}." is the MTP layer's own prefix
            head, own = r"layers\.(?P<L>\d+)\.", manifest.mtp_layer_regex().replace(r"(\d+)", r"(?P<L>\d+)", 1)
            experts = [re.compile(own + r.pattern[len(head):]) for r in manifest.experts.name_regexes("")]
        scopes.append((re.compile(manifest.mtp_layer_regex()), n_layers, experts))
    for name in names:
        match, offset, expert_res = next(((m, off, res) for m, off, res in
                                          ((r.match(name), off, res) for r, off, res in scopes) if m),
                                         (None, 0, ()))
        if match is None:
            continue
        layer = int(match.group(1)) + offset
        if layer >= layers:
            raise ManifestError(f"tensor of layer {layer}, outside the {layers} layers config.json describes",
                                file="config.json", tensor=name,
                                expected=f"layers below {keys['n_layers']} = {n_layers} + "
                                         f"{keys['mtp_layers']} = {fields['mtp_layers']}")
        expert = next((m for m in (r.match(name) for r in expert_res) if m), None)
        if expert is None:
            continue
        if layer < n_layers and layer not in moe_layers:
            raise ManifestError(f"routed expert tensor in layer {layer}, which config.json makes a dense layer",
                                file="config.json", tensor=name,
                                found=_dense_keys(manifest.moe_rule, keys, fields) or "no MoE layer rule")
        index = expert.groupdict().get("E")
        if index is not None and int(index) >= fields["n_experts"]:
            raise ManifestError(f"expert {index} is outside the experts config.json describes", file="config.json",
                                tensor=name, expected=f"experts below {keys['n_experts']} = {fields['n_experts']}")
