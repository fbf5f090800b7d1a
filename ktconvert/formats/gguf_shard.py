"""The shards of a LLAMAFILE GGUF output as they are written (``formats/gguf_sink.py`` plans them): ``ShardFile``
(one shard: its header, tensor data written with ``os.pwrite`` at planned offsets, the file hash fed as pieces go
out, a temporary name until its last tensor is written, an interrupted run's partial file reopened) and
``GgufLayerWriter`` (one MoE layer's expert tensors, one expert at a time, into the shards that hold them).
"""
from __future__ import annotations

import hashlib
import os
import stat
import threading

from ktconvert.errors import OutputError, ShapeError
from ktconvert.formats.fileio import HASH_CHUNK, FileHasher, FileRecord, LayerResult, NewFile, open_dir
from ktconvert.formats.ordered_hash import OrderedFileHash

PROJ_TENSORS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def pad(n: int, align: int = 32) -> int:
    """`n` rounded up to the GGUF data alignment."""
    return (n + align - 1) // align * align


class ShardFile:
    """One shard being written: header and padding at creation, tensors at their offsets, renamed over its name
    once every tensor is done."""

    def __init__(self, sink, index: int):
        self.sink, self.index = sink, index
        self.path = sink.out_dir / sink.shard_name(index)
        self.size = sink.shard_bytes(index)
        head, self.offsets = sink.header(index)
        self.tensors = {t.name: t for t in sink.shards[index]}
        self.finished: set[str] = set()      # tensors complete in the file (this run)
        self.write_here, self.earlier = sink.expected(index)
        self.committed = False
        self._lock = threading.Lock()
        sink.out_dir.mkdir(parents=True, exist_ok=True)
        self.reused = self._open()
        if self.earlier and not self.reused:
            self.discard()
            raise OutputError("cannot resume: journalled layers' tensors were in this shard's partial file, which "
                              "is gone", file=self.path.name, tensor=sorted(self.earlier)[0],
                              hint="pass --force to start over")
        try:
            if not self.reused:
                os.ftruncate(self._fd, self.size)
                if hasattr(os, "posix_fallocate"):         # a full disk fails here, not half-way through the layer
                    os.posix_fallocate(self._fd, 0, self.size)
            self._hash = OrderedFileHash(self._fd, self.size)
            self.write(head, 0)
            for t in sink.shards[index]:                   # zero padding after each tensor, hashed as written
                end = self.offsets[t.name] + t.nbytes
                if pad(end) > end:
                    self.write(bytes(pad(end) - end), end)
        except OSError as exc:
            self.discard()
            raise OutputError(f"cannot create output file ({exc.strerror})", file=str(self.path),
                              expected=f"{self.size} bytes of space") from None

    def _open(self) -> bool:
        """Open the temporary file; True when an interrupted run's one of the right size was reopened."""
        new = NewFile.__new__(NewFile)              # NewFile's commit / discard, on a reopened temporary
        new.path, new.temp = self.path, self.path.with_name(f".{self.path.name}.partial")
        new.dir_fd = open_dir(self.path.parent)
        try:
            if self.earlier and not _is_file(new.temp.name, new.dir_fd) and _is_file(self.path.name, new.dir_fd):
                # completed by a layer the kill kept out of the journal: taken back to be completed again
                os.rename(self.path.name, new.temp.name, src_dir_fd=new.dir_fd, dst_dir_fd=new.dir_fd)
            fd = os.open(new.temp.name, os.O_RDWR | _NOFOLLOW, dir_fd=new.dir_fd)
        except OSError:
            os.close(new.dir_fd)
            self._new = NewFile(self.path, os.O_RDWR)
            self._fd = self._new.fd
            return False
        if os.fstat(fd).st_size != self.size:
            os.close(fd)
            os.close(new.dir_fd)
            self._new = NewFile(self.path, os.O_RDWR)
            self._fd = self._new.fd
            return False
        new.fd = self._fd = fd
        self._new = new
        return True

    def write(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as exc:
            raise OutputError(f"write failed ({exc.strerror})", file=str(self.path)) from None
        self._hash.wrote(offset, view)

    def tensor_sha256(self, name: str) -> str:
        offset, nbytes = self.offsets[name], self.tensors[name].nbytes
        h = hashlib.sha256()
        for at in range(offset, offset + nbytes, HASH_CHUNK):
            h.update(os.pread(self._fd, min(HASH_CHUNK, offset + nbytes - at), at))
        return h.hexdigest()

    def done(self, *names: str) -> FileRecord | None:
        """Tensors `names` are complete: the shard's FileRecord when that completes it (the file renamed over its
        name), else None (the tensors synced, so a resumed run finds them)."""
        with self._lock:
            self.finished.update(names)
            complete = self.write_here <= self.finished
            if not complete:
                try:
                    os.fdatasync(self._fd)
                except OSError as exc:
                    raise OutputError(f"cannot sync output file ({exc.strerror})", file=str(self.path)) from None
                return None
            return self._commit()

    def _commit(self) -> FileRecord:
        try:
            if set(self.tensors) <= self.finished:
                sha256, git_sha1 = self._hash.hexdigests()
            else:                                      # bytes of an earlier run in it: hash the file as it is
                hasher = FileHasher(self.size)
                for at in range(0, self.size, HASH_CHUNK):
                    hasher.update(os.pread(self._fd, min(HASH_CHUNK, self.size - at), at))
                sha256, git_sha1 = hasher.hexdigests()
            os.fsync(self._fd)
            if hasattr(os, "posix_fadvise"):               # written and synced: let the page cache drop it
                os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            self._fd = None
            self._new.commit(durable=True, synced=True)
        except OSError as exc:
            self.discard()
            raise OutputError(f"cannot finish output file ({exc.strerror})", file=str(self.path)) from None
        self.committed = True
        return FileRecord(self.path.name, self.size, sha256, git_sha1)

    def discard(self) -> None:
        self._fd = None
        self._new.discard()
        with self.sink._lock:
            self.sink._files.pop(self.index, None)


class GgufLayerWriter:
    """One layer's expert tensors, in the shard(s) holding them; experts may arrive in any order. finish() ->
    (the shards it completed, tensor sha256s)."""

    def __init__(self, sink, layer: int):
        self.sink, self.layer = sink, layer
        self.names = {proj: f"blk.{layer}.{t}.weight" for proj, t in PROJ_TENSORS.items()}
        self.shards = {proj: sink.shard_file(sink.shard_of(name)) for proj, name in self.names.items()}
        self.path = self.shards["gate"].path
        self.written: set[tuple[str, int]] = set()
        self._lock = threading.Lock()       # put_matrix may run on several threads at once

    def put_matrix(self, proj: str, expert: int, w_bf16) -> None:
        """Quantize one expert matrix (uint16 BF16 bits in HF orientation) and write it at its place."""
        want = self.sink.shapes[proj]
        name = self.names[proj]
        if tuple(w_bf16.shape) != want:
            raise ShapeError("expert matrix has the wrong shape", tensor=f"{name}[{expert}]", expected=str(list(want)),
                             found=str(list(w_bf16.shape)))
        self.put_stored(proj, expert, self.sink.method.encode(w_bf16, where=f"{name}[{expert}]",
                                                              ggml_type=self.sink.tensor_type(self.layer, proj)))

    def put_stored(self, proj: str, expert: int, tensors: dict) -> None:
        """Write one expert matrix's bytes as given ({"weight": uint8 blocks}, already this method's type)."""
        name = self.names[proj]
        shard = self.shards[proj]
        data = tensors["weight"]
        nbytes = self.sink.slice_bytes(self.layer, proj)
        if data.nbytes != nbytes:
            raise OutputError("wrong byte count", file=shard.path.name, tensor=f"{name}[{expert}]",
                              expected=str(nbytes), found=str(data.nbytes))
        with self._lock:
            if not 0 <= expert < self.sink.n_experts or (proj, expert) in self.written:
                raise OutputError("expert out of range or written twice", file=shard.path.name,
                                  tensor=f"{name}[{expert}]")
            self.written.add((proj, expert))
        shard.write(data.reshape(-1).view("u1"), shard.offsets[name] + expert * nbytes)

    def finish(self) -> LayerResult:
        missing = [(p, e) for p in PROJ_TENSORS for e in range(self.sink.n_experts) if (p, e) not in self.written]
        if missing:
            self.abort()
            raise OutputError(f"layer file incomplete: {len(missing)} expert matrices never written",
                              file=self.path.name, tensor=f"{self.names[missing[0][0]]}[{missing[0][1]}]")
        tensors = {self.names[p]: self.shards[p].tensor_sha256(self.names[p]) for p in PROJ_TENSORS}
        records = []
        for shard in dict.fromkeys(self.shards.values()):
            names = [self.names[p] for p in PROJ_TENSORS if self.shards[p] is shard]
            try:
                record = shard.done(*names)
            except OutputError:
                self.abort()
                raise
            records += [record] if record else []
        return LayerResult(records, tensors)

    def abort(self) -> None:
        """Remove the shards only this layer was writing (a shard holding other finished layers is kept)."""
        for shard in dict.fromkeys(self.shards.values()):
            mine = {self.names[p] for p in PROJ_TENSORS if self.shards[p] is shard}
            if not shard.committed and not shard.reused and shard.finished <= mine:
                shard.discard()


def _is_file(name: str, dir_fd: int) -> bool:
    """Whether `name` in folder `dir_fd` is a regular file (a symlink is not)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
