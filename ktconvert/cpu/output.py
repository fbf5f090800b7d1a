"""The CPU output being written: kt-kernel's expert files in the method's sink (``methods``: converted tiles or
HF tensors), plus the non-expert tensors with ``include_dense``, the copied config / tokenizer and ktconvert.json.
"""
from __future__ import annotations

from ktconvert.util import profile
from ktconvert.cpu.plan import CpuPlan
from ktconvert.util.envinfo import cpu_flags
from ktconvert.formats.fileio import LayerResult
from ktconvert.run.output import Output


class LayerConsumer:
    """One layer of a CPU output: each expert matrix is written by the method (NUMA split + quantize + tile, or
    encoded whole for in-place methods) into the sink's layer writer; with `carry` the source's stored tensors
    are written as they are instead (methods' carry_over)."""

    def __init__(self, writer, method, numa: int, quant: str, carry: bool = False):
        self.writer, self.method, self.numa, self.quant, self.carry = writer, method, numa, quant, carry

    def put_matrix(self, proj: str, expert: int, w, where: str, stored=None) -> None:
        """w: uint16 BF16 bits, gate/up [I, H], down [H, I]; stored: () -> {suffix: array} of the matrix as the
        source stores it."""
        if self.carry:
            with profile.span("copy.cpu", w.nbytes):
                self.writer.put_stored(proj, expert, self.method.carried(stored()))
            return
        with profile.span("quantize.cpu", w.nbytes):
            self.method.write_matrix(self.writer, proj, expert, w, numa=self.numa, quant=self.quant, where=where)

    def finish(self) -> LayerResult:
        return self.writer.finish()

    def abort(self) -> None:
        self.writer.abort()


class CpuOutput(Output):
    """A kt-kernel CPU output in `out_dir` for `plan` (cpu.plan.CpuPlan); the sink is created when OUT opens."""

    kind = "cpu"

    def __init__(self, out_dir, plan: CpuPlan, *, resume: bool = False, force: bool = False,
                 part: list[int] | None = None):
        super().__init__(out_dir, plan, resume=resume, force=force, part=part)
        self.method, self.options = plan.method, plan.options
        self.sink = None
        self.run_notes: list[str] = []
        self.run_details: dict = {}
        self.manifest_extra: dict = {}   # ktconvert.json keys a calibrated run adds ("gptq", gptq/cpu.py)
        self.side_records: list = []     # FileRecords of files a calibrated run adds to OUT (gptq/imatrix.py)
        # the source's experts already are this method's tensors: copied byte for byte (None: quantized here)
        self.carried_over = plan.report["carried_over"]   # planned once (cpu.plan: headers of every expert)

    def open(self) -> bool:
        if not super().open():
            return False
        self.sink = self.method.open_sink(self.out_dir, self.all_layers, self.source.info, self.options.numa,
                                          self.options.layout, self.options.include_dense)
        try:
            if hasattr(self.sink, "start_run"):     # files holding several layers (GGUF shards): what this run writes
                self.sink.start_run(self.layers, set(self.journal.layers), self.writes_rest, self.source)
        except BaseException:
            self.discard()
            raise
        return True

    def journal_options(self) -> dict:
        return self.plan.journal_options()

    def label(self) -> str:
        return f"convert {self.method.kt_method} T={self.options.numa}"

    def begin_layer(self, layer: int) -> LayerConsumer:
        return LayerConsumer(self.sink.begin_layer(layer), self.method, self.options.numa, self.options.quant,
                             carry=self.carried_over is not None)

    def finish_files(self) -> LayerResult:
        """The dense shard (include_dense), the index, config (with the method's quantization_config where it has
        one, also for sources without a config.json) and copies of the tokenizer files."""
        files, tensors = [], {}
        if self.options.include_dense:
            dense = self.sink.write_dense(*self.source.dense_tensors())
            files, tensors = list(dense.files), dict(dense.tensors)
        files += self.sink.finalize(copy_from=self.source.side_files(),
                                    fallback_config=self.source.info.minimal_config(), check_layers=not self.part)
        files += self.side_records
        return LayerResult(files, tensors)

    def manifest_fields(self) -> dict:
        o = self.options
        return {"method": self.method.kt_method, "numa": o.numa, "layout": o.layout, "quant": o.quant,
                "include_dense": o.include_dense, "flags": self.method.flags(o.numa),
                "extra": {**self.method.manifest_fields(), **self.manifest_extra, **self._carry_field()}}

    def _carry_field(self) -> dict:
        if self.carried_over is None:
            return {}
        return {"carried_over": {"source_format": self.carried_over, "quant": "not applied: the routed experts' "
                                 "stored bytes are copied unchanged"}}

    def notes(self) -> list[str]:
        carried = [f"routed experts carried over byte for byte ({self.carried_over}), not requantized"] \
            if self.carried_over else []
        return carried + self.run_notes + self.method.runtime_notes(cpu_flags())

    def details(self) -> dict:
        return dict(self.run_details)
