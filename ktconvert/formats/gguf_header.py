"""The header of one GGUF file, read with gguf-py and checked the way llama.cpp's loader checks it, before anything
trusts it.

``read_header(path)`` returns (scalar metadata, {tensor name: TensorRef}). gguf-py's ``GGUFReader`` parses the
metadata and the tensor infos; building its per-tensor memory maps is skipped (``_InfoReader``), so a lying tensor
info cannot fail there with an anonymous message. Every tensor info is then checked, in file order (gguf.cpp,
``gguf_init_from_file_impl``, and llama.cpp's "data is not within the file bounds"):

* a unique name of at most 63 bytes, at most 4 dimensions, an element count below 2^63;
* a ggml type id gguf-py knows, the innermost dimension a whole number of that type's blocks;
* the data offset a multiple of the file's alignment (``general.alignment``, default 32) and equal to the end of
  the previous tensor's data rounded up to that alignment: tensors neither overlap nor leave gaps, so a changed
  type or shape shows as the next tensor (or the end of the file) not being where the sizes put it;
* the data inside the file, and no more than one alignment's padding after the last tensor.

A violation is one InputError naming the file and the tensor (exit 3). Big-endian files are refused (the decoders
read little-endian data).
"""
from __future__ import annotations

import traceback
from pathlib import Path

from ktconvert.errors import InputError
from ktconvert.formats.base import TensorRef
from ktconvert.quant import ggml
from ktconvert.util.safe_read import check_regular

MAX_DIMS = 4            # GGML_MAX_DIMS
MAX_NAME_BYTES = 63     # GGML_MAX_NAME - 1
MAX_ELEMENTS = 2 ** 63  # element counts are int64 in ggml

# what gguf-py raises on a malformed header (struct fields past the end of the file, bad UTF-8, unknown value
# types, duplicate keys, counts too large for numpy)
_PARSE_ERRORS = (ValueError, OSError, KeyError, IndexError, OverflowError, TypeError, MemoryError)


def _info_reader():
    """GGUFReader without the per-tensor memory maps: ``tensor_fields`` and ``data_start`` are kept instead."""
    from gguf import GGUFReader

    class _InfoReader(GGUFReader):
        def _build_tensors(self, start_offs, fields):
            self.data_start, self.tensor_fields = int(start_offs), fields

    return _InfoReader


def _scalar(field):
    """A metadata field's value when it is a scalar or string (arrays are skipped: tokenizer data)."""
    from gguf import GGUFValueType

    if not field.types or field.types[0] == GGUFValueType.ARRAY:
        return None
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


def read_header(path: Path) -> tuple[dict, dict[str, TensorRef]]:
    """(scalar metadata, tensors by name) of one GGUF file, every tensor info checked (module doc); the file's
    memory map is released on return.

    TensorRef.dtype is the ggml type name ("Q4_K"; "type N" for ids ktconvert.quant.ggml does not name), shape is
    numpy order (ggml ne reversed), offset absolute in the file, nbytes from the type's block geometry."""
    path = Path(path)
    size = check_regular(path, "GGUF file").st_size
    try:
        reader = _info_reader()(path, "r")
        if reader.byte_order != "I":
            raise InputError("big-endian GGUF files are not supported", file=path.name)
        meta = {name: value for name, field in reader.fields.items()
                if not name.startswith("GGUF.") and (value := _scalar(field)) is not None}
        infos = [_info(field) for field in reader.tensor_fields]
        alignment, data_start = int(reader.alignment), reader.data_start
    except _PARSE_ERRORS as exc:
        raise InputError(_parse_failure(exc), file=path.name) from None
    finally:
        reader = None  # drops the memory map; nothing of the tensor data was touched
    return meta, _tensor_refs(path, infos, alignment, data_start, size)


def _parse_failure(exc: BaseException) -> str:
    """The message of a header gguf-py could not parse. gguf-py reads a field that lies past the end of the file
    as an empty array and then indexes it ("index 0 is out of bounds"): a count or length field (metadata count,
    string or array length, tensor count, n_dims) promising more than the file holds; the section is told by where
    gguf-py was reading."""
    if not isinstance(exc, IndexError):
        return f"not a readable GGUF file ({exc})"
    frames = {frame.name for frame in traceback.extract_tb(exc.__traceback__)}
    section = "tensor infos" if frames & {"_build_tensor_info", "_get_tensor_info_field"} else "metadata"
    return (f"GGUF header is cut short: its {section} run past the end of the file (a count or length field "
            "promises more than the file holds)")


