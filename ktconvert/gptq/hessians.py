"""GPTQ's inputs and solve for one expert, with llmcompressor's own functions.

* ``routes``: the token indices each expert receives, in the order llmcompressor's LinearExperts2D selects them.
* ``shared_gate_up`` / ``expert_hessians``: ``accumulate_hessian`` over an expert's inputs (gate_proj and up_proj
  read the same input, so one Hessian serves both; with calibrate-all, one for the whole layer).
* ``gptq_module``: observer qparams (or given ones), ``prepare_batch``, ``quantize_weight`` for one Linear, on CPU
  at one torch thread without oneDNN (``determinism.deterministic_cpu``).
"""
from __future__ import annotations

from ktconvert.gptq.determinism import deterministic_cpu


class StopForward(Exception):
    """Raised by a hook to end a forward early once its input is captured."""


def zero(device):
    """torch scalar 0 on device (llmcompressor's Hessian sample counter)."""
    import torch

    return torch.zeros((), device=device)


def routes(top_k_index, n_experts: int) -> list:
    """Per expert: the token indices routed to it (int64 [n_e]), in the order LinearExperts2D.forward selects them.
    top_k_index: int64 [T, k]."""
    import torch

    mask = torch.nn.functional.one_hot(top_k_index, n_experts).permute(2, 1, 0)
    return [torch.where(mask[e])[1] for e in range(n_experts)]


def shared_gate_up(experts, cached: list, device):
    """calibrate-all: every expert's gate/up input is the whole [T, H]: one (Hessian [H, H] float32, count) for
    the layer, over the cached per-sample MoE inputs (hidden, top_k_index, top_k_weights)."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

    module = experts[0].gate_proj
    H, n = make_empty_hessian(module, device=device), zero(device)
    for h, _, _ in cached:
        H, n = accumulate_hessian(h, module, H, n)
    return H, n


def expert_hessians(expert, inputs: list, shared_gu=None):
    """((H_gate_up [H, H], n), (H_down [I, I], n)) of one expert from its per-sample inputs ([T_i, H] each), with
    llmcompressor's accumulate_hessian; gate_proj and up_proj read the same input, so one Hessian serves both
    (`shared_gu` given: that one, and only the down Hessian is accumulated)."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian, make_empty_hessian

    device = expert.down_proj.weight.device
    gu = shared_gu or (make_empty_hessian(expert.gate_proj, device=device), zero(device))
    down = [make_empty_hessian(expert.down_proj, device=device), zero(device)]
    state = {"gu": list(gu)}

    def gate_hook(module, args):
        state["gu"][0], state["gu"][1] = accumulate_hessian(args[0], module, *state["gu"])

    def down_hook(module, args):
        down[0], down[1] = accumulate_hessian(args[0], module, down[0], down[1])
        raise StopForward

    handles = [expert.down_proj.register_forward_pre_hook(down_hook)]
    if shared_gu is None:
        handles.append(expert.gate_proj.register_forward_pre_hook(gate_hook))
    try:
        for x in inputs:
            try:
                expert(x.to(device))
            except StopForward:
                pass
    finally:
        for h in handles:
            h.remove()
    return tuple(state["gu"]), tuple(down)


def gptq_module(module, quant_args, hessian, num_samples, options, qparams=None):
    """llmcompressor GPTQ of one Linear: observer qparams (or the given {"scale", "zero_point",
    "global_scale"}), prepare_batch, quantize_weight (options: GptqOptions block_size, dampening). Returns
    (quantized float32 [n, k], scale, zero_point, global_scale, used_rtn_fallback). `module` must carry a
    quantization scheme unless qparams is given."""
    from llmcompressor.modifiers.gptq.gptq_quantize import quantize_weight
    from llmcompressor.modifiers.gptq.helpers import prepare_batch

    if qparams is None:
        from llmcompressor.modifiers.quantization.calibration import initialize_observer, observe

        initialize_observer(module, "weight")
        observe(module, base_name="weight")
        qparams = module.weight_observer.get_qparams()
    weights, hessians, scales, zero_points, global_scales = prepare_batch(
        [module], [qparams], {module: hessian}, {module: num_samples})
    with deterministic_cpu(weights.device):
        quantized, _losses, rtn = quantize_weight(weights=weights, hessians=hessians, scale=scales,
                                                  zero_point=zero_points, global_scale=global_scales,
                                                  quant_args=quant_args, blocksize=options.block_size,
                                                  percdamp=options.dampening)
    return quantized, scales, zero_points, global_scales, bool(rtn[0])

