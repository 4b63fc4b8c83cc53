"""GGUF writer (version 3) that streams tensor data.

Tensor data is given as an array, raw bytes, a callable producing either just before it is
written, or an iterator of chunks; only one tensor (or one chunk) is in memory at a time, so a
2B-4T-shaped 1.2 GB model is written with a few hundred MB of RAM.

Metadata values are typed by inference (bool -> BOOL, int -> UINT32 if it fits else INT32/INT64/
UINT64, float -> FLOAT32, str -> STRING, numpy arrays by dtype, lists of str -> string arrays,
lists of lists -> nested arrays) or explicitly with `Typed(GGUFValueType.X, value)`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import numpy as np

from .ggml import GGUF_DEFAULT_ALIGNMENT, VALUE_DTYPES, GGMLType, GGUFValueType, Keys, tensor_nbytes
from .gguf_reader import GGUFFile, TensorInfo
from .quants import CODECS

TensorSource = np.ndarray | bytes | tuple | Callable[[], object] | Iterator


class Typed(NamedTuple):
    """A metadata value with an explicit GGUF type; for arrays, `vtype` is the element type."""

    vtype: GGUFValueType
    value: object
    is_array: bool = False


_NUMPY_TO_VALUE = {np.dtype(d).newbyteorder("<"): t for t, d in VALUE_DTYPES.items() if t != GGUFValueType.BOOL}
_NUMPY_TO_VALUE[np.dtype(np.bool_)] = GGUFValueType.BOOL


def _infer_scalar_type(v: object) -> GGUFValueType:
    if isinstance(v, bool | np.bool_):
        return GGUFValueType.BOOL
    if isinstance(v, int | np.integer):
        v = int(v)
        if 0 <= v < 1 << 32:
            return GGUFValueType.UINT32
        if -(1 << 31) <= v < 0:
            return GGUFValueType.INT32
        return GGUFValueType.UINT64 if v > 0 else GGUFValueType.INT64
    if isinstance(v, float | np.floating):
        return GGUFValueType.FLOAT32
    if isinstance(v, str):
        return GGUFValueType.STRING
    raise TypeError(f"cannot infer a GGUF type for {type(v).__name__} {v!r}")


def _encode_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


# A value is first resolved to its GGUF type and elements (the one place types are inferred), then
# either encoded (a file) or turned into what the reader returns for it (`as_read`: no bytes).
class _Resolved(NamedTuple):
    vtype: GGUFValueType  # ARRAY for arrays
    value: object  # scalar; for arrays: a numpy array of VALUE_DTYPES[etype], list[str] or list[_Resolved]
    etype: GGUFValueType | None = None  # element type of an array


def _resolve_scalar(vtype: GGUFValueType, v: object) -> _Resolved:
    if vtype == GGUFValueType.STRING:
        return _Resolved(vtype, str(v))
    return _Resolved(vtype, np.array([v], dtype=VALUE_DTYPES[vtype]))


def _resolve_array(etype: GGUFValueType | None, values: object) -> _Resolved:
    """An array's element type (inferred when None) and elements."""
    if isinstance(values, np.ndarray):
        if etype is None:
            key = values.dtype.newbyteorder("<") if values.dtype != np.bool_ else np.dtype(np.bool_)
            if key not in _NUMPY_TO_VALUE:
                raise TypeError(f"no GGUF array type for numpy dtype {values.dtype}")
            etype = _NUMPY_TO_VALUE[key]
        if etype in VALUE_DTYPES:
            elements = np.ascontiguousarray(values.reshape(-1), dtype=VALUE_DTYPES[etype])
            return _Resolved(GGUFValueType.ARRAY, elements, etype)
        values = values.tolist()
    values = list(values)
    if etype is None:
        if not values:
            etype = GGUFValueType.STRING  # an empty list: string array (e.g. empty merges)
        elif isinstance(values[0], list | tuple | np.ndarray):
            etype = GGUFValueType.ARRAY
        else:
            etype = _infer_scalar_type(values[0])
            if etype in (GGUFValueType.UINT32, GGUFValueType.INT32):
                etype = (
                    GGUFValueType.INT32 if min(values) >= -(1 << 31) and max(values) < 1 << 31 else GGUFValueType.INT64
                )
    if etype == GGUFValueType.STRING:
        return _Resolved(GGUFValueType.ARRAY, [str(v) for v in values], etype)
    if etype == GGUFValueType.ARRAY:
        # An empty inner list takes its element type from a non-empty sibling.
        sibling = next((v for v in values if len(v)), None)
        inner = None
        if sibling is not None and not isinstance(sibling, np.ndarray):
            inner = _infer_scalar_type(sibling[0]) if not isinstance(sibling[0], list | tuple) else GGUFValueType.ARRAY
            if inner == GGUFValueType.UINT32:
                inner = GGUFValueType.INT32
        return _Resolved(GGUFValueType.ARRAY, [_resolve_array(None if len(v) else inner, v) for v in values], etype)
    return _Resolved(GGUFValueType.ARRAY, np.array(values, dtype=VALUE_DTYPES[etype]), etype)


