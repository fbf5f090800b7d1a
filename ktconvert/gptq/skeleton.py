"""The model the calibration stream runs: transformers' own classes built on the meta device from config.json.

``build_skeleton`` gives an ``AutoModelForCausalLM`` with no weights (eager attention, experts linearised into
2-D ``mlp.experts.E.{gate,up,down}_proj`` Linear modules by llmcompressor's ``linearize_moe``); the stream assigns
one decoder layer's weights at a time. Also the small torch helpers every stream module shares.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
from pathlib import Path

from ktconvert.architectures.manifests import transformers_alias
from ktconvert.errors import InputError
from ktconvert.util.safe_read import read_json

TORCH_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
                "float32": "float32", "fp32": "float32"}


def pick_device(device: str | None):
    """torch.device(device), or CUDA when torch sees a GPU and device is None, else CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def malloc_trim() -> None:
    """Hand freed heap back to the OS (glibc arenas otherwise grow over the first layers, §2 detail 5)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def to_device(obj, device):
    """Every tensor inside obj (tuples, lists, dicts, nested) moved to device; other values as they are."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def bits_to_torch(arr, dtype: str):
    """numpy array as Checkpoint.read returns it (BF16 as uint16 bits) -> torch tensor of that dtype."""
    import numpy as np
    import torch

    if dtype == "BF16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def torch_dtype(name: str):
    """torch dtype for "bfloat16"/"bf16", "float16"/"fp16", "float32"/"fp32"."""
    import torch

    try:
        return getattr(torch, TORCH_DTYPES[str(name).replace("torch.", "").lower()])
    except KeyError:
        raise InputError(f"unknown dtype {name!r}", expected=", ".join(sorted(TORCH_DTYPES))) from None


def torch_dtype_of(config: dict):
    """The dtype from_pretrained gives the model: config.json's dtype / torch_dtype, BF16 when absent or other."""
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").replace("torch.", "")
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(name, torch.bfloat16)


def _aliased_config(root: Path):
    """The transformers config of an aliased model_type (Kimi-K2 is DeepSeek-V3 to transformers), or None."""
    from transformers import CONFIG_MAPPING

    data = read_json(Path(root) / "config.json")
    alias = transformers_alias(str(data.get("model_type", "")))
    if alias is None:
        return None
    data = {k: v for k, v in data.items() if k not in ("model_type", "auto_map", "architectures")}
    return CONFIG_MAPPING[alias](**data)


def silence_llmcompressor() -> None:
    """Turn llmcompressor's log lines (loguru) off in this process, its import-time ones included: ktconvert
    reports progress itself (--quiet / --json-progress must be exact)."""
    import os
    from unittest import mock

    from loguru import logger

    with mock.patch.dict(os.environ, {"LLM_COMPRESSOR_LOG_DISABLED": "true"}):
        import llmcompressor  # noqa: F401  (its import configures loguru from the environment)
    logger.disable("llmcompressor")


@contextlib.contextmanager
def no_progress_bars():
    """tqdm bars of the libraries called inside (llmcompressor's "Linearizing experts") off."""
    from unittest import mock

    import tqdm

    with mock.patch.object(tqdm.tqdm, "__init__", _silent_tqdm_init(tqdm.tqdm.__init__)):
        yield


def _silent_tqdm_init(original):
    def init(self, *args, **kwargs):
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    return init


def build_skeleton(root: Path, dtype):
    """Meta-device AutoModelForCausalLM from root/config.json (eager attention, `dtype` parameters), experts
    linearised; rotary embeddings rebuilt on CPU (their buffers are computed, not loaded). Never runs code shipped
    with the checkpoint (trust_remote_code=False): model_types transformers knows under another name go through
    their manifest's ``transformers_aliases``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(str(root), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as exc:
        config = _aliased_config(root)
        if config is None:
            raise InputError(f"transformers cannot build a model from config.json ({exc})", file="config.json",
                             hint="calibration needs a model_type known to the installed transformers") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    silence_llmcompressor()
    with no_progress_bars():
        _linearize(model)
    model.eval()
    inner = model.model
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is not None:
        with torch.device("cpu"):
            inner.rotary_emb = type(rotary)(config=getattr(rotary, "config", model.config))
    return model


def _linearize(model) -> None:
    """llmcompressor's linearize_moe on the meta skeleton: new 2-D expert modules on meta too, nothing to offload."""
    import torch
    from compressed_tensors.utils import patch_attr
    from llmcompressor.modeling.moe import linear_experts
    from llmcompressor.modeling.moe.linearize import linearize_moe

    with torch.device("meta"), patch_attr(linear_experts, "offload_module", lambda *a, **k: None):
        linearize_moe(model)


def experts_module(layer):
    """The linearised experts module (llmcompressor LinearExperts2D) of a decoder layer, or None (dense layer).
    Its forward takes (hidden_states [T, H], top_k_index int64 [T, k], top_k_weights [T, k])."""
    from llmcompressor.modeling.moe.linear_experts import LinearExperts2D

    for module in layer.modules():
        if isinstance(module, LinearExperts2D):
            return module
    return None


def routed_experts(layer, L: int, n_experts: int):
    """The experts module (``experts_module``) of MoE layer `L`; InputError when transformers built none with the
    checkpoint's `n_experts` experts there."""
    experts = experts_module(layer)
    if experts is None or experts.num_experts != n_experts:
        raise InputError(f"layer {L}: the model transformers builds has no routed experts module with "
                         f"{n_experts} experts where the checkpoint has them", file="config.json")
    return experts


def routed(top_k_index, top_k_weights, expert: int):
    """(token indices int64 [n_e], routing weights [n_e]) of the tokens routed to `expert`, in the order
    LinearExperts2D selects them. top_k_index int64 [T, k], top_k_weights [T, k]."""
    import torch

    pos, tokens = torch.where((top_k_index == expert).T)
    return tokens, top_k_weights[tokens, pos]


def float_params(expert, dtype=None) -> dict:
    """{name: tensor} of every parameter of an expert module (weights and biases) in `dtype` (None: float32)."""
    import torch

    return {name: p.detach().to(dtype or torch.float32) for name, p in expert.named_parameters()}


def expert_forward(expert, params: dict, x, weights: dict | None = None):
    """The expert module's own forward (its family's activation, its biases) on x [T, H], with `params`
    (float_params) and, where given, `weights` {"gate" | "up" | "down": [n, k]} in place of its projection
    weights, all in the dtype of `params` (float32 or float64). Returns [T, H] in that dtype."""
    from torch.func import functional_call

    dtype = next(iter(params.values())).dtype
    if weights:
        params = dict(params, **{f"{proj}_proj.weight": w.to(dtype) for proj, w in weights.items()})
    return functional_call(expert, params, (x.to(dtype),))
