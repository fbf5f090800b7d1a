"""GPTQ with the calibration samples split across workers and each MoE layer's experts across owners, layers
still in order: the steps and their order, free of any cluster library. ``DistributedStream`` gives the writers
what ``loop.LayerStream`` gives them (the same LayerResults, the same stream state to save and restore), byte for
byte, running its steps as tasks of an executor: ``LocalTasks`` (inline, in this process) or
``ktconvert.distributed.ray_gptq.RayTasks``.

Per layer L, with the calibration samples in calibration order (``oneshot_permutation``) cut into contiguous slices:

    capture    per slice: layer L without its routed experts' weights, each sample's forward up to the experts
               module -> per sample (hidden [T, H], top_k_index [T, k], top_k_weights [T, k])
    gate/up    calibrate-all: one task accumulates the shared gate/up Hessian over every slice's fit tokens, in
               calibration order (``ExpertSolver.shared_gate_up``)
    solve      per owner (a contiguous range of experts): those experts' source weights and every slice's capture
               concatenated in calibration order -> ``ExpertSolver.quantize`` for its experts (Hessians, GPTQ,
               held-out choice) -> (its part of the LayerResult, the experts' written weights)
    propagate  per slice: layer L without its routed experts' weights, the owners' written weights assigned, each
               sample through the layer -> the slice's next hidden states

The driver joins the owners' parts in expert order (``join_results``) and hands the propagated hidden states'
handles to the next layer's tasks; dense layers only propagate. The bytes are the single process's: every forward
is per sample and, on CPU, at one torch thread (gptq.stream); every Hessian is accumulated by one task over the
samples in the single process's order (partial sums added up would round differently); the solve is the single
process's code. Every step is a function of its arguments (handles the driver owns), so a task whose process dies
can be re-run to the same result (RayTasks retries it).

Memory per slice task: one layer without its routed experts, plus every written expert while propagating, and the
slice's activations; per owner: every sample's captured expert inputs (x2 while split into fit / held-out) and its
experts' weights and Hessians.
"""
from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator

from ktconvert.errors import InputError
from ktconvert.gptq.calibration import oneshot_permutation
from ktconvert.gptq.determinism import deterministic_cpu, pin_process
from ktconvert.gptq.loop import ExpertSolver, GptqOptions, LayerResult, calibration_holdout, propagation_context
from ktconvert.gptq.skeleton import experts_module, malloc_trim
from ktconvert.gptq.stream import DecoderStream, to_device_but_meta
from ktconvert.run.inputs import open_input
from ktconvert.run.read_loop import FaultInjector


