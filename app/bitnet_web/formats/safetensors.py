"""safetensors reader: zero-copy numpy views over one byte buffer (numpy and the standard library only).

The file is one `np.ndarray[uint8]`: a `np.memmap` in CPython (`open_safetensors`), the downloaded
file as a uint8 array in the browser (`SafetensorsFile.from_buffer`).

Format (https://github.com/huggingface/safetensors):
    u64 little-endian N | N bytes of UTF-8 JSON header | tensor data
The header maps tensor names to {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, offsets
relative to the start of the data (byte 8 + N), plus an optional "__metadata__" {str: str}. Data is
little-endian, C order. Like the reference implementation, this reader rejects headers over 100 MB,
offsets that overlap, leave holes or run past the end, and sizes that do not match shape x dtype.

A sharded checkpoint (`model.safetensors.index.json`: {"metadata": .., "weight_map": {tensor: file}})
is a `ShardedSafetensors` over several files; every tensor the index names must be in its shard.

Every problem raises `SafetensorsError` naming the file, the tensor and the byte offset.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from .quants import bf16_to_float32

MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit

# safetensors dtype -> little-endian numpy dtype of one element (BF16 as its raw uint16 bits).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
# Known to the format but without a numpy dtype here: sizes are checked, values are not readable.
OPAQUE_DTYPE_SIZES: dict[str, int] = {"F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}


class SafetensorsError(ValueError):
    """A .safetensors file or index that cannot be read; the message names file, tensor and offset."""

    failure_kind = "bad_model"  # how the browser UI classifies it (web/shared/failures.py)


class TensorEntry(NamedTuple):
    name: str
    dtype: str  # safetensors dtype string: 'BF16', 'U8', ...
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int  # absolute, exclusive

    @property
    def n_bytes(self) -> int:
        return self.end - self.begin


def _itemsize(dtype: str) -> int | None:
    if dtype in DTYPES:
        return DTYPES[dtype].itemsize
    return OPAQUE_DTYPE_SIZES.get(dtype)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise SafetensorsError(f"duplicate key {key!r}")
        out[key] = value
    return out


class SafetensorsFile:
    """A parsed .safetensors file: `tensors` (file order of the header), `metadata`, and views of the data."""

    def __init__(self, data: np.ndarray, source: str = "<buffer>"):
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
            raise TypeError(f"{source}: expected a 1-D uint8 array")
        self.data = data
        self.source = source
        self.metadata: dict[str, str] = {}
        self.tensors: dict[str, TensorEntry] = {}
        self.header_size = 0  # 8 + N: where the tensor data starts
        self._parse()

    @classmethod
    def from_buffer(
        cls, data: np.ndarray | bytes | bytearray | memoryview, source: str = "<buffer>"
    ) -> SafetensorsFile:
        """Parse a file held in memory (a uint8 array is used as is, no copy)."""
        if not isinstance(data, np.ndarray):
            data = np.frombuffer(data, dtype=np.uint8)
        return cls(data, source)

    # -- parsing ------------------------------------------------------------------------------

    def _fail(self, message: str) -> SafetensorsError:
        return SafetensorsError(f"{self.source}: {message}")

    def _parse(self) -> None:
        size = len(self.data)
        if size < 8:
            raise self._fail(f"file has {size} bytes, too short for the 8-byte header length at byte offset 0")
        (n,) = struct.unpack("<Q", self.data[:8].tobytes())
        if n > MAX_HEADER_BYTES:
            raise self._fail(
                f"header length {n} (at byte offset 0) is absurd: over the {MAX_HEADER_BYTES} "
                "byte limit (not a safetensors file, or a corrupt one)"
            )
        if 8 + n > size:
            raise self._fail(
                f"header length {n} (at byte offset 0) runs past the end of the file "
                f"({size} bytes): truncated or not a safetensors file"
            )
        raw = self.data[8 : 8 + n].tobytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._fail(f"header is not valid UTF-8 at byte offset {8 + e.start} ({e.reason})") from None
        try:
            header = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            where = 8 + len(text[: e.pos].encode("utf-8"))
            raise self._fail(f"header is not JSON at byte offset {where} ({e.msg})") from None
        except SafetensorsError as e:
            raise self._fail(f"header has a {e}") from None
        if not isinstance(header, dict):
            raise self._fail(f"header (byte offset 8) is a JSON {type(header).__name__}, expected an object")
        self.header_size = 8 + n

        metadata = header.pop("__metadata__", None)
        if metadata is not None:
            if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
                raise self._fail("header __metadata__ must be an object of strings")
            self.metadata = metadata

        entries = [self._entry(name, spec) for name, spec in header.items()]
        self.tensors = {e.name: e for e in entries}
        self._check_extents(entries)

    def _entry(self, name: str, spec: object) -> TensorEntry:
        if not isinstance(spec, dict):
            raise self._fail(f"tensor {name!r}: header entry is not an object")
        dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
        itemsize = _itemsize(dtype) if isinstance(dtype, str) else None
        if itemsize is None:
            known = ", ".join([*DTYPES, *OPAQUE_DTYPE_SIZES])
            raise self._fail(f"tensor {name!r} has unknown dtype {dtype!r} (known: {known})")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise self._fail(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise self._fail(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        n_elements = 1
        for d in shape:
            n_elements *= d
        expected = n_elements * itemsize
        if end - begin != expected:
            raise self._fail(
                f"tensor {name!r}: data_offsets {begin}..{end} hold {end - begin} bytes, but "
                f"shape {shape} of {dtype} needs {expected} (data starts at byte offset "
                f"{self.header_size})"
            )
        return TensorEntry(name, dtype, tuple(shape), self.header_size + begin, self.header_size + end)

    def _check_extents(self, entries: list[TensorEntry]) -> None:
        """Tensors tile the data section exactly: no overlap, no hole, nothing past the end."""
        size = len(self.data)
        pos = self.header_size
        previous = None
        for e in sorted(entries, key=lambda e: (e.begin, e.end)):
            if e.begin < pos:
                raise self._fail(
                    f"tensor {e.name!r} (bytes {e.begin}..{e.end}) overlaps tensor "
                    f"{previous.name!r} (bytes {previous.begin}..{previous.end})"
                )
            if e.begin > pos:
                raise self._fail(
                    f"bytes {pos}..{e.begin} before tensor {e.name!r} belong to no tensor (corrupt offsets)"
                )
            if e.end > size:
                raise self._fail(
                    f"tensor {e.name!r} data (bytes {e.begin}..{e.end}) runs past the end of "
                    f"the file ({size} bytes): truncated file or corrupt offsets"
                )
            pos, previous = e.end, e
        if pos != size:
            raise self._fail(
                f"bytes {pos}..{size} at the end of the file belong to no tensor "
                "(corrupt offsets or a file with trailing data)"
            )

    # -- access -------------------------------------------------------------------------------

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise SafetensorsError(f"{self.source}: no tensor named {name!r}") from None

    def dtype(self, name: str) -> str:
        return self.entry(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def raw_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes as a uint8 view of the buffer (no copy)."""
        e = self.entry(name)
        return self.data[e.begin : e.end]

    def array(self, name: str) -> np.ndarray:
        """A view in the tensor's shape and dtype; BF16 comes back as its raw uint16 bits."""
        e = self.entry(name)
        if e.dtype not in DTYPES:
            raise SafetensorsError(
                f"{self.source}: tensor {name!r} has dtype {e.dtype}, which this reader can size but not interpret"
            )
        return self.raw_bytes(name).view(DTYPES[e.dtype]).reshape(e.shape)

    def float32(self, name: str) -> np.ndarray:
        """The values as float32 (a new array); bf16 is widened exactly (its bits become the high half)."""
        return self._float32(name, self.array(name))

    def float32_rows(self, name: str, rows: slice) -> np.ndarray:
        """Rows `rows` of the tensor as float32 (a new array), so a big embedding widens in parts."""
        return self._float32(name, self.array(name)[rows])

    def _float32(self, name: str, arr: np.ndarray) -> np.ndarray:
        return bf16_to_float32(arr) if self.dtype(name) == "BF16" else arr.astype(np.float32)

    def __repr__(self) -> str:
        return f"SafetensorsFile({self.source!r}, {len(self.tensors)} tensors)"


