"""GGUF reader: zero-copy numpy views over one byte buffer.

The whole file is one `np.ndarray[uint8]`: a `np.memmap` in CPython, an array over the downloaded
ArrayBuffer in Pyodide. Parsing rests on one primitive (`_Cursor.view`) that returns a view of
`count` values of a dtype at the current offset and advances; type tables map GGUF value types to
numpy dtypes and GGML tensor types to (block size, bytes per block).

File layout (little endian, version 2 and 3):
    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key | u32 value_type | value)
    tensor_count x (string name | u32 n_dims | n_dims x u64 ne (innermost first) | u32 type | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
Strings are u64 length + UTF-8 bytes; arrays are u32 element type + u64 count + elements.

Parsing works on a prefix of the file (`parse_header`): a read past the end of the prefix means
"need more bytes" unless the prefix is the whole file, in which case it is a truncated file.
Length fields are checked against the bytes that remain before anything is allocated.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from . import quants
from .ggml import (
    GGML_MAX_DIMS,
    GGML_TYPE_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGUF_MAX_ARRAY_NESTING,
    MIN_VALUE_BYTES,
    OUTPUT,
    SUPPORTED_VERSIONS,
    TOKEN_EMBD,
    VALUE_DTYPES,
    GGMLType,
    GGUFError,
    GGUFFormatError,
    GGUFLengthError,
    GGUFTruncatedError,
    GGUFUnsupportedError,
    GGUFValueType,
    Keys,
    tensor_nbytes,
)


class _NeedMore(Exception):
    """Internal: the prefix ends before the field; more of the download is needed."""


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order, outermost first: token_embd is (n_vocab, n_embd)
    ggml_type: GGMLType
    offset: int  # absolute byte offset in the file
    n_bytes: int
    n_elements: int


# ---------------------------------------------------------------------------------------------
# The parsing primitive
# ---------------------------------------------------------------------------------------------


class _Cursor:
    """Reads fields from `data` (a prefix of a file of `total` bytes, or all of it)."""

    def __init__(self, data: np.ndarray, total: int | None):
        self.data = data
        self.mem = memoryview(data)  # for fast struct/str access in string-heavy arrays
        self.avail = len(data)
        self.total = total  # None: size of the whole file unknown
        self.pos = 0

    def remaining(self) -> int | None:
        return None if self.total is None else self.total - self.pos

    def need(self, nbytes: int, field: str) -> None:
        end = self.pos + nbytes
        if self.total is not None and end > self.total:
            raise GGUFTruncatedError(
                f"file truncated: {field} at byte offset {self.pos} needs {nbytes} bytes, "
                f"but the file ends at {self.total}"
            )
        if end > self.avail:
            raise _NeedMore

    def view(self, dtype: np.dtype, count: int, field: str) -> np.ndarray:
        """The one primitive: `count` values of `dtype` at the cursor, as a view; advances."""
        nbytes = dtype.itemsize * count
        self.need(nbytes, field)
        out = self.data[self.pos : self.pos + nbytes].view(dtype)
        self.pos += nbytes
        return out

    def scalar(self, fmt: str, size: int, field: str):
        self.need(size, field)
        (value,) = struct.unpack_from(fmt, self.mem, self.pos)
        self.pos += size
        return value

    def u32(self, field: str) -> int:
        return self.scalar("<I", 4, field)

    def u64(self, field: str) -> int:
        return self.scalar("<Q", 8, field)

    def check_count(self, count: int, min_bytes_each: int, field: str, at: int) -> None:
        """Reject a count whose elements cannot fit in the rest of the file, before allocating."""
        remaining = self.remaining()
        if remaining is not None and count * min_bytes_each > remaining:
            raise GGUFLengthError(
                f"{field} at byte offset {at} claims {count} elements (at least "
                f"{count * min_bytes_each} bytes) but only {remaining} bytes remain in the file "
                "(truncated file or corrupt length)"
            )

    def string(self, field: str) -> str:
        at = self.pos
        n = self.u64(f"length of {field}")
        self.check_count(n, 1, f"string length of {field}", at)
        self.need(n, field)
        start = self.pos
        self.pos += n
        try:
            return str(self.mem[start : start + n], "utf-8")
        except UnicodeDecodeError as e:
            raise GGUFFormatError(f"{field} at byte offset {start + e.start} is not valid UTF-8 ({e.reason})") from None

    def string_array(self, count: int, field: str) -> list[str]:
        """`count` strings. Tokenizer vocabularies hold ~400k of them, so a fast path decodes from
        1 MiB bytes windows; anything unusual (end of data, bad UTF-8) is left to the careful
        per-string path, which produces the error message."""
        out: list[str] = []
        self._string_array_fast(count, out)
        mem, unpack = self.mem, struct.unpack_from
        for i in range(len(out), count):
            if self.pos + 8 > self.avail:
                self.need(8, f"{field}[{i}] length")
            (n,) = unpack("<Q", mem, self.pos)
            start = self.pos + 8
            self.pos = start
            if self.total is not None and n > self.total - start:
                raise GGUFLengthError(
                    f"{field}[{i}] at byte offset {start - 8} claims a string of {n} bytes but only "
                    f"{self.total - start} bytes remain in the file (truncated file or corrupt length)"
                )
            self.need(n, f"{field}[{i}]")
            try:
                out.append(str(mem[start : start + n], "utf-8"))
            except UnicodeDecodeError as e:
                raise GGUFFormatError(
                    f"{field}[{i}] at byte offset {start + e.start} is not valid UTF-8 ({e.reason})"
                ) from None
            self.pos = start + n
        return out

    def _string_array_fast(self, count: int, out: list[str]) -> None:
        window = 1 << 20
        limit = self.avail if self.total is None else min(self.avail, self.total)
        pos = self.pos
        base, chunk = pos, bytes(self.mem[pos : min(pos + window, limit)])
        unpack, append = struct.unpack_from, out.append
        try:
            for _ in range(count):
                rel = pos - base
                if rel + 8 > len(chunk):
                    if pos + 8 > limit:
                        return
                    base, rel = pos, 0
                    chunk = bytes(self.mem[pos : min(pos + window, limit)])
                (n,) = unpack("<Q", chunk, rel)
                end = rel + 8 + n
                if end > len(chunk):
                    if pos + 8 + n > limit:
                        return
                    base, rel, end = pos, 0, 8 + n
                    chunk = bytes(self.mem[pos : min(pos + max(window, 8 + n), limit)])
                append(chunk[rel + 8 : end].decode("utf-8"))
                pos = base + end
        except UnicodeDecodeError:
            return
        finally:
            self.pos = pos

    def value(self, vtype: int, field: str, at: int) -> object:
        """One metadata value of type `vtype` (already read) for `field`."""
        if vtype in _SCALAR_FORMATS:
            fmt, size = _SCALAR_FORMATS[vtype]
            v = self.scalar(fmt, size, field)
            if vtype == GGUFValueType.BOOL:
                if v > 1:
                    raise GGUFFormatError(f"{field} at byte offset {self.pos - 1} is a bool with value {v}")
                return bool(v)
            return v
        if vtype == GGUFValueType.STRING:
            return self.string(field)
        if vtype == GGUFValueType.ARRAY:
            return self.array(field)
        raise GGUFFormatError(f"{field} at byte offset {at} has unknown value type {vtype}")

    def array(self, field: str, depth: int = 0) -> object:
        at = self.pos
        if depth > GGUF_MAX_ARRAY_NESTING:
            raise GGUFFormatError(f"{field} at byte offset {at}: arrays nested more than {GGUF_MAX_ARRAY_NESTING} deep")
        etype = self.u32(f"element type of {field}")
        if etype not in MIN_VALUE_BYTES:
            raise GGUFFormatError(f"{field} at byte offset {at} is an array of unknown value type {etype}")
        count_at = self.pos
        count = self.u64(f"length of {field}")
        self.check_count(count, MIN_VALUE_BYTES[GGUFValueType(etype)], f"array {field}", count_at)
        if etype in VALUE_DTYPES:
            arr = self.view(VALUE_DTYPES[GGUFValueType(etype)], count, field)
            if etype == GGUFValueType.BOOL:
                if count and int(arr.max()) > 1:
                    raise GGUFFormatError(f"{field} at byte offset {count_at + 8} holds a bool other than 0/1")
                return arr.view(np.bool_)
            return arr
        if etype == GGUFValueType.STRING:
            return self.string_array(count, field)
        # Nested arrays: a list of whatever each element is.
        return [self.array(f"{field}[{i}]", depth + 1) for i in range(count)]


_SCALAR_FORMATS: dict[int, tuple[str, int]] = {
    GGUFValueType.UINT8: ("<B", 1),
    GGUFValueType.INT8: ("<b", 1),
    GGUFValueType.UINT16: ("<H", 2),
    GGUFValueType.INT16: ("<h", 2),
    GGUFValueType.UINT32: ("<I", 4),
    GGUFValueType.INT32: ("<i", 4),
    GGUFValueType.FLOAT32: ("<f", 4),
    GGUFValueType.BOOL: ("<B", 1),
    GGUFValueType.UINT64: ("<Q", 8),
    GGUFValueType.INT64: ("<q", 8),
    GGUFValueType.FLOAT64: ("<d", 8),
}

# Smallest possible encodings, to bound counts: a kv pair (empty key, u32 type, 1-byte value) and a
# tensor info (empty name, u32 n_dims, u32 type, u64 offset).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


# ---------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------


class GGUFFile:
    """A parsed GGUF file: metadata, tensor table, and views of the tensor data.

    `metadata` values: ints/floats/bools/str for scalars; numeric arrays as numpy views (bool
    arrays as np.bool_); string arrays as list[str]; nested arrays as lists.
    """

    def __init__(
        self,
        data: np.ndarray,
        *,
        version: int,
        metadata: dict[str, object],
        tensors: dict[str, TensorInfo],
        alignment: int,
        data_offset: int,
        header_size: int,
        total_size: int | None,
        source: str = "<buffer>",
    ):
        self.data = data  # uint8 buffer (the whole file, or a prefix of it)
        self.version = version
        self.metadata = metadata
        self.tensors = tensors
        self.alignment = alignment
        self.data_offset = data_offset  # absolute offset where tensor data starts
        self.header_size = header_size  # bytes of magic + metadata + tensor infos
        self.total_size = total_size
        self.source = source

    # -- constructors -------------------------------------------------------------------------

    @classmethod
    def from_buffer(cls, data: np.ndarray | bytes | bytearray | memoryview, source: str = "<buffer>") -> GGUFFile:
        """Parse a complete file held in memory (a uint8 array: no copy is made of it)."""
        buf = _as_uint8(data)
        gguf = _parse(buf, len(buf), source)
        assert gguf is not None  # the whole file is present, so nothing can be "need more"
        return gguf

    # -- metadata helpers ---------------------------------------------------------------------

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get(Keys.ARCHITECTURE)
        return arch if isinstance(arch, str) else None

    def get(self, key: str, default: object = None) -> object:
        """Metadata value; '{arch}' in `key` is replaced by general.architecture."""
        if "{arch}" in key:
            if self.architecture is None:
                return default
            key = Keys.arch(key, self.architecture)
        return self.metadata.get(key, default)

    # -- tensor data --------------------------------------------------------------------------

    def _info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise KeyError(f"{self.source}: no tensor named {name!r}") from None

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's raw bytes, as a uint8 view of the buffer (no copy)."""
        info = self._info(name)
        end = info.offset + info.n_bytes
        if end > len(self.data):
            raise GGUFTruncatedError(
                f"{self.source}: tensor {name!r} data at byte offset {info.offset}..{end} is not loaded "
                f"(buffer holds {len(self.data)} bytes)"
            )
        return self.data[info.offset : end]

    def _where(self, info: TensorInfo) -> str:
        return f"{self.source}: tensor {info.name!r} at byte offset {info.offset}"

    def tensor(self, name: str) -> np.ndarray:
        """Float values in `shape`: views for F32/F16, float32 copies for BF16 and quantized types.

        I2_S, TQ1_0, TQ2_0 and Q8_0 are dequantized to float32 (value * scale); use
        `ternary(name)` to get the int8 ternary values and the scale of a ternary tensor.
        """
        info = self._info(name)
        return quants.codec(info.ggml_type).decode(self.tensor_bytes(name), info.shape, where=self._where(info))

    def ternary(self, name: str) -> tuple[np.ndarray, float]:
        """(int8 values -1/0/+1 in shape, per-tensor scale) of an I2_S, TQ1_0 or TQ2_0 tensor."""
        info = self._info(name)
        decode = quants.codec(info.ggml_type).ternary
        if decode is None:
            raise GGUFFormatError(f"{self._where(info)} has type {info.ggml_type.name}, not a ternary type")
        return decode(self.tensor_bytes(name), info.shape, where=self._where(info))

    def i2s_scale(self, name: str) -> float:
        """The per-tensor float32 scale of an I2_S tensor, checked finite (cheap: reads 4 bytes)."""
        info = self._info(name)
        return quants.i2s_scale(self.tensor_bytes(name), info.n_elements, where=self._where(info))

    def validate_tensors(self) -> None:
        """Cheap whole-file checks that need tensor data (the codecs' `check`: every I2_S scale finite)."""
        for info in self.tensors.values():
            check = quants.codec(info.ggml_type).check
            if check is not None:
                check(self.tensor_bytes(info.name), info.n_elements, where=self._where(info))

    def __repr__(self) -> str:
        return (
            f"GGUFFile({self.source!r}, v{self.version}, arch={self.architecture!r}, "
            f"{len(self.metadata)} keys, {len(self.tensors)} tensors)"
        )


