"""What the first decoder layer receives: one recording forward of the real model code per calibration sample.

Every decoder layer is replaced by a recorder that keeps its keyword arguments (causal mask, rotary embeddings,
anything else the model computes once for all layers) and, for layer 0, the hidden states. The model's own code
builds them, so every family gets exactly what its layers expect.
"""
from __future__ import annotations


class _Recorder:
    """Stands in for decoder layer `index` during the recording forward: keeps its kwargs (and layer 0's input)."""

    def __init__(self, original, store: dict, index: int):
        import torch

        class Rec(torch.nn.Module):
            def forward(self, hidden_states, *args, **kwargs):
                store.setdefault("kwargs", {})[index] = kwargs
                if index == 0:
                    store["hidden"] = hidden_states
                return hidden_states

        self.module = Rec()
        for attr in ("attention_type", "layer_type", "layer_idx", "is_sliding"):
            if hasattr(original, attr):
                setattr(self.module, attr, getattr(original, attr))


def record_inputs(model, embed_weight, samples: list, causal_mask: bool = True) -> tuple[list, list]:
    """Run `model` (a skeleton: AutoModelForCausalLM on meta) over `samples` (1-D int64 token tensors) with
    `embed_weight` ([vocab, H]) assigned to its embedding and every decoder layer recorded.

    Returns (hidden states entering layer 0 per sample [1, S, H] on CPU, per sample {layer: kwargs}).
    causal_mask False replaces each attention_mask by None (oneshot's Qwen3-MoE behaviour, tests only).
    The embedding is replaced by Identity afterwards (freed)."""
    import torch

    inner = model.model
    inner.embed_tokens.load_state_dict({"weight": embed_weight}, assign=True)
    originals, norm = inner.layers, getattr(inner, "norm", None)
    hidden, kwargs = [], []
    try:
        if norm is not None:
            inner.norm = torch.nn.Identity()
        for ids in samples:
            store: dict = {}
            inner.layers = torch.nn.ModuleList(_Recorder(layer, store, i).module
                                               for i, layer in enumerate(originals))
            ids = torch.as_tensor(ids, dtype=torch.long).reshape(1, -1)
            with torch.no_grad():
                inner(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
            hidden.append(store["hidden"].detach())
            per_layer = store["kwargs"]
            if not causal_mask:
                per_layer = {k: {**v, "attention_mask": None} for k, v in per_layer.items()}
            kwargs.append(per_layer)
    finally:
        inner.layers = originals
        if norm is not None:
            inner.norm = norm
    inner.embed_tokens = torch.nn.Identity()
    return hidden, kwargs