def _resolve(value: object) -> _Resolved:
    if isinstance(value, Typed):
        if value.is_array:
            return _resolve_array(value.vtype, value.value)
        return _resolve_scalar(value.vtype, value.value)
    if isinstance(value, np.ndarray | list | tuple):
        return _resolve_array(None, value)
    return _resolve_scalar(_infer_scalar_type(value), value)


def _encode_resolved(r: _Resolved) -> bytes:
    """The value's bytes after its u32 type."""
    if r.vtype != GGUFValueType.ARRAY:
        return _encode_string(r.value) if r.vtype == GGUFValueType.STRING else r.value.tobytes()
    head = struct.pack("<IQ", r.etype, len(r.value))
    if r.etype == GGUFValueType.STRING:
        return head + b"".join(_encode_string(s) for s in r.value)
    if r.etype == GGUFValueType.ARRAY:
        return head + b"".join(_encode_resolved(inner) for inner in r.value)
    return head + r.value.tobytes()


def _read_back(r: _Resolved) -> object:
    if r.vtype == GGUFValueType.STRING:
        return r.value
    if r.vtype != GGUFValueType.ARRAY:
        v = r.value[0].item()
        return bool(v) if r.vtype == GGUFValueType.BOOL else v
    if r.etype == GGUFValueType.ARRAY:
        return [_read_back(inner) for inner in r.value]
    if r.etype == GGUFValueType.BOOL:
        return r.value.view(np.bool_)
    return r.value


def encode_value(value: object) -> bytes:
    """u32 value type + encoded value."""
    r = _resolve(value)
    return struct.pack("<I", r.vtype) + _encode_resolved(r)


def as_read(value: object) -> object:
    """The value as the GGUF reader returns it from a written file (float32 rounding, numpy arrays by
    element type, string arrays as lists), made without writing it."""
    return _read_back(_resolve(value))


class _PendingTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first)
    ggml_type: GGMLType
    n_elements: int
    n_bytes: int
    source: object