def open_gguf(path: str) -> GGUFFile:
    """Memory-map and parse a GGUF file (tensor data stays on disk until touched)."""
    import os

    size = os.path.getsize(path)
    if size == 0:
        raise GGUFTruncatedError(f"{path}: file is empty (expected the magic 'GGUF' at byte offset 0)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    gguf = _parse(data, size, str(path))
    assert gguf is not None
    return gguf


def parse_header(prefix: bytes | bytearray | memoryview | np.ndarray, total_size: int | None) -> GGUFFile | None:
    """Parse metadata and tensor table from the first bytes of a file.

    Returns None while `prefix` is too short. `total_size` (the full file size, e.g. from
    Content-Length) lets lying lengths and tensors past the end be rejected early; with None those
    checks wait for the full file. The returned GGUFFile's `header_size` says how many bytes were
    used; its tensor data is available only where the prefix covers it.
    """
    buf = _as_uint8(prefix)
    if total_size is not None and len(buf) > total_size:
        raise GGUFFormatError(f"prefix of {len(buf)} bytes is longer than total_size {total_size}")
    try:
        return _parse(buf, total_size, "<download>")
    except _NeedMore:
        return None


def _as_uint8(data: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"expected a 1-D uint8 array, got {data.dtype} with shape {data.shape}")
        return data
    return np.frombuffer(data, dtype=np.uint8)


def _parse(buf: np.ndarray, total: int | None, source: str) -> GGUFFile | None:
    """Parse header + tensor table. Raises _NeedMore if `buf` is a too-short prefix."""
    cur = _Cursor(buf, total)
    try:
        return _parse_cursor(cur, source)
    except GGUFError as e:
        if source.startswith("<"):
            raise
        raise type(e)(f"{source}: {e}") from None


def _parse_cursor(cur: _Cursor, source: str) -> GGUFFile:
    cur.need(4, "magic")
    magic = bytes(cur.mem[0:4])
    if magic != GGUF_MAGIC:
        raise GGUFFormatError(f"bad magic {magic!r} at byte offset 0 (expected b'GGUF'): not a GGUF file")
    cur.pos = 4
    version = cur.u32("version")
    if version == 1:
        raise GGUFUnsupportedError(
            "GGUF version 1 (byte offset 4) is not supported (32-bit counts); re-convert the model "
            "with a current llama.cpp to get version 3"
        )
    if version not in SUPPORTED_VERSIONS:
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        if swapped in (1, *SUPPORTED_VERSIONS):
            # llama.cpp's big-endian builds write the version (and everything after) big-endian.
            raise GGUFUnsupportedError(
                f"big-endian GGUF (version {swapped} stored big-endian at byte offset 4) is not supported: "
                "use a little-endian file (the usual kind; llama.cpp's gguf_convert_endian.py converts)"
            )
        raise GGUFUnsupportedError(f"unknown GGUF version {version} at byte offset 4 (supported: 2, 3)")

    n_tensors_at = cur.pos
    n_tensors = cur.u64("tensor count")
    n_kv_at = cur.pos
    n_kv = cur.u64("metadata key-value count")
    cur.check_count(n_tensors, _MIN_TENSOR_INFO_BYTES, "tensor count", n_tensors_at)
    cur.check_count(n_kv, _MIN_KV_BYTES, "metadata key-value count", n_kv_at)

    metadata: dict[str, object] = {}
    for i in range(n_kv):
        key_at = cur.pos
        key = cur.string(f"metadata key #{i}")
        if key in metadata:
            raise GGUFFormatError(f"duplicate metadata key {key!r} at byte offset {key_at}")
        vtype_at = cur.pos
        vtype = cur.u32(f"value type of {key!r}")
        if key == Keys.ALIGNMENT and vtype != GGUFValueType.UINT32:
            # gguf-py ("Bad type for GGUF general.alignment field") and llama.cpp accept only UINT32.
            raise GGUFFormatError(
                f"general.alignment at byte offset {vtype_at} has value type {vtype} (expected 4, UINT32)"
            )
        metadata[key] = cur.value(vtype, repr(key), vtype_at)

    alignment = metadata.get(Keys.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment {alignment!r} is not a positive power of two")

    # Tensor infos: offsets are relative to the data section, which starts after the table.
    raw_infos = []
    names: set[str] = set()
    for i in range(n_tensors):
        at = cur.pos
        name = cur.string(f"tensor #{i} name")
        if name in names:
            raise GGUFFormatError(f"duplicate tensor name {name!r} at byte offset {at}")
        names.add(name)
        n_dims_at = cur.pos
        n_dims = cur.u32(f"tensor {name!r} n_dims")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFFormatError(
                f"tensor {name!r}: n_dims {n_dims} at byte offset {n_dims_at} not in 1..{GGML_MAX_DIMS}"
            )
        ne = [int(x) for x in cur.view(np.dtype("<u8"), n_dims, f"tensor {name!r} dims")]
        n_elements = 1
        extent = 1  # product of the non-zero dims: numpy refuses such shapes even for empty arrays
        for d in ne:
            n_elements *= d
            extent *= max(d, 1)
        if extent >= 1 << 56:
            raise GGUFFormatError(f"tensor {name!r}: dims {ne} at byte offset {n_dims_at + 4} are absurd")
        type_at = cur.pos
        type_id = cur.u32(f"tensor {name!r} type")
        try:
            ggml_type = GGMLType(type_id)
        except ValueError:
            raise GGUFUnsupportedError(
                f"tensor {name!r} has GGML type id {type_id} (byte offset {type_at}), which this reader "
                f"does not support (supported: {', '.join(f'{t.name}={t.value}' for t in GGMLType)})"
            ) from None
        block = GGML_TYPE_SIZES[ggml_type].block
        if ne[0] % block:
            raise GGUFFormatError(
                f"tensor {name!r} ({ggml_type.name}): row length {ne[0]} is not a multiple of the "
                f"block size {block} (byte offset {n_dims_at + 4})"
            )
        offset_at = cur.pos
        rel_offset = cur.u64(f"tensor {name!r} data offset")
        if rel_offset % alignment:
            raise GGUFFormatError(
                f"tensor {name!r}: data offset {rel_offset} (field at byte offset {offset_at}) is not a "
                f"multiple of general.alignment {alignment}"
            )
        raw_infos.append((name, tuple(reversed(ne)), ggml_type, rel_offset, n_elements, offset_at))

    header_size = cur.pos
    data_offset = -(-header_size // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, shape, ggml_type, rel, n_el, _ in raw_infos:
        tensors[name] = TensorInfo(name, shape, ggml_type, data_offset + rel, tensor_nbytes(ggml_type, n_el), n_el)
    _check_tensor_extents(raw_infos, tensors, cur.total, data_offset)

    return GGUFFile(
        cur.data,
        version=version,
        metadata=metadata,
        tensors=tensors,
        alignment=alignment,
        data_offset=data_offset,
        header_size=header_size,
        total_size=cur.total,
        source=source,
    )


def _check_tensor_extents(raw_infos: list, tensors: dict[str, TensorInfo], total: int | None, data_offset: int) -> None:
    """Tensor data inside the file and no two tensors overlapping."""
    offset_field = {name: at for name, *_, at in raw_infos}
    ordered = sorted(tensors.values(), key=lambda t: t.offset)
    for prev, nxt in zip(ordered, ordered[1:], strict=False):
        if prev.offset + prev.n_bytes > nxt.offset:
            raise GGUFFormatError(
                f"tensors {prev.name!r} (bytes {prev.offset}..{prev.offset + prev.n_bytes}) and "
                f"{nxt.name!r} (from byte {nxt.offset}, offset field at byte offset "
                f"{offset_field[nxt.name]}) overlap"
            )
    if total is None:
        return
    for t in ordered:
        if t.offset + t.n_bytes > total:
            raise GGUFFormatError(
                f"tensor {t.name!r} data (bytes {t.offset}..{t.offset + t.n_bytes}, offset field at "
                f"byte offset {offset_field[t.name]}) extends past the end of the file ({total} bytes)"
            )


# ---------------------------------------------------------------------------------------------
# Human-readable summary (python -m bitnet_web inspect)
# ---------------------------------------------------------------------------------------------


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# general.file_type values (llama.h's llama_ftype). 0..37 as in upstream llama.cpp / gguf-py; 38..40
# as in bitnet.cpp, whose I2_S files say 40 (upstream later gave 38..40 to other types).
FILE_TYPE_NAMES: dict[int, str] = {
    0: "ALL_F32",
    1: "MOSTLY_F16",
    2: "MOSTLY_Q4_0",
    3: "MOSTLY_Q4_1",
    7: "MOSTLY_Q8_0",
    8: "MOSTLY_Q5_0",
    9: "MOSTLY_Q5_1",
    10: "MOSTLY_Q2_K",
    11: "MOSTLY_Q3_K_S",
    12: "MOSTLY_Q3_K_M",
    13: "MOSTLY_Q3_K_L",
    14: "MOSTLY_Q4_K_S",
    15: "MOSTLY_Q4_K_M",
    16: "MOSTLY_Q5_K_S",
    17: "MOSTLY_Q5_K_M",
    18: "MOSTLY_Q6_K",
    19: "MOSTLY_IQ2_XXS",
    20: "MOSTLY_IQ2_XS",
    21: "MOSTLY_Q2_K_S",
    22: "MOSTLY_IQ3_XS",
    23: "MOSTLY_IQ3_XXS",
    24: "MOSTLY_IQ1_S",
    25: "MOSTLY_IQ4_NL",
    26: "MOSTLY_IQ3_S",
    27: "MOSTLY_IQ3_M",
    28: "MOSTLY_IQ2_S",
    29: "MOSTLY_IQ2_M",
    30: "MOSTLY_IQ4_XS",
    31: "MOSTLY_IQ1_M",
    32: "MOSTLY_BF16",
    33: "MOSTLY_Q4_0_4_4",
    34: "MOSTLY_Q4_0_4_8",
    35: "MOSTLY_Q4_0_8_8",
    36: "MOSTLY_TQ1_0",
    37: "MOSTLY_TQ2_0",
    38: "MOSTLY_TL1, bitnet.cpp",
    39: "MOSTLY_TL2, bitnet.cpp",
    40: "MOSTLY_I2_S, bitnet.cpp: 2 bpw ternary",
}


def describe(gguf: GGUFFile) -> str:
    """A readable summary: architecture, dimensions, tensors by type, tokenizer, chat template."""
    md = gguf.metadata
    arch = gguf.architecture
    lines = [
        f"file: {gguf.source}",
        f"GGUF version {gguf.version}, {len(md)} metadata keys, "
        f"alignment {gguf.alignment}, tensor data at byte {gguf.data_offset}",
    ]
    lines.append(f"architecture: {arch if arch is not None else '(none)'}")
    if isinstance(md.get(Keys.NAME), str):
        lines.append(f"name: {md[Keys.NAME]}")
    if arch is not None:
        prefix = arch + "."
        dims = [(k[len(prefix) :], v) for k, v in md.items() if k.startswith(prefix)]
        for k, v in dims:
            lines.append(f"  {k}: {_short(v)}")
    if Keys.FILE_TYPE in md:
        ftype = md[Keys.FILE_TYPE]
        name = FILE_TYPE_NAMES.get(ftype) if isinstance(ftype, int) else None
        lines.append(f"file_type: {ftype}" + (f" ({name})" if name else " (unknown to llama.cpp and bitnet.cpp)"))

    total = sum(t.n_bytes for t in gguf.tensors.values())
    lines.append(f"tensors: {len(gguf.tensors)} ({_fmt_bytes(total)})")
    by_type: dict[str, list[int]] = {}
    for t in gguf.tensors.values():
        entry = by_type.setdefault(t.ggml_type.name, [0, 0, 0])
        entry[0] += 1
        entry[1] += t.n_bytes
        entry[2] += t.n_elements
    for name, (count, nbytes, n_el) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  {name:6s} {count:5d} tensors  {n_el:>14,d} values  {_fmt_bytes(nbytes)}")
    if TOKEN_EMBD in gguf.tensors:
        t = gguf.tensors[TOKEN_EMBD]
        lines.append(f"  {TOKEN_EMBD} {t.ggml_type.name} {list(t.shape)}")
    if gguf.tensors:
        lines.append(f"  LM head: {OUTPUT if OUTPUT in gguf.tensors else 'tied to token_embd'}")

    tok_model = md.get(Keys.TOKENIZER_MODEL)
    tokens = md.get(Keys.TOKENS)
    if tok_model is not None or tokens is not None:
        parts = [f"tokenizer: {tok_model}"]
        if tokens is not None:
            parts.append(f"vocab {_count(tokens)}")
        merges = md.get(Keys.MERGES)
        if merges is not None:
            parts.append(f"merges {_count(merges)}")
        for label, key in (("bos", Keys.BOS_ID), ("eos", Keys.EOS_ID), ("eot", Keys.EOT_ID), ("pad", Keys.PAD_ID)):
            tid = md.get(key)
            if isinstance(tid, int):
                text = tokens[tid] if isinstance(tokens, list) and 0 <= tid < len(tokens) else "?"
                parts.append(f"{label} {tid} {text!r}")
        if Keys.TOKENIZER_PRE in md:
            parts.append(f"pre {md[Keys.TOKENIZER_PRE]!r}")
        lines.append(", ".join(parts))
    template = md.get(Keys.CHAT_TEMPLATE)
    if isinstance(template, str):
        head = template[:160].replace("\n", "\\n")
        lines.append(f"chat template ({len(template)} chars): {head}{'...' if len(template) > 160 else ''}")
    return "\n".join(lines)


def _count(v: object) -> str:
    """Element count of an array value; any other value (a wrongly typed key) as itself."""
    return str(len(v)) if isinstance(v, list | np.ndarray) else _short(v)


def _short(v: object) -> str:
    if isinstance(v, np.ndarray):
        return f"array[{len(v)}] of {v.dtype}"
    if isinstance(v, list):
        return f"array[{len(v)}]"
    if isinstance(v, float):
        return f"{v:g}"
    return repr(v) if isinstance(v, str) else str(v)
