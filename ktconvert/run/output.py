"""One output directory being written, whatever it holds (CPU experts, the GPU checkpoint): the rules both share.

    output = SomeOutput(out_dir, plan, resume=..., force=...)   # nothing touched yet: the plan is validated
    if output.open():           # OUT created / reused, locked, journal started; False: --resume found it complete
        for each layer: consumer = output.begin_layer(L) ... output.layer_finished(L, consumer.finish())
        manifest = output.finalize()    # the subclass's last files, then ktconvert.json (last), journal removed
    output.close()              # releases the lock (always, also on errors)

* OUT: refused when it overlaps the source, is a file, or is not empty (unless ``resume``: it must hold a journal
  or a manifest, or ``force``: emptied first, after the lock is taken).
* Lock: an exclusive ``fcntl.flock`` on ``OUT/.ktconvert.lock`` for the whole run, holding the writer's pid; a
  second writer fails at once with an OutputError naming that pid. The file is removed when the run ends. It is
  never opened through a symlink (``fileio.open_lock``: one there is refused, OutputError), and no file in OUT is
  written through one (``fileio.NewFile``).
* Resume: OUT's options must be the requested ones (and its source this source): a finished OUT's ktconvert.json
  (``resume_claims``), an unfinished one's journal; else a ResumeMismatchError (exit 2) naming each option.
* Journal (``journal.Journal``): the finished layers (files and tensor hashes) and the hashed source files, so
  a resumed run skips them and writes the same bytes.
* Manifest: files and tensors of every journalled layer plus the subclass's own last files, the source
  fingerprint, the model dims; the subclass adds its method fields (``manifest_fields``). A calibrated run sets
  ``expert_activation`` (the FileRecord of the expert_activation.pt it wrote into OUT) before finalize: the file
  is recorded and named in the SGLang flags (``--init-expert-location``).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import threading
from pathlib import Path

from ktconvert.errors import InputError, OutputError
from ktconvert.formats.fileio import FileRecord, LayerResult, create_new, hash_file, open_lock
from ktconvert.formats.out_manifest import (JOURNAL_NAME, LOCK_NAME, MANIFEST_NAME, build_manifest, load_manifest,
                                            write_manifest)
from ktconvert.run.journal import Journal, mismatch_error, option_name
from ktconvert.distributed.parts import PART_NAME, load_part, source_sample, write_part


class Output:
    """Base of the CPU and GPU outputs. Subclasses implement begin_layer, journal_options, manifest_fields and
    finish_files; `plan` is their validated plan (with .input: inputs.Input, .layers)."""

    kind = ""
    option_of: dict[str, str] = {}   # ktconvert.json keys set by an option other than "--" + the key (error messages)

    def __init__(self, out_dir, plan, *, resume: bool = False, force: bool = False, part: list[int] | None = None):
        self.out_dir = Path(out_dir)
        self.plan = plan
        self.source = plan.input.source
        self.all_layers = list(plan.layers)           # every MoE layer of the conversion (names, manifest)
        self.part = part is not None                  # a part: only `part`'s layers, finished by a part manifest
        self.layers = list(part) if self.part else list(self.all_layers)   # the layers this folder gets
        self.resume, self.force = resume, force
        self.journal: Journal | None = None
        self.created = False          # open() made OUT (discard() may remove it again)
        self._lock_fd: int | None = None
        self._journal_lock = threading.Lock()
        self.expert_activation: FileRecord | None = None   # a calibrated run's expert_activation.pt in OUT

    @property
    def writes_rest(self) -> bool:
        """Whether this folder gets the files of no MoE layer (index, config, copies, non-expert shards) and reads
        the source files holding no MoE layer: a whole run, or the part holding the first MoE layer."""
        return not self.part or min(self.layers) == min(self.all_layers)

    # ---------------------------------------------------------------- to implement

    def begin_layer(self, layer: int):
        """A consumer for MoE layer `layer`: put_matrix(proj, expert, w_bf16, where), finish() -> LayerResult,
        abort()."""
        raise NotImplementedError

    def journal_options(self) -> dict:
        """What a resumed run must have been started with (compared on --resume)."""
        raise NotImplementedError

    def finish_files(self) -> LayerResult:
        """Write everything after the layers (index, config, copies, ...); the records and tensor hashes."""
        raise NotImplementedError

    def manifest_fields(self) -> dict:
        """build_manifest keywords of this output: method, numa, layout, quant, kind, flags, ... and "extra"
        (top-level keys added after building)."""
        raise NotImplementedError

    def label(self) -> str:
        """Progress label of this output."""
        return self.kind

    def notes(self) -> list[str]:
        """One-line notes for the result: what the output needs at run time, what the run decided."""
        return []

    def details(self) -> dict:
        """Figures of the run worth returning (JSON-ready)."""
        return {}

    # ---------------------------------------------------------------- the directory

    def open(self) -> bool:
        """Create or reuse OUT under its lock and start (or reopen) the journal. False when ``resume`` finds OUT
        complete (ktconvert.json, no journal): nothing to do. OutputError for anything that could lose data."""
        self._prepare()
        try:
            if self.resume and (self.out_dir / self.finished_name()).exists() \
                    and not (self.out_dir / JOURNAL_NAME).exists():
                self.check_finished()
                return False
            options = {**self.journal_options(), **({"part": self.layers} if self.part else {})}
            self.journal = Journal.start(self.out_dir, options, self.resume)
        except BaseException:
            self.close()
            raise
        return True

    def resume_claims(self) -> dict:
        """{dotted ktconvert.json key: value} a finished OUT written with this plan records: the manifest fields of
        the options (flags and package versions aside: derived), the kind, the MoE layers, the source."""
        fields = self.manifest_fields()
        extra = fields.pop("extra", {})
        fields.pop("flags", None), fields.pop("packages", None)
        claims = {"kind": self.kind, **fields, "model.layers": sorted(self.all_layers),
                  "source.config_sha256": self._config_sha256()}
        claims.update({f"source.{key}": value for key, value in self.plan.input.hub.items()})
        for key, value in extra.items():
            claims.update({f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value})
        return claims

    def finished_name(self) -> str:
        """The file whose presence marks this folder complete: ktconvert.json, or a part's part manifest."""
        return PART_NAME if self.part else MANIFEST_NAME

    def finished_manifest(self) -> dict:
        """The ktconvert.json of a complete folder (a part's: restricted to its own files); InputError."""
        if not self.part:
            return load_manifest(self.out_dir)
        record = load_part(self.out_dir)
        if record["layers"] != self.layers:
            raise InputError("the part holds other MoE layers", file=str(self.out_dir / PART_NAME),
                             expected=f"layers {self.layers}", found=f"layers {record['layers']}")
        return record["manifest"]

    def check_finished(self) -> None:
        """ResumeMismatchError unless OUT's ktconvert.json records what this plan would write (a finished OUT that
        --resume leaves as is)."""
        try:
            manifest = self.finished_manifest()
        except InputError as exc:
            raise OutputError(f"cannot resume: {exc.detail}", file=str(self.out_dir / self.finished_name()),
                              hint="pass --force to start over") from None
        claims = self.resume_claims()
        if manifest.get("kind", "cpu") != self.kind:     # another kind of output: its other fields say nothing
            claims = {"kind": self.kind}
        differences = [(self.option_of.get(key) or option_name(key), _dig(manifest, key), value)
                       for key, value in claims.items() if _dig(manifest, key) != value]
        if differences:
            raise mismatch_error(self.out_dir, differences)

    def close(self) -> None:
        """Release the lock and remove the lock file (idempotent)."""
        if self._lock_fd is not None:
            (self.out_dir / LOCK_NAME).unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = None

    def discard(self) -> None:
        """Undo open() when nothing was written: remove the journal and OUT if open() created it (a run whose
        other output refused to start leaves no stray folder). Then close()."""
        if self.journal is not None and not self.journal.layers:
            self.journal.remove()
        if self.created and {p.name for p in self.out_dir.iterdir()} <= {LOCK_NAME}:
            self.close()
            self.out_dir.rmdir()
        self.close()

    def _prepare(self) -> None:
        self.plan.input.check_output(self.out_dir)
        out = self.out_dir.resolve()
        if out.exists() and not out.is_dir():
            raise OutputError("output path exists and is not a directory", file=out)
        try:
            self.created = not out.exists()
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OutputError(f"output directory is not writable ({exc.strerror})", file=self.out_dir) from exc
        self._lock()
        try:
            self._check_contents()
        except BaseException:
            self.close()
            raise

    def _check_contents(self) -> None:
        entries = [p for p in self.out_dir.iterdir() if p.name != LOCK_NAME]
        if entries and self.resume:
            if not (self.out_dir / JOURNAL_NAME).exists() and not (self.out_dir / self.finished_name()).exists():
                raise OutputError("nothing to resume: no ktconvert journal in the output directory",
                                  file=self.out_dir, hint="use --force to overwrite it")
        elif entries and self.force:
            for entry in entries:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        elif entries:
            raise OutputError("output directory exists and is not empty", file=self.out_dir,
                              hint="pass --resume to continue an interrupted run, or --force to start over")
        probe = self.out_dir / ".ktconvert-write-test"
        try:
            os.close(create_new(probe))         # a symlink standing there is removed, never written through
            probe.unlink()
        except OSError as exc:
            raise OutputError(f"output directory is not writable ({exc.strerror})", file=self.out_dir) from exc

    def _lock(self) -> None:
        self._lock_fd = lock_folder(self.out_dir)

    # ---------------------------------------------------------------- layers and the manifest

    def layer_finished(self, layer: int, result: LayerResult) -> None:
        """Journal a finished layer's files and tensor hashes (thread-safe)."""
        files = [{"path": rec.path, **rec.entry()} for rec in result.files]
        with self._journal_lock:
            self.journal.finish_layer(layer, files, result.tensors)

    def write_layer(self, layer: int, fill) -> None:
        """MoE layer `layer` written outside the streaming read (GPTQ, layer by layer): fill(consumer) puts its
        tensors into ``begin_layer(layer)``'s consumer; journalled when complete, the consumer aborted (its partial
        files removed) when not."""
        consumer = self.begin_layer(layer)
        try:
            fill(consumer)
            self.layer_finished(layer, consumer.finish())
        except BaseException:
            consumer.abort()
            raise

    def finalize(self) -> dict:
        """The subclass's last files, then ktconvert.json (written last: it marks a complete output); the journal
        is removed. Returns the manifest."""
        missing = [layer for layer in self.layers if not self.journal.layer_done(layer)]
        if missing:
            raise OutputError(f"{len(missing)} MoE layer(s) not written", file=str(self.out_dir),
                              found="layers " + ", ".join(map(str, missing[:8])))
        manifest = self._manifest(self.finish_files() if self.writes_rest else LayerResult([], {}))
        if self.part:
            write_part(self.out_dir, self.layers, self.all_layers, self.writes_rest, self.journal_options(),
                       manifest, source_sample(self.source, self.plan.input.listing))
        else:
            write_manifest(self.out_dir, manifest)
        self.journal.remove()
        return manifest

    def _manifest(self, last: LayerResult) -> dict:
        files: dict[str, dict] = {}
        tensors: dict[str, str] = {}
        for layer in self.layers:
            record = self.journal.layers[layer]
            files.update({f["path"]: {k: v for k, v in f.items() if k != "path"} for f in record["files"]})
            tensors.update(record["tensors"])
        files.update({rec.path: rec.entry() for rec in last.files})
        if self.expert_activation is not None:
            files[self.expert_activation.path] = self.expert_activation.entry()
        tensors.update(last.tensors)
        info = self.source.info
        source = {"config_sha256": self._config_sha256(),
                  "files": dict(sorted(self.journal.sources.items())), **self.plan.input.hub}
        model = {"family": info.family, "model_type": info.model_type, "layers": self.all_layers,
                 "experts": info.n_experts, "hidden": info.hidden, "intermediate": info.intermediate}
        fields = self.manifest_fields()
        extra = fields.pop("extra", {})
        activation = self.expert_activation.path if self.expert_activation is not None else None
        manifest = build_manifest(model=model, source=source, files=files, tensors=tensors,
                                  expert_activation=activation, **fields)
        manifest.update(extra)
        return manifest

    def _config_sha256(self) -> str | None:
        """sha256 of the source's config.json as ktconvert.json records it (None without one)."""
        config = self.source.side_files().get("config.json")
        return hash_file(config, kind="read")[1] if config is not None else None


def lock_folder(out_dir: Path) -> int:
    """Take `out_dir`'s lock (exclusive, non-blocking ``flock`` on OUT/.ktconvert.lock), write our pid and host name
    into it and return its descriptor; OutputError naming the holder (pid and host) when another process has it, or
    naming the lock file when it is a symlink (``fileio.open_lock``: never opened through one)."""
    path = Path(out_dir) / LOCK_NAME
    while True:
        try:
            fd = open_lock(path)
        except OSError as exc:
            raise OutputError(f"output directory is not writable ({exc.strerror})", file=out_dir) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid, _, host = os.pread(fd, 320, 0).decode(errors="replace").strip().partition(" ")
            os.close(fd)
            holder = f"pid {pid or 'unknown'}" + (f" on host {host}" if host else "")
            raise OutputError(f"another ktconvert process ({holder}) is writing this output directory",
                              file=out_dir, hint="wait for it to finish, or stop that process") from None
        try:
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino   # not a lock file its holder just removed
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)   # a folder on shared storage: say where
    return fd


def _dig(manifest: dict, key: str):
    """The value at dotted `key` of a manifest (None where a level is missing or not a table)."""
    value = manifest
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value
