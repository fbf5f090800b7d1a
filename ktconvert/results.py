"""What the public entry points return (``ktconvert.api``): plain dataclasses, JSON-ready through ``to_dict()``.

Nothing here prints or reads files; the command line renders these objects (``summary()`` / ``render()``) or
dumps ``to_dict()`` for ``--json``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ktconvert.kinds import KINDS, OutputKind


@dataclass(frozen=True)
class ConvertResult:
    """One output written (or found complete) by convert_cpu / convert_gpu / convert.

    out: the output folder; kind: its output kind (kinds.KINDS: "cpu", "gpu", ...); method: the kt-kernel method
    ("AMXINT4", ...) of a CPU output or the expert scheme ("W4A16" / "W8A16") of a GPU output; files: the relative
    paths ktconvert.json lists (a part: its part manifest), file_count how many, bytes their size; flags: the
    kt-kernel / SGLang options the output needs as ktconvert.json records them (``kt-weight-path`` / ``model`` "." =
    the output folder itself); sglang_args: the same as one string with the folder's absolute path filled in ("" for
    a part, which cannot run before ``merge``); part: a part's MoE layers (``--layers``), else (); timings: seconds
    per phase (plan, open, convert, finalize, total); complete_before: ``resume`` found the output complete and
    wrote nothing; notes: what the output needs at run time and what the conversion had to decide (e.g. GPTQ experts
    without calibration tokens); details: method-specific figures (GPTQ tokens per expert, ...). summary() ends with
    the kind's launch lines (``OutputKind.launch_lines``).
    """

    out: str
    kind: str
    method: str
    files: list
    bytes: int
    flags: dict
    sglang_args: str
    timings: dict = field(default_factory=dict)
    complete_before: bool = False
    notes: tuple[str, ...] = ()
    details: dict = field(default_factory=dict)
    part: tuple[int, ...] = ()
    file_count: int = 0

    def summary(self) -> str:
        """One line for people: what was written and how to run it."""
        head = (f"{self.out}: already complete (ktconvert.json present); nothing to do" if self.complete_before
                else f"wrote {self.out}: {self.file_count} files, {self.bytes} bytes")
        if self.part:      # a part holds some layers only: nothing to launch until the parts are merged
            return "; ".join([head.replace("wrote ", "wrote part ", 1) + f" (MoE layers {_spans(self.part)})",
                              *self.notes, "a part cannot be served: merge the parts with ktconvert merge OUT PART "
                              "PART..."])
        kind = KINDS.get(self.kind) if self.kind in KINDS else OutputKind
        return "; ".join([head, *self.notes, *kind.launch_lines(self.sglang_args, self.out)])

    __str__ = summary

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PlanResult:
    """What `plan` found: source (as given), cpu (cpu.plan.CpuPlan) and / or gpu (gpu.plan.GpuPlan), each holding
    the opened source and its JSON-ready report (``plan.cpu["total_bytes"]``), and / or placement (the GPU experts
    SGLang-KT would choose, activation.placement.plan_placement's dict); or, for several targets, targets
    ([{"name", "kind", "out", "plan": CpuPlan | GpuPlan}]) and combined (the one pass's figures:
    plan_targets); ray: what a Ray run would ask of the cluster (plan's executor="ray")."""

    source: str
    cpu: object | None = None
    gpu: object | None = None
    placement: dict | None = None
    targets: list | None = None
    combined: dict | None = None
    ray: dict | None = None

    def to_dict(self) -> dict:
        """One shape whatever was planned: {"source", "cpu": report or None, "gpu": report or None,
        "placement": dict or None, "targets": [{"name", "kind", "out", "plan": report}] or None, "combined":
        dict or None, "ray": the Ray run's figures (plan executor="ray": distributed.ray_plan) or None}."""
        targets = None if self.targets is None else [{**t, "plan": t["plan"].to_dict()} for t in self.targets]
        return {"source": self.source, "cpu": None if self.cpu is None else self.cpu.to_dict(),
                "gpu": None if self.gpu is None else self.gpu.to_dict(), "placement": self.placement,
                "targets": targets, "combined": self.combined, "ray": self.ray}


@dataclass(frozen=True)
class VerifyResult:
    """What `verify` found: ok; out (the folder, bundle or repo checked); problems (one line each); checks
    [{name, status ("ok" | "failed" | "skipped"), detail}]; the reports of the checks that ran: hashes, numerics,
    remote, gpu (a GPU checkpoint's checks), bundle; report: the path of the HTML page written (verify's report=);
    identified: for a folder without ktconvert.json, what its headers say it holds (``ktconvert check``'s
    identification)."""

    ok: bool
    out: str
    problems: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    hashes: dict | None = None
    numerics: dict | None = None
    remote: dict | None = None
    gpu: dict | None = None
    bundle: dict | None = None
    report: str | None = None
    identified: dict | None = None

    @classmethod
    def from_dict(cls, report: dict) -> "VerifyResult":
        return cls(**report)

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class InspectResult:
    """What `inspect` found in a checkpoint (headers and config only): path, files, file_bytes, tensors, dtypes
    {dtype: bytes}, quantization (config.json's summary), model_type, components {category: bytes}, family,
    supported (False: reason says why); for a supported family also input_format, layers {total, dense, moe, mtp,
    mtp_in_config}, experts, experts_per_tok, shared_experts, hidden, intermediate, expert_layout and kt_methods
    {kt-kernel method: "as is (...)" | "convert: ..." | "no: ..."}."""

    path: str
    files: int
    file_bytes: int
    tensors: int
    dtypes: dict
    quantization: dict | None
    model_type: str | None
    components: dict
    family: str | None
    supported: bool
    reason: str | None = None
    input_format: str | None = None
    layers: dict | None = None
    experts: int | None = None
    experts_per_tok: int | None = None
    shared_experts: int | None = None
    hidden: int | None = None
    intermediate: int | None = None
    expert_layout: dict | None = None
    kt_methods: dict | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        return {k: v for k, v in out.items() if v is not None or k in ("quantization", "model_type", "family")}


def _spans(layers) -> str:
    """(1, 2, 3, 7) -> '1-3,7'."""
    spans: list[list[int]] = []
    for layer in sorted(layers):
        if spans and layer == spans[-1][1] + 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)