class GGUFWriter:
    """Collects metadata and tensor descriptions, then `write()` streams everything to `path`."""

    def __init__(self, path: str, *, alignment: int = GGUF_DEFAULT_ALIGNMENT, version: int = 3):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment}")
        if version not in (2, 3):
            raise ValueError(f"GGUF version must be 2 or 3, not {version}")
        self.path = path
        self.alignment = alignment
        self.version = version
        self.metadata: dict[str, object] = {}
        self.tensors: list[_PendingTensor] = []
        if alignment != GGUF_DEFAULT_ALIGNMENT:
            self.metadata[Keys.ALIGNMENT] = Typed(GGUFValueType.UINT32, alignment)

    # -- metadata -----------------------------------------------------------------------------

    def add(self, key: str, value: object, vtype: GGUFValueType | None = None) -> None:
        """Add a metadata value; `vtype` forces the scalar type (or array element type for lists)."""
        if key in self.metadata:
            raise ValueError(f"duplicate metadata key {key!r}")
        if vtype is not None and not isinstance(value, Typed):
            value = Typed(vtype, value, isinstance(value, np.ndarray | list | tuple))
        self.metadata[key] = value

    def add_dict(self, metadata: dict[str, object]) -> None:
        for key, value in metadata.items():
            self.add(key, value)

    # -- tensors ------------------------------------------------------------------------------

    def add_tensor(self, name: str, shape: tuple[int, ...], ggml_type: GGMLType, data: TensorSource) -> None:
        """Declare a tensor; `data` is read only when `write()` reaches it.

        `data`: a float array (F32/F16/BF16/Q8_0/TQ1_0/TQ2_0 are converted/quantized), raw uint8
        bytes of exactly the tensor's size, for I2_S a tuple (int8 values, scale), a zero-argument
        callable returning any of these, or an iterator of chunks (raw uint8 / bytes, or float
        arrays for F32/F16/BF16).
        """
        if any(t.name == name for t in self.tensors):
            raise ValueError(f"duplicate tensor name {name!r}")
        ggml_type = GGMLType(ggml_type)
        shape = tuple(int(d) for d in shape)
        n = 1
        for d in shape:
            n *= d
        self.tensors.append(_PendingTensor(name, shape, ggml_type, n, tensor_nbytes(ggml_type, n), data))

    # -- output -------------------------------------------------------------------------------

    def header_bytes(self) -> bytes:
        """Magic, metadata and tensor table (what `parse_header` needs), without tensor data."""
        parts = [b"GGUF", struct.pack("<IQQ", self.version, len(self.tensors), len(self.metadata))]
        for key, value in self.metadata.items():
            parts.append(_encode_string(key))
            parts.append(encode_value(value))
        rel = 0
        for t in self.tensors:
            parts.append(_encode_string(t.name))
            ne = tuple(reversed(t.shape))  # GGUF stores ggml order, innermost first
            parts.append(struct.pack(f"<I{len(ne)}Q", len(ne), *ne))
            parts.append(struct.pack("<IQ", t.ggml_type, rel))
            rel += self._padded(t.n_bytes)
        return b"".join(parts)

    def _padded(self, n: int) -> int:
        return -(-n // self.alignment) * self.alignment

    def file_size(self) -> int:
        """Size of the file `write()` produces (header and every tensor padded to the alignment)."""
        return self._padded(len(self.header_bytes())) + sum(self._padded(t.n_bytes) for t in self.tensors)

    def _file_chunks(self) -> Iterator[bytes | memoryview]:
        """The file's bytes in order: header, padding, then each tensor's data and padding."""
        header = self.header_bytes()
        yield header
        yield b"\0" * (self._padded(len(header)) - len(header))
        for t in self.tensors:
            yield from _checked_chunks(t)
            yield b"\0" * (self._padded(t.n_bytes) - t.n_bytes)

    def write(self) -> int:
        """Write the file; returns its size in bytes."""
        with open(self.path, "wb") as f:
            for chunk in self._file_chunks():
                f.write(chunk)
            return f.tell()

    def as_file(self, source: str = "<memory>") -> UnwrittenFile:
        """What `write()` would produce, as the reader would parse it, without its bytes (see UnwrittenFile)."""
        return UnwrittenFile(self, source)

    def to_buffer(self) -> np.ndarray:
        """The whole file as one uint8 array, filled tensor by tensor (for GGUFFile.from_buffer)."""
        out = np.zeros(self.file_size(), dtype=np.uint8)
        pos = 0
        for chunk in self._file_chunks():
            data = np.frombuffer(chunk, dtype=np.uint8)
            if pos + len(data) > len(out):
                raise ValueError(f"tensor data overruns the planned file size {len(out)}")
            out[pos : pos + len(data)] = data
            pos += len(data)
        return out


def _checked_chunks(t: _PendingTensor) -> Iterator[bytes | memoryview]:
    """The tensor's bytes in chunks; ValueError when they do not add up to its size."""
    written = 0
    for chunk in _payload_chunks(t):
        yield chunk
        written += len(chunk)
    if written != t.n_bytes:
        raise ValueError(
            f"tensor {t.name!r} ({t.ggml_type.name} {list(t.shape)}): data has {written} bytes, expected {t.n_bytes}"
        )


def _tensor_data(t: _PendingTensor) -> np.ndarray:
    """The tensor's bytes as one uint8 array (no copy when its source gives them in one piece)."""
    chunks = [np.frombuffer(c, dtype=np.uint8) for c in _checked_chunks(t)]
    if len(chunks) == 1:
        return chunks[0]
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


class UnwrittenFile(GGUFFile):
    """The file a GGUFWriter would write, as `GGUFFile` reads it, with no GGUF bytes in memory.

    Metadata is what the reader would return (`as_read`); the tensor table has the sizes and the
    offsets of the tensor data section (`data_offset` 0: there is no header); each tensor's bytes are
    made by its source when asked for (the last one is kept: the loader reads a tensor's bytes and
    then its scale) and checked by its codec as they are made, so `validate_tensors` reads nothing.
    A Hugging Face checkpoint loads through this: its files plus one tensor at a time, never a copy
    of the whole model.
    """

    def __init__(self, writer: GGUFWriter, source: str):
        tensors: dict[str, TensorInfo] = {}
        offset = 0
        for t in writer.tensors:
            tensors[t.name] = TensorInfo(t.name, t.shape, t.ggml_type, offset, t.n_bytes, t.n_elements)
            offset += writer._padded(t.n_bytes)
        super().__init__(
            np.zeros(0, dtype=np.uint8),
            version=writer.version,
            metadata={key: as_read(value) for key, value in writer.metadata.items()},
            tensors=tensors,
            alignment=writer.alignment,
            data_offset=0,
            header_size=0,
            total_size=offset,
            source=source,
        )
        self._pending = {t.name: t for t in writer.tensors}
        self._last: tuple[str, np.ndarray] | None = None

    def tensor_bytes(self, name: str) -> np.ndarray:
        info = self._info(name)
        if self._last is None or self._last[0] != name:
            self._last = None  # its memory is free while the next tensor is made
            data = _tensor_data(self._pending[name])
            check = CODECS[info.ggml_type].check
            if check is not None:
                check(data, info.n_elements, where=self._where(info))
            self._last = (name, data)
        return self._last[1]

    def validate_tensors(self) -> None:
        """Nothing to read: each tensor is checked as it is made."""


def _payload_chunks(t: _PendingTensor) -> Iterable[bytes | memoryview]:
    data = t.source
    if callable(data):
        data = data()
    if hasattr(data, "__next__"):
        for chunk in data:
            yield _chunk_bytes(t, chunk)
        return
    yield _tensor_bytes(t, data)


def _chunk_bytes(t: _PendingTensor, chunk: object) -> memoryview:
    if isinstance(chunk, bytes | bytearray | memoryview):
        return memoryview(chunk)
    arr = np.asarray(chunk)
    if arr.dtype == np.uint8:
        return memoryview(np.ascontiguousarray(arr).reshape(-1))
    return memoryview(_float_payload(t, arr))


def _float_payload(t: _PendingTensor, arr: np.ndarray) -> np.ndarray:
    codec = CODECS[t.ggml_type]
    if not codec.elementwise:
        raise TypeError(f"tensor {t.name!r}: float chunks only for element-wise types, not {t.ggml_type.name}")
    return codec.encode(arr)


def _tensor_bytes(t: _PendingTensor, data: object) -> memoryview:
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data)
    codec = CODECS[t.ggml_type]
    if codec.encode_ternary is not None and isinstance(data, tuple):
        values, scale = data
        return memoryview(codec.encode_ternary(values, scale))
    arr = np.asarray(data)
    if arr.dtype == np.uint8 and arr.size == t.n_bytes:
        return memoryview(np.ascontiguousarray(arr).reshape(-1))
    if arr.size != t.n_elements:
        raise ValueError(f"tensor {t.name!r}: {arr.size} values for shape {list(t.shape)}")
    if codec.encode is None:
        raise TypeError(f"tensor {t.name!r}: give {t.ggml_type.name} data as raw bytes or (values, scale)")
    return memoryview(codec.encode(arr))
