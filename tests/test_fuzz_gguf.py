"""Fuzzing the GGUF reader: mutated small files must parse to a consistent result or raise GGUFError.

Seeds are valid files built with our writer (a tiny random BitNet model, a vocabulary-only file, a
file with every metadata value type incl. nested arrays and every tensor type, version 2, alignment
64). `walk_layout` is an independent walker (plain `struct`, no code from gguf.py) that records where
every field lies, so mutations can aim at region boundaries and at specific fields.

The property (`check_input`): `GGUFFile.from_buffer` either raises a GGUFError, or returns a file whose
tensors lie inside the buffer, aligned, without overlaps, with sizes from an independent size table;
then everything downstream that reads metadata (config_from_gguf, describe, validate_tensors,
tensor(), Tokenizer.from_gguf, ChatTemplate.from_gguf) either succeeds or raises its own typed error.
Never any other exception, no more than `MEMORY_LIMIT` of Python/numpy allocations (tracemalloc) and
no input taking more than `HANG_LIMIT_S` of CPU time (a hang detector: each input takes ~10 ms with
tracemalloc on; CPU time, not wall time, so a loaded machine does not make it flaky).

Deterministic (derandomize=True, no example database). tools/fuzz_long.py runs the same strategies
with random seeds for longer.
"""

from __future__ import annotations

import math
import struct
import tempfile
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bitnet_web.convert.synthetic import random_bitnet_writer, synthetic_vocab_metadata
from bitnet_web.formats.ggml import (
    GGMLType,
    GGUFError,
    GGUFFormatError,
    GGUFLengthError,
    GGUFTruncatedError,
    GGUFValueType,
)
from bitnet_web.formats.gguf_reader import GGUFFile, describe, parse_header
from bitnet_web.formats.gguf_writer import GGUFWriter, Typed
from bitnet_web.model.config import ModelConfig, ModelConfigError, config_from_gguf
from bitnet_web.text.chat import ChatTemplate, ChatTemplateError
from bitnet_web.text.tokenizer import Tokenizer, TokenizerError

MEMORY_LIMIT = 16 << 20  # tracemalloc peak per input; seeds are <= ~110 KB
HANG_LIMIT_S = 1.0  # CPU seconds per input; each takes ~10 ms, a hostile count loop took minutes