def _info(field) -> tuple[str, int, list[int], int, int]:
    """(name, n_dims, ne, type id, relative offset) of one tensor-info field as gguf-py parsed it."""
    _name_len, _name, n_dims, dims, raw_type, offset = field.parts
    return field.name, int(n_dims[0]), [int(d) for d in dims], int(raw_type[0]), int(offset[0])


def _tensor_refs(path: Path, infos: list, alignment: int, data_start: int, file_size: int) -> dict[str, TensorRef]:
    """TensorRefs of the checked tensor infos (module doc); InputError naming file and tensor otherwise."""
    tensors: dict[str, TensorRef] = {}
    expected, previous = 0, None
    for name, n_dims, ne, type_id, offset in infos:
        fail = _failer(path, name)
        if name in tensors:
            raise fail("tensor name appears twice in the header")
        nbytes = _checked_nbytes(fail, name, n_dims, ne, type_id)
        if offset % alignment:
            raise fail("tensor data offset is not aligned", expected=f"a multiple of {alignment} (the file's "
                       "general.alignment or GGUF's default 32)", found=str(offset))
        if offset != expected:
            raise _misplaced(fail, previous, offset, expected)
        if data_start + offset + nbytes > file_size:
            raise fail("tensor data lies outside the file", expected=f"{nbytes} bytes at offset "
                       f"{data_start + offset}", found=f"file size {file_size}")
        shape = tuple(reversed(ne))
        tensors[name] = TensorRef(path, name, ggml.type_name(type_id), shape, data_start + offset, nbytes)
        expected, previous = -(-(offset + nbytes) // alignment) * alignment, tensors[name]
    if previous is not None and file_size - (previous.offset + previous.nbytes) >= alignment:
        raise _failer(path, previous.name)(
            "the file continues past the last tensor's data (its type or shape does not account for its bytes?)",
            expected=f"data ending within {alignment} bytes of the end of the file, at {previous.offset + previous.nbytes}",
            found=f"file size {file_size}")
    return tensors


def _failer(path: Path, name: str):
    return lambda msg, **kw: InputError(msg, file=path.name, tensor=name, **kw)


def _checked_nbytes(fail, name: str, n_dims: int, ne: list[int], type_id: int) -> int:
    """Bytes of the tensor's data from its type and dimensions; InputError (via `fail`) if they are not valid."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise fail("tensor name is too long", expected=f"at most {MAX_NAME_BYTES} bytes (ggml)")
    if n_dims > MAX_DIMS or len(ne) != n_dims:
        raise fail("tensor has too many dimensions", expected=f"at most {MAX_DIMS}", found=str(n_dims))
    count = 1
    for dim in ne:
        count *= dim
    if any(d >= MAX_ELEMENTS for d in ne) or count >= MAX_ELEMENTS:
        raise fail("tensor element count does not fit ggml's int64", found=str(list(reversed(ne))))
    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise fail("unknown ggml tensor type id", expected="a type gguf-py knows", found=str(type_id)) from None
    row = ne[0] if ne else 1
    if row % block:
        raise fail(f"row size is not a multiple of the {ggml.type_name(type_id)} block size",
                   expected=f"a multiple of {block}", found=f"{row} (shape {list(reversed(ne))})")
    return count // block * type_size


def _misplaced(fail, previous: TensorRef | None, offset: int, expected: int) -> InputError:
    """The error for a tensor whose data does not start where the previous tensor's ends (rounded up)."""
    if previous is None:
        return fail("the first tensor's data does not start the data section", expected="relative offset 0",
                    found=str(offset))
    what = f"{previous.name} ({previous.dtype} {list(previous.shape)}, {previous.nbytes} bytes)"
    if offset < expected:
        return fail(f"tensor data overlaps the previous tensor {what}",
                    expected=f"relative offset {expected}", found=str(offset))
    return fail(f"a gap of {offset - expected} bytes after the previous tensor {what}: its type or shape does not "
                "account for its data", expected=f"relative offset {expected}", found=str(offset))