def open_safetensors(path: str) -> SafetensorsFile:
    """Memory-map and parse a .safetensors file (tensor data stays on disk until touched)."""
    import os

    if os.path.getsize(path) == 0:
        raise SafetensorsError(f"{path}: file is empty (expected the 8-byte header length at byte offset 0)")
    return SafetensorsFile(np.memmap(path, dtype=np.uint8, mode="r"), str(path))


# ---------------------------------------------------------------------------------------------
# Sharded checkpoints
# ---------------------------------------------------------------------------------------------


def parse_index(index: Mapping | str | bytes, source: str = "model.safetensors.index.json") -> dict[str, str]:
    """The weight_map {tensor: shard file name} of an index (its text or its parsed JSON), checked."""
    if isinstance(index, str | bytes):
        try:
            index = json.loads(index)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{source}: not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SafetensorsError(f"{source}: no 'weight_map' object of tensor name -> file name")
    for tensor, shard in weight_map.items():
        if "/" in shard or "\\" in shard or shard in ("", ".", ".."):
            raise SafetensorsError(
                f"{source}: tensor {tensor!r} names shard {shard!r}, not a file name in the same folder"
            )
    return dict(weight_map)


class ShardedSafetensors:
    """Several safetensors files seen as one: tensor name -> the file that holds it.

    With an index (`weight_map`), every tensor it names must be in the shard it names, and a tensor
    in a shard must be where the index says. Without one, the files must not share tensor names.
    """

    def __init__(
        self,
        files: Mapping[str, SafetensorsFile],
        weight_map: Mapping[str, str] | None = None,
        index_source: str = "model.safetensors.index.json",
    ):
        self.files = dict(files)
        self.where: dict[str, SafetensorsFile] = {}
        if weight_map is not None:
            for tensor, shard in weight_map.items():
                st = self.files.get(shard)
                if st is None:
                    raise SafetensorsError(
                        f"{index_source}: tensor {tensor!r} is in shard {shard!r}, which "
                        f"is missing (have: {', '.join(sorted(self.files)) or 'none'})"
                    )
                if tensor not in st:
                    raise SafetensorsError(
                        f"{st.source}: tensor {tensor!r} is missing from this shard, where {index_source} says it is"
                    )
                self.where[tensor] = st
            for shard, st in self.files.items():
                stray = [t for t in st if weight_map.get(t) != shard]
                if stray:
                    raise SafetensorsError(
                        f"{st.source}: tensor {stray[0]!r} is not listed for this shard "
                        f"in {index_source} (it names {weight_map.get(stray[0])!r})"
                    )
        else:
            for st in self.files.values():
                for tensor in st:
                    if tensor in self.where:
                        raise SafetensorsError(
                            f"tensor {tensor!r} is in both {self.where[tensor].source} and {st.source}"
                        )
                    self.where[tensor] = st

    def __contains__(self, name: object) -> bool:
        return name in self.where

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def file(self, name: str) -> SafetensorsFile:
        try:
            return self.where[name]
        except KeyError:
            raise SafetensorsError(f"checkpoint has no tensor {name!r}") from None