# Examples per fuzz test in CI: a few thousand cases in total, deterministic.
FUZZ_SETTINGS = settings(
    max_examples=250,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ---------------------------------------------------------------------------------------------
# Seed files
# ---------------------------------------------------------------------------------------------

ALL_VALUE_TYPES = {
    "t.u8": Typed(GGUFValueType.UINT8, 200),
    "t.i8": Typed(GGUFValueType.INT8, -5),
    "t.u16": Typed(GGUFValueType.UINT16, 60000),
    "t.i16": Typed(GGUFValueType.INT16, -30000),
    "t.u32": Typed(GGUFValueType.UINT32, 4_000_000_000),
    "t.i32": Typed(GGUFValueType.INT32, -7),
    "t.f32": Typed(GGUFValueType.FLOAT32, 0.5),
    "t.bool": True,
    "t.str": "héllo ✓ 世界 <b>",
    "t.u64": Typed(GGUFValueType.UINT64, 2**63 + 5),
    "t.i64": Typed(GGUFValueType.INT64, -(2**62)),
    "t.f64": Typed(GGUFValueType.FLOAT64, float("nan")),
    "t.arr_u8": Typed(GGUFValueType.UINT8, [1, 2, 255], True),
    "t.arr_i16": Typed(GGUFValueType.INT16, [-1, 2], True),
    "t.arr_u64": Typed(GGUFValueType.UINT64, [2**64 - 1, 0], True),
    "t.arr_f64": Typed(GGUFValueType.FLOAT64, [1e300, -0.0], True),
    "t.arr_i32": np.arange(-3, 40, dtype=np.int32),
    "t.arr_f32": np.linspace(0, 1, 7, dtype=np.float32),
    "t.arr_bool": np.array([True, False, True]),
    "t.arr_str": ["a", "", "ĠHello", "\u00ff\u4e16"],
    "t.nested": [[1, 2, 3], [4], []],
    "t.nested_str": [["x", "y"], ["z"]],
    "t.nested3": [[[1], [2, 3]], [[4]]],
    "t.empty_str_arr": Typed(GGUFValueType.STRING, [], True),
    "t.empty_u8_arr": Typed(GGUFValueType.UINT8, [], True),
}


def _all_types_writer(path: str) -> GGUFWriter:
    rng = np.random.default_rng(1)
    w = GGUFWriter(path, alignment=64, version=2)
    w.add("general.architecture", "test")
    w.add_dict(ALL_VALUE_TYPES)
    w.add_tensor("f32", (3, 4), GGMLType.F32, rng.standard_normal(12))
    w.add_tensor("empty", (0, 4), GGMLType.F32, np.zeros(0, np.float32))
    w.add_tensor("f16", (2, 8), GGMLType.F16, rng.standard_normal(16))
    w.add_tensor("bf16", (8,), GGMLType.BF16, rng.standard_normal(8))
    w.add_tensor("q8", (64,), GGMLType.Q8_0, rng.standard_normal(64))
    w.add_tensor("tq1", (256,), GGMLType.TQ1_0, rng.integers(-1, 2, 256).astype(np.float32) * 0.25)
    w.add_tensor("tq2", (256,), GGMLType.TQ2_0, rng.integers(-1, 2, 256).astype(np.float32) * 0.25)
    w.add_tensor("i2s", (2, 128), GGMLType.I2_S, (rng.integers(-1, 2, (2, 128)).astype(np.int8), 0.5))
    return w


def _vocab_writer(path: str) -> GGUFWriter:
    w = GGUFWriter(path)
    w.add("general.name", "vocab only")
    md = synthetic_vocab_metadata(300)
    md["tokenizer.ggml.merges"] = ["Ġ w", "w 2", "Ġw 2"]
    w.add_dict(md)
    return w


def _model_writer(path: str) -> GGUFWriter:
    return random_bitnet_writer(
        path, dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=128, vocab_size=260, context_length=64, seed=3
    )


SEED_BUILDERS = {"model": _model_writer, "vocab": _vocab_writer, "all_types": _all_types_writer}


@dataclass(frozen=True)
class Field:
    start: int
    size: int
    kind: str  # magic version count str_len str vtype scalar etype arr_len elems n_dims dim ggml_type...
    label: str

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class Layout:
    fields: tuple[Field, ...]
    header_size: int
    data_offset: int
    alignment: int
    tensor_ends: tuple[int, ...]  # absolute end of each tensor's data

    def of_kind(self, *kinds: str) -> list[Field]:
        return [f for f in self.fields if f.kind in kinds]

    def boundaries(self) -> list[int]:
        return sorted({f.start for f in self.fields} | {f.end for f in self.fields})


class Case:
    """One fuzz input; its repr (what hypothesis prints for a failing example) is the label only."""

    __slots__ = ("data", "label")

    def __init__(self, data: bytes, label: str):
        self.data = data
        self.label = label

    def __repr__(self) -> str:
        return f"Case({len(self.data)} bytes: {self.label})"


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    layout: Layout
    writer: GGUFWriter


_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# Independent size table (ggml's type traits): values per block, bytes per block.
_TYPE_SIZES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 34: (256, 54), 35: (256, 66), 36: (4, 1)}


def expected_nbytes(type_id: int, n_elements: int) -> int:
    block, size = _TYPE_SIZES[type_id]
    return n_elements // block * size + (32 if type_id == 36 else 0)