def contiguous(n: int, parts: int) -> list[range]:
    """range(n) cut into min(parts, n) contiguous ranges whose lengths differ by at most one (the first longer)."""
    parts = max(1, min(parts, n))
    size, extra = divmod(n, parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def join_results(layer: int, parts: list[LayerResult]) -> LayerResult:
    """The LayerResult of a layer whose experts were solved in `parts` (owners of increasing expert ranges, each
    counting every expert's routed tokens), as one process solving them in order gives it."""
    joined = LayerResult(layer, tokens=list(parts[0].tokens))
    for part in parts:
        joined.payloads.update(part.payloads)
        joined.reasons += part.reasons
        joined.fallback += part.fallback
        joined.errors.update(part.errors)
    return joined


# ---------------------------------------------------------------------------------------------- the steps

_STREAMS: dict = {}   # this process's stream for one `where` (worker_stream): the meta skeleton, built once


def worker_stream(where: tuple) -> DecoderStream:
    """This process's stream for `where` = (SRC spec, expert orientation, device, causal_mask, MTP layers): the
    meta skeleton and the opened source, no samples (built once per process; steps use ``view`` / ``fresh_layer``
    and leave it as it is)."""
    if where not in _STREAMS:
        _STREAMS.clear()
        spec, orientation, device, causal_mask, mtp_layers = where
        source = open_input(spec, orientation, in_part=True).source
        _STREAMS[where] = DecoderStream(source, None, inputs=((), ()), device=device, causal_mask=causal_mask,
                                        mtp_layers=mtp_layers)
    return _STREAMS[where]


def fault_point(step: str, layer: int) -> None:
    """Crash testing: KTCONVERT_FAULT_GPTQ_STEP=STEP:LAYER (capture, gate_up, solve, propagate) SIGKILLs the
    process running that step, like the OOM killer (with KTCONVERT_FAULT_ONCE=PATH only the first one)."""
    if os.environ.get("KTCONVERT_FAULT_GPTQ_STEP") == f"{step}:{layer}":
        FaultInjector(1, os.environ.get("KTCONVERT_FAULT_ONCE")).tick()


@contextlib.contextmanager
def computing(device):
    """no_grad and, on CPU, one torch thread (the single process's setting: gptq.stream) around a step; the heap
    trimmed after it."""
    import torch

    with torch.no_grad(), deterministic_cpu(device):
        yield
    malloc_trim()


def record_slice(where: tuple, samples: list) -> tuple[list, list]:
    """(hidden states entering layer 0 [1, S, H], keyword arguments {layer: kwargs}) per sample of `samples`
    (a slice, calibration order): the recording forward of a fresh stream."""
    spec, orientation, device, causal_mask, mtp_layers = where
    stream = DecoderStream(open_input(spec, orientation, in_part=True).source, samples, device=device,
                           causal_mask=causal_mask, mtp_layers=mtp_layers)
    return stream.hidden, stream.kwargs


def capture_slice(where: tuple, layer: int, hidden: list, kwargs: list) -> list:
    """Per sample of the slice: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) reaching layer
    `layer`'s experts module, on CPU."""
    stream = worker_stream(where).view(hidden, kwargs)
    module = stream.load_layer(layer, stream.fresh_layer(layer), experts=())
    fault_point("capture", layer)
    with computing(stream.device):
        captured = stream.capture_inputs(layer, module, experts_module(module))
        return [tuple(t.to("cpu") for t in values) for values in captured]


def gate_up_hessian(where: tuple, options: GptqOptions, layer: int, held_masks, *captures) -> tuple:
    """The calibrate-all (gate/up Hessian [H, H] float32, count) of `layer` over every slice's capture, on CPU."""
    stream = worker_stream(where)
    experts = experts_module(stream.fresh_layer(layer))
    fault_point("gate_up", layer)
    with computing(stream.device):
        hessian, count = ExpertSolver(None, options, held_masks, stream.device).shared_gate_up(
            experts, [values for capture in captures for values in capture])
        return hessian.to("cpu"), count.to("cpu")


def solve_experts(where: tuple, quantizer, options: GptqOptions, layer: int, owned: range, held_masks, shared,
                  *captures) -> tuple[LayerResult, dict]:
    """(the LayerResult of the experts in `owned`, {expert: {name: tensor}} their written weights and biases as
    the propagation sets them) from every slice's capture; shared: gate_up_hessian's result (calibrate-all)."""
    stream = worker_stream(where)
    module = stream.load_layer(layer, stream.fresh_layer(layer), experts=owned, others=False)
    experts = experts_module(module)
    names = {e: list(experts[e].state_dict()) for e in owned}
    if shared is not None:
        shared = tuple(t.to(stream.device) for t in shared)
    fault_point("solve", layer)
    with computing(stream.device):
        solver = ExpertSolver(quantizer, options, held_masks, stream.device)
        result = solver.quantize(layer, experts, [values for capture in captures for values in capture],
                                 owned=owned, shared_gu=shared)
        written = {e: {name: value.detach().to("cpu") for name, value in experts[e].state_dict().items()
                       if name in names[e]} for e in owned}
    return result, written


def propagate_slice(where: tuple, options: GptqOptions, layer: int, hidden: list, kwargs: list,
                    *written) -> list:
    """The slice's hidden states after `layer` (per sample [1, S, H], CPU); written: the owners' written expert
    weights (solve_experts), none for a dense layer."""
    stream = worker_stream(where).view(hidden, kwargs)
    module = stream.fresh_layer(layer)
    if written:
        module = stream.load_layer(layer, module, experts=())
        experts = experts_module(module)
        for part in written:
            for e, state in part.items():
                experts[e].load_state_dict(state, assign=True, strict=True)
        module = to_device_but_meta(module, stream.device)
    else:
        module = stream.load_layer(layer, module)
    fault_point("propagate", layer)
    with computing(stream.device):
        stream.propagate(layer, module, lambda: propagation_context(module, options.calibrate_all))
    return stream.hidden


# ---------------------------------------------------------------------------------------------- the driver

class LocalTasks:
    """Every step run at once in this process (its handles are the values): the orchestration without a cluster."""

    def submit(self, fn: Callable, *args, returns: int = 1):
        return fn(*args)

    def put(self, value):
        return value

    def get(self, handles: list) -> list:
        return list(handles)


class DistributedStream:
    """LayerStream's interface (run_layer, run_all, layers_results, skip_to, hidden, done, n_total, info, layers,
    mtp, quantizer) over `tasks` (LocalTasks or ray_gptq.RayTasks): checkpoint `source` (an opened HFSource;
    `spec` / `orientation`: how every task opens it), calibration `samples` (file order), `quantizer`, GptqOptions,
    MTP layers, as LayerStream takes them; the samples cut into `workers` slices, each MoE layer's experts into as
    many owners (module docstring)."""

    def __init__(self, source, samples: list, quantizer, options: GptqOptions = GptqOptions(), mtp_layers=(), *,
                 tasks, spec: str, orientation: str | None = None, workers: int = 1):
        if not samples:
            raise InputError("no calibration samples", hint="--calibration FILE must hold at least one sample")
        pin_process()                      # before torch computes anything here (gptq.determinism)
        self.quantizer, self.options, self.tasks, self.workers = quantizer, options, tasks, max(1, workers)
        order = oneshot_permutation(samples)
        ordered = [samples[i] for i in order]
        self.where = (spec, orientation, options.device, options.causal_mask, tuple(sorted(mtp_layers)))
        self.structure = DecoderStream(source, None, inputs=((), ()), device=options.device,
                                       causal_mask=options.causal_mask, mtp_layers=mtp_layers)
        self.info, self.layers, self.mtp = source.info, self.structure.layers, self.structure.mtp
        self.n_total, self.done = self.structure.n_total, -1
        self.slices = contiguous(len(ordered), self.workers)
        self.held_masks = tasks.put(calibration_holdout(quantizer, samples, order))   # a handle
        recorded = [tasks.submit(record_slice, self.where, ordered[s.start:s.stop], returns=2) for s in self.slices]
        self.hidden_parts = [handles[0] for handles in recorded]
        self.kwargs_parts = [handles[1] for handles in recorded]

    def run_layer(self, L: int) -> LayerResult | None:
        """Layer L (in order): its MoE experts quantized by the owners, every slice propagated; the LayerResult
        (None for a dense layer)."""
        if L != self.done + 1:
            raise ValueError(f"layers must be run in order: expected {self.done + 1}, got {L}")
        experts = self._experts(L)
        solved = self._solve(L, experts) if experts is not None else []
        written = [handles[1] for handles in solved]
        self.hidden_parts = [self.tasks.submit(propagate_slice, self.where, self.options, L, hidden, kwargs,
                                               *written)
                             for hidden, kwargs in zip(self.hidden_parts, self.kwargs_parts)]
        result = join_results(L, self.tasks.get([h[0] for h in solved])) if solved else None
        self.done = L
        return result

    def _experts(self, L: int):
        """Layer L's routed experts module in the driver's meta skeleton (MoE and MTP layers), or None."""
        return experts_module(self.structure.module(L)) if self.structure.has_experts(L) else None

    def _solve(self, L: int, experts) -> list:
        """The owners' (result, written) handle pairs of MoE layer L, in expert order."""
        tasks, where, options = self.tasks, self.where, self.options
        captures = [tasks.submit(capture_slice, where, L, hidden, kwargs)
                    for hidden, kwargs in zip(self.hidden_parts, self.kwargs_parts)]
        shared = tasks.submit(gate_up_hessian, where, options, L, self.held_masks, *captures) \
            if options.calibrate_all else None
        return [tasks.submit(solve_experts, where, self.quantizer, options, L, owned, self.held_masks, shared,
                             *captures, returns=2)
                for owned in contiguous(experts.num_experts, self.workers)]

    def run_all(self) -> Iterator[tuple[int, LayerResult | None]]:
        while self.done + 1 < self.n_total:
            L = self.done + 1
            yield L, self.run_layer(L)

    def layers_results(self) -> Iterator[LayerResult]:
        for _, result in self.run_all():
            if result is not None:
                yield result

    @property
    def hidden(self) -> list:
        """The hidden states after the last run layer, per sample in calibration order (gathered from the
        slices; what resume.StreamState saves)."""
        return [h for part in self.tasks.get(self.hidden_parts) for h in part]

    def skip_to(self, L: int, hidden: list) -> None:
        """Continue after layer L with `hidden` (per sample, calibration order; a saved stream state)."""
        if len(hidden) != sum(len(s) for s in self.slices):
            raise ValueError(f"{len(hidden)} hidden states for {sum(len(s) for s in self.slices)} calibration "
                             f"samples")
        self.hidden_parts = [self.tasks.put(list(hidden[s.start:s.stop])) for s in self.slices]
        self.done = L