def walk_layout(data: bytes) -> Layout:
    """Where every field of a VALID file lies (an independent walker; array elements beyond the first
    two and the last are skipped, not recorded)."""
    fields: list[Field] = []
    pos = 0

    def take(kind: str, size: int, label: str) -> int:
        nonlocal pos
        fields.append(Field(pos, size, kind, label))
        pos += size
        return pos - size

    def u32(kind: str, label: str) -> int:
        return struct.unpack_from("<I", data, take(kind, 4, label))[0]

    def u64(kind: str, label: str) -> int:
        return struct.unpack_from("<Q", data, take(kind, 8, label))[0]

    def string(label: str) -> bytes:
        n = u64("str_len", f"length of {label}")
        return data[take("str", n, label) : pos]

    def value(vtype: int, label: str) -> object:
        if vtype in _SCALAR_SIZES:
            at = take("scalar", _SCALAR_SIZES[vtype], label)
            return struct.unpack_from("<I", data, at)[0] if vtype == 4 else None
        if vtype == 8:
            return string(label)
        assert vtype == 9
        etype = u32("etype", f"element type of {label}")
        count = u64("arr_len", f"length of {label}")
        if etype in _SCALAR_SIZES:
            take("elems", count * _SCALAR_SIZES[etype], f"elements of {label}")
            return None
        for j in range(count):
            mark = len(fields)
            value(etype, f"{label}[{j}]")
            if 2 <= j < count - 1:
                del fields[mark:]
        return None

    take("magic", 4, "magic")
    u32("version", "version")
    n_tensors = u64("count", "tensor count")
    n_kv = u64("count", "kv count")
    alignment = 32
    for i in range(n_kv):
        key = string(f"key #{i}")
        vtype = u32("vtype", f"value type of {key!r}")
        v = value(vtype, repr(key))
        if key == b"general.alignment":
            alignment = v
    tensors = []
    for i in range(n_tensors):
        name = string(f"tensor #{i} name")
        n_dims = u32("n_dims", f"n_dims of {name!r}")
        dims = [u64("dim", f"dim {d} of {name!r}") for d in range(n_dims)]
        ggml_type = u32("ggml_type", f"type of {name!r}")
        rel = u64("offset", f"offset of {name!r}")
        tensors.append((name, rel, expected_nbytes(ggml_type, math.prod(dims))))
    header_size = pos
    data_offset = -(-header_size // alignment) * alignment
    if data_offset > header_size:
        take("padding", data_offset - header_size, "alignment padding")
    ends = []
    for name, rel, nbytes in tensors:
        pos = data_offset + rel
        take("tensor_data", nbytes, f"data of {name!r}")
        ends.append(pos)
    return Layout(tuple(fields), header_size, data_offset, alignment, tuple(ends))


@lru_cache(maxsize=1)
def seeds() -> dict[str, Seed]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, build in SEED_BUILDERS.items():
            path = str(Path(tmp) / f"{name}.gguf")
            writer = build(path)
            writer.write()
            data = Path(path).read_bytes()
            out[name] = Seed(name, data, walk_layout(data), writer)
    return out


# ---------------------------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------------------------

_METADATA_TYPES = (int, float, bool, str, list, np.ndarray)


def check_parsed(g: GGUFFile, data: bytes) -> None:
    """A parsed file is consistent and everything that reads it fails only with typed errors."""
    n = len(data)
    assert g.version in (2, 3)
    assert g.alignment > 0 and g.alignment & (g.alignment - 1) == 0
    assert g.header_size <= g.data_offset and g.data_offset % g.alignment == 0
    assert g.data_offset - g.header_size < g.alignment
    assert all(isinstance(k, str) for k in g.metadata)
    assert all(isinstance(v, _METADATA_TYPES) for v in g.metadata.values())
    spans = []
    for name, t in g.tensors.items():
        assert t.name == name and 1 <= len(t.shape) <= 4 and all(d >= 0 for d in t.shape)
        assert t.n_elements == math.prod(t.shape)
        assert t.n_bytes == expected_nbytes(int(t.ggml_type), t.n_elements)
        assert t.offset >= g.data_offset and (t.offset - g.data_offset) % g.alignment == 0
        assert t.offset + t.n_bytes <= n, f"tensor {name!r} ends at {t.offset + t.n_bytes} > {n}"
        spans.append((t.offset, t.offset + t.n_bytes, name))
        raw = g.tensor_bytes(name)
        assert len(raw) == t.n_bytes and (t.n_bytes == 0 or np.shares_memory(raw, g.data))
        try:
            values = g.tensor(name)
        except GGUFError:
            pass
        else:
            assert values.shape == t.shape
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        assert end <= start, f"tensors {a!r} and {b!r} overlap"

    assert isinstance(describe(g), str)
    try:
        g.validate_tensors()
    except GGUFError as e:
        DOWNSTREAM[f"validate_tensors: {type(e).__name__}"] += 1
    try:
        assert isinstance(config_from_gguf(g), ModelConfig)
        DOWNSTREAM["config: ok"] += 1
    except ModelConfigError:
        DOWNSTREAM["config: ModelConfigError"] += 1
    try:
        assert isinstance(Tokenizer.from_gguf(g.metadata), Tokenizer)
        DOWNSTREAM["tokenizer: ok"] += 1
    except TokenizerError:
        DOWNSTREAM["tokenizer: TokenizerError"] += 1
    try:
        kind = ChatTemplate.from_gguf(g.metadata).kind
        assert kind in ("bitnet", "llama3", "chatml", "completion")
        DOWNSTREAM[f"chat template: {kind}"] += 1
    except ChatTemplateError:
        DOWNSTREAM["chat template: ChatTemplateError"] += 1


DOWNSTREAM: Counter = Counter()  # what the readers of parsed files made of them (for tools/fuzz_long.py)


def check_input(data: bytes) -> str:
    """Run the property on one input; returns the outcome ('parsed' or the error class name)."""
    buf = np.frombuffer(data, dtype=np.uint8)
    nested = tracemalloc.is_tracing()
    if nested:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
        base = 0
    start = time.process_time()  # CPU time of this process: other processes' load does not count
    try:
        try:
            g = GGUFFile.from_buffer(buf)
        except GGUFError as e:
            assert str(e), "a GGUFError without a message"
            outcome = type(e).__name__
        else:
            check_parsed(g, data)
            outcome = "parsed"
        elapsed = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if not nested:
            tracemalloc.stop()
    WORST["seconds"] = max(WORST["seconds"], elapsed)
    WORST["peak_bytes"] = max(WORST["peak_bytes"], peak)
    assert elapsed < HANG_LIMIT_S, f"input of {len(data)} bytes took {elapsed:.2f} s of CPU time"
    assert peak < MEMORY_LIMIT, f"input of {len(data)} bytes allocated {peak / 2**20:.1f} MiB"
    return outcome


WORST = {"seconds": 0.0, "peak_bytes": 0}  # over all inputs checked so far (tools/fuzz_long.py prints it)


def canonical(v: object) -> object:
    """Metadata values in a form == can compare (numpy arrays by bytes, floats by bits: NaN == NaN)."""
    if isinstance(v, np.ndarray):
        return ("nd", v.dtype.str, v.tobytes())
    if isinstance(v, list):
        return tuple(canonical(x) for x in v)
    if isinstance(v, float):
        return ("f", struct.pack("<d", v))
    return (type(v).__name__, v)


def same_file(a: GGUFFile, b: GGUFFile) -> bool:
    return (
        a.version == b.version
        and a.header_size == b.header_size
        and a.data_offset == b.data_offset
        and a.tensors == b.tensors
        and list(a.metadata) == list(b.metadata)
        and all(canonical(a.metadata[k]) == canonical(b.metadata[k]) for k in a.metadata)
    )


def full_outcome(data: bytes) -> GGUFFile | GGUFError:
    try:
        return GGUFFile.from_buffer(data)
    except GGUFError as e:
        return e


# ---------------------------------------------------------------------------------------------
# Mutation strategies: each draws (bytes, label)
# ---------------------------------------------------------------------------------------------

seed_names = st.sampled_from(sorted(SEED_BUILDERS))

U64_SPECIAL = [0, 1, 2, 7, 8, 12, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
U32_SPECIAL = [0, 1, 2, 3, 4, 8, 9, 12, 13, 30, 34, 35, 36, 37, 2**31, 2**32 - 1]
LENGTH_KINDS = ("count", "str_len", "arr_len")


def put(data: bytes, at: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, at, value)
    return bytes(b)


@st.composite
def truncations(draw) -> Case:
    seed = seeds()[draw(seed_names)]
    cut = draw(st.integers(0, len(seed.data)))
    return Case(seed.data[:cut], f"{seed.name} cut at {cut}")


@st.composite
def header_byte_flips(draw) -> Case:
    seed = seeds()[draw(seed_names)]
    data = bytearray(seed.data)
    positions = draw(st.lists(st.integers(0, seed.layout.data_offset - 1), min_size=1, max_size=8))
    for p in positions:
        if draw(st.booleans()):
            data[p] ^= 1 << draw(st.integers(0, 7))
        else:
            data[p] = draw(st.integers(0, 255))
    return Case(bytes(data), f"{seed.name} header bytes changed at {positions}")


@st.composite
def field_overwrites(draw) -> Case:
    """One integer field (counts, lengths, value/element types, n_dims, dims, tensor types) rewritten."""
    seed = seeds()[draw(seed_names)]
    fields = seed.layout.of_kind(
        "version", "count", "str_len", "arr_len", "vtype", "etype", "n_dims", "dim", "ggml_type"
    )
    f = draw(st.sampled_from(fields))
    if f.size == 8:
        old = struct.unpack_from("<Q", seed.data, f.start)[0]
        new = draw(
            st.one_of(
                st.sampled_from(U64_SPECIAL + [len(seed.data), len(seed.data) - f.end, len(seed.data) - f.end + 1]),
                st.integers(0, 2**64 - 1),
                st.integers(-3, 3).map(lambda d, o=old: max(0, o + d)),
            )
        )
        return Case(put(seed.data, f.start, "<Q", new), f"{seed.name} {f.label}: {old} -> {new}")
    old = struct.unpack_from("<I", seed.data, f.start)[0]
    new = draw(st.one_of(st.sampled_from(U32_SPECIAL), st.integers(0, 2**32 - 1)))
    return Case(put(seed.data, f.start, "<I", new), f"{seed.name} {f.label}: {old} -> {new}")


@st.composite
def lying_lengths(draw) -> tuple[Case, Field]:
    """A count or length field claiming more than the whole file."""
    seed = seeds()[draw(seed_names)]
    f = draw(st.sampled_from(seed.layout.of_kind(*LENGTH_KINDS)))
    new = draw(
        st.one_of(
            st.sampled_from([len(seed.data) + 1, 2**32, 2**40, 2**62, 2**63, 2**64 - 1]),
            st.integers(len(seed.data) + 1, 2**64 - 1),
        )
    )
    return Case(put(seed.data, f.start, "<Q", new), f"{seed.name} {f.label} = {new}"), f


@st.composite
def tensor_offset_changes(draw) -> Case:
    """Offsets that overlap another tensor, are misaligned, point past the end, or wrap around."""
    seed = seeds()[draw(st.sampled_from(["model", "all_types"]))]
    offsets = seed.layout.of_kind("offset")
    f = draw(st.sampled_from(offsets))
    rels = [struct.unpack_from("<Q", seed.data, o.start)[0] for o in offsets]
    align = seed.layout.alignment
    old = struct.unpack_from("<Q", seed.data, f.start)[0]
    other = draw(st.sampled_from(rels))
    past_end = -(-(len(seed.data) - seed.layout.data_offset) // align) * align
    new = draw(
        st.sampled_from(
            [
                other,
                other + align,
                max(other - align, 0),
                other + 1,
                old + 1,
                old + align // 2,
                past_end,
                past_end - align,
                2**64 - align,
                2**63,
                2**64 - 1,
                0,
            ]
        )
    )
    return Case(put(seed.data, f.start, "<Q", new), f"{seed.name} {f.label}: {old} -> {new}")


@st.composite
def splices(draw) -> Case:
    """Bytes inserted into or deleted from the header (every later field shifts)."""
    seed = seeds()[draw(seed_names)]
    at = draw(st.integers(0, seed.layout.header_size))
    if draw(st.booleans()):
        extra = draw(st.binary(min_size=1, max_size=16))
        return Case(seed.data[:at] + extra + seed.data[at:], f"{seed.name} {extra!r} inserted at {at}")
    n = draw(st.integers(1, 16))
    return Case(seed.data[:at] + seed.data[at + n :], f"{seed.name} {n} bytes deleted at {at}")


# Values of every GGUF type, for replacing a metadata value with a wrongly typed or absurd one.
_INT_RANGES = {
    GGUFValueType.UINT8: (0, 2**8 - 1),
    GGUFValueType.INT8: (-(2**7), 2**7 - 1),
    GGUFValueType.UINT16: (0, 2**16 - 1),
    GGUFValueType.INT16: (-(2**15), 2**15 - 1),
    GGUFValueType.UINT32: (0, 2**32 - 1),
    GGUFValueType.INT32: (-(2**31), 2**31 - 1),
    GGUFValueType.UINT64: (0, 2**64 - 1),
    GGUFValueType.INT64: (-(2**63), 2**63 - 1),
}


def typed_values() -> st.SearchStrategy[object]:
    ints = [st.integers(lo, hi).map(lambda v, t=t: Typed(t, v)) for t, (lo, hi) in _INT_RANGES.items()]
    int_arrays = [
        st.lists(st.integers(lo, hi), max_size=6).map(lambda v, t=t: Typed(t, v, True))
        for t, (lo, hi) in _INT_RANGES.items()
    ]
    return st.one_of(
        *ints,
        *int_arrays,
        st.floats(width=32).map(lambda v: Typed(GGUFValueType.FLOAT32, v)),
        st.floats().map(lambda v: Typed(GGUFValueType.FLOAT64, v)),
        st.booleans(),
        st.text(max_size=20),
        st.sampled_from(["gpt2", "llama", "bitnet-b1.58", "bitnet", "llama3", "bitnet-25"]),
        st.lists(st.text(max_size=8), max_size=6).map(lambda v: Typed(GGUFValueType.STRING, v, True)),
        st.lists(st.floats(width=32), max_size=6).map(lambda v: Typed(GGUFValueType.FLOAT32, v, True)),
        st.lists(st.booleans(), max_size=6).map(lambda v: Typed(GGUFValueType.BOOL, v, True)),
        st.lists(st.lists(st.integers(-100, 100), min_size=1, max_size=3), min_size=1, max_size=3),
        st.lists(st.lists(st.text(max_size=4), min_size=1, max_size=3), min_size=1, max_size=3),
    )


EXTRA_KEYS = [
    "general.alignment",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_space_prefix",
    "bitnet-b1.58.attention.key_length",
    "bitnet-b1.58.attention.value_length",
    "general.description",
]


def rebuild(seed: Seed, metadata: dict[str, object]) -> bytes:
    """The seed with different metadata: new header, the same tensor table and tensor data."""
    w = GGUFWriter("unused", alignment=seed.writer.alignment, version=seed.writer.version)
    w.metadata = metadata
    w.tensors = seed.writer.tensors
    head = w.header_bytes()
    align = seed.layout.alignment
    return head + b"\0" * (-len(head) % align) + seed.data[seed.layout.data_offset :]


@st.composite
def wrong_metadata_values(draw) -> Case:
    """A metadata value replaced by a value of another type or an absurd value (well-formed file)."""
    seed = seeds()[draw(seed_names)]
    md = dict(seed.writer.metadata)
    key = draw(st.sampled_from(sorted(md) + EXTRA_KEYS))
    value = draw(typed_values())
    md[key] = value
    return Case(rebuild(seed, md), f"{seed.name} {key} = {value!r}"[:300])


MUTATIONS = {
    "truncation": truncations(),
    "header_byte_flips": header_byte_flips(),
    "field_overwrite": field_overwrites(),
    "tensor_offsets": tensor_offset_changes(),
    "splice": splices(),
    "wrong_metadata_values": wrong_metadata_values(),
}
any_mutation = st.one_of(*MUTATIONS.values())
# Two or three mutations applied one after another (on the result of the previous).


@st.composite
def chained_mutations(draw) -> Case:
    case = draw(any_mutation)
    data, label = case.data, case.label
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(["flip", "cut", "u64"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            b = bytearray(data)
            b[at] ^= draw(st.integers(1, 255))
            data = bytes(b)
        elif kind == "cut":
            data = data[:at]
        elif at + 8 <= len(data):
            data = put(data, at, "<Q", draw(st.sampled_from(U64_SPECIAL)))
        label += f"; then {kind} at {at}"
    return Case(data, label)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------

OUTCOMES: Counter = Counter()  # per category, for the summary test and tools/fuzz_long.py


def run_case(category: str, data: bytes, label: str) -> str:
    try:
        outcome = check_input(data)
    except AssertionError as e:
        raise AssertionError(f"{category}: {label}: {e}") from e
    except Exception as e:
        raise AssertionError(f"{category}: {label}: raised {type(e).__name__}: {e}") from e
    OUTCOMES[(category, outcome)] += 1
    return outcome


@pytest.fixture(scope="module", autouse=True)
def warm_up():
    """Build the seeds and compile the tokenizer regex once, outside the per-input bounds."""
    for seed in seeds().values():
        check_parsed(GGUFFile.from_buffer(seed.data), seed.data)


@pytest.mark.parametrize("name", sorted(SEED_BUILDERS))
def test_seeds_are_valid_and_the_walker_agrees(name):
    seed = seeds()[name]
    g = GGUFFile.from_buffer(seed.data)
    check_parsed(g, seed.data)
    assert g.header_size == seed.layout.header_size and g.data_offset == seed.layout.data_offset
    assert sorted(t.offset + t.n_bytes for t in g.tensors.values()) == sorted(seed.layout.tensor_ends)
    assert len(seed.layout.fields) > 20


@pytest.mark.parametrize("name", sorted(SEED_BUILDERS))
@pytest.mark.slow
def test_truncation_at_every_region_boundary(name):
    """Cut at each field's start/end (and one byte either side): inside the header it is a truncated
    file naming a byte offset; after it, a file whose tensors run past the end, or a valid file when
    the cut only drops trailing padding. Incremental parsing of the same prefix must say 'need more'
    (None) inside the header and give the same header as the whole file after it."""
    seed = seeds()[name]
    lay = seed.layout
    full = GGUFFile.from_buffer(seed.data)
    cuts = sorted({c for b in lay.boundaries() for c in (b - 1, b, b + 1) if 0 <= c <= len(seed.data)})
    for cut in cuts:
        prefix = seed.data[:cut]
        outcome = run_case("truncation_at_boundaries", prefix, f"{name} cut at {cut}")
        if cut < lay.header_size:
            with pytest.raises(GGUFTruncatedError, match="byte offset"):
                GGUFFile.from_buffer(prefix)
        elif any(end > cut for end in lay.tensor_ends):
            assert outcome == "GGUFFormatError", (cut, outcome)
        else:
            assert outcome == "parsed", (cut, outcome)
        for total in (None, len(seed.data)):
            got = parse_header(prefix, total)
            if cut < lay.header_size:
                assert got is None, (cut, total)
            else:
                assert got is not None and same_file(got, full), (cut, total)
    assert len(cuts) > 60


def _fuzz(category: str):
    @FUZZ_SETTINGS
    @given(case=MUTATIONS[category])
    def test(case):
        run_case(category, case.data, case.label)

    return test


test_fuzz_random_truncation = _fuzz("truncation")
test_fuzz_header_byte_flips = pytest.mark.slow(_fuzz("header_byte_flips"))
test_fuzz_field_overwrites = pytest.mark.slow(_fuzz("field_overwrite"))
test_fuzz_tensor_offsets = pytest.mark.slow(_fuzz("tensor_offsets"))
test_fuzz_splices = _fuzz("splice")
test_fuzz_wrong_metadata_values = pytest.mark.slow(_fuzz("wrong_metadata_values"))


@FUZZ_SETTINGS
@given(case=chained_mutations())
@pytest.mark.slow
def test_fuzz_chained_mutations(case):
    run_case("chained", case.data, case.label)


@FUZZ_SETTINGS
@given(case=lying_lengths())
@pytest.mark.slow
def test_lying_length_is_a_length_error_at_that_field(case):
    """A count or length larger than the whole file is rejected as such, before any allocation, and
    the message names the field's byte offset."""
    (case, field) = case
    data, label = case.data, case.label
    assert run_case("lying_length", data, label) == "GGUFLengthError", label
    with pytest.raises(GGUFLengthError, match=f"byte offset {field.start}[^0-9]"):
        GGUFFile.from_buffer(data)


@FUZZ_SETTINGS
@given(case=st.one_of(any_mutation, chained_mutations()), data=st.data())
def test_incremental_parse_agrees_with_whole_file(case, data):
    """parse_header on a prefix, with the total size known, gives None or exactly the whole file's
    outcome (same result, or the same error class and message); with the size unknown, a result it
    gives is confirmed by the whole file unless tensor data turns out to run past the end. Also
    feeding growing chunks until a result, as the downloader does."""
    raw, label = case.data, case.label
    full = full_outcome(raw)
    cut = data.draw(st.integers(0, len(raw)), label="cut")
    prefix = raw[:cut]
    try:
        got = parse_header(prefix, len(raw))
    except GGUFError as e:
        assert isinstance(full, GGUFError), f"{label}: prefix raised {e!r}, whole file parsed"
        assert (type(e), str(e)) == (type(full), str(full)), label
    else:
        if got is not None:
            assert isinstance(full, GGUFFile) and same_file(got, full), label
    try:
        got = parse_header(prefix, None)
    except GGUFError:
        assert isinstance(full, GGUFError), f"{label}: prefix raised, whole file parsed"
    else:
        if got is not None:
            assert (isinstance(full, GGUFFile) and same_file(got, full)) or (
                isinstance(full, GGUFFormatError) and "past the end" in str(full)
            ), label
    # Streaming: chunks of a drawn size until parse_header gives an answer.
    step = data.draw(st.integers(256, 8192), label="chunk")
    total = data.draw(st.sampled_from([None, len(raw)]), label="total")
    have = 0
    while True:
        have = min(have + step, len(raw))
        try:
            got = parse_header(raw[:have], total)
        except GGUFError:
            assert isinstance(full, GGUFError), label
            break
        if got is not None:
            assert isinstance(full, GGUFFile) or total is None, label
            break
        if have == len(raw):
            # The whole file and still 'need more': only possible when the size is unknown and the
            # file is truncated (the whole-file parse then reports the truncation).
            assert total is None and isinstance(full, GGUFTruncatedError), label
            break


def test_hostile_counts_are_bounded():
    """Regressions: arrays nested thousands deep raised RecursionError; an empty tensor with a huge
    dim made tensor() raise numpy's ValueError; a block_count of 2^64 - 1 made config_from_gguf loop
    over every layer (minutes, gigabytes). All are now typed errors."""
    level = struct.pack("<IQ", GGUFValueType.ARRAY, 1)  # element type ARRAY, one element
    deep = level * 5000 + struct.pack("<IQ", 0, 0)
    raw = (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", 1)
        + b"a"
        + struct.pack("<I", GGUFValueType.ARRAY)
        + deep
    )
    assert run_case("regression", raw, "nested 5000 deep") == "GGUFFormatError"
    with pytest.raises(GGUFFormatError, match="nested more than"):
        GGUFFile.from_buffer(raw)

    # An empty tensor (a zero dim) whose other dim is 2^62: n_elements is 0 but numpy cannot even make
    # an empty array of that shape (tensor() raised ValueError). Found by tools/fuzz_long.py.
    seed = seeds()["all_types"]
    dim = next(f for f in seed.layout.of_kind("dim") if "b'empty'" in f.label)
    raw = put(seed.data, dim.start, "<Q", 2**62)
    assert run_case("regression", raw, "empty tensor with a 2^62 dim") == "GGUFFormatError"
    with pytest.raises(GGUFFormatError, match=r"tensor 'empty': dims \[4611686018427387904, 0\] .* absurd"):
        GGUFFile.from_buffer(raw)

    seed = seeds()["model"]
    md = dict(seed.writer.metadata)
    md["bitnet-b1.58.block_count"] = Typed(GGUFValueType.UINT64, 2**64 - 1)
    raw = rebuild(seed, md)
    assert run_case("regression", raw, "block_count 2^64-1") == "parsed"
    with pytest.raises(ModelConfigError, match=f"block_count is {2**64 - 1} but the file has only 13 "):
        config_from_gguf(GGUFFile.from_buffer(raw))
