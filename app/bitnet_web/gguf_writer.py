"""GGUF writer (version 3) that streams tensor data, plus random BitNet test models.

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

from .gguf import (
    GGUF_DEFAULT_ALIGNMENT,
    VALUE_DTYPES,
    GGMLType,
    GGUFValueType,
    Keys,
    tensor_nbytes,
)
from .quants import i2s_encode, random_i2s_bytes, tq1_0_encode, tq2_0_encode

TensorSource = (np.ndarray | bytes | tuple | Callable[[], object] | Iterator)


class Typed(NamedTuple):
    """A metadata value with an explicit GGUF type; for arrays, `vtype` is the element type."""
    vtype: GGUFValueType
    value: object
    is_array: bool = False


_NUMPY_TO_VALUE = {np.dtype(d).newbyteorder("<"): t for t, d in VALUE_DTYPES.items()
                   if t != GGUFValueType.BOOL}
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


def _encode_scalar(vtype: GGUFValueType, v: object) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _encode_string(str(v))
    return np.array([v], dtype=VALUE_DTYPES[vtype]).tobytes()


def _encode_array(etype: GGUFValueType | None, values: object) -> bytes:
    """u32 element type + u64 count + elements; etype None = infer."""
    if isinstance(values, np.ndarray):
        if etype is None:
            key = values.dtype.newbyteorder("<") if values.dtype != np.bool_ else np.dtype(np.bool_)
            if key not in _NUMPY_TO_VALUE:
                raise TypeError(f"no GGUF array type for numpy dtype {values.dtype}")
            etype = _NUMPY_TO_VALUE[key]
        if etype in VALUE_DTYPES:
            body = np.ascontiguousarray(values.reshape(-1), dtype=VALUE_DTYPES[etype]).tobytes()
            return struct.pack("<IQ", etype, values.size) + body
        values = values.tolist()
    values = list(values)
    if etype is None:
        if not values:
            etype = GGUFValueType.STRING     # an empty list: string array (e.g. empty merges)
        elif isinstance(values[0], list | tuple | np.ndarray):
            etype = GGUFValueType.ARRAY
        else:
            etype = _infer_scalar_type(values[0])
            if etype in (GGUFValueType.UINT32, GGUFValueType.INT32):
                etype = GGUFValueType.INT32 if min(values) >= -(1 << 31) and max(values) < 1 << 31 \
                    else GGUFValueType.INT64
    head = struct.pack("<IQ", etype, len(values))
    if etype == GGUFValueType.STRING:
        return head + b"".join(_encode_string(s) for s in values)
    if etype == GGUFValueType.ARRAY:
        # An empty inner list takes its element type from a non-empty sibling.
        sibling = next((v for v in values if len(v)), None)
        inner = None
        if sibling is not None and not isinstance(sibling, np.ndarray):
            inner = _infer_scalar_type(sibling[0]) if not isinstance(sibling[0], list | tuple) \
                else GGUFValueType.ARRAY
            if inner == GGUFValueType.UINT32:
                inner = GGUFValueType.INT32
        return head + b"".join(_encode_array(None if len(v) else inner, v) for v in values)
    return head + np.array(values, dtype=VALUE_DTYPES[etype]).tobytes()


def encode_value(value: object) -> bytes:
    """u32 value type + encoded value."""
    if isinstance(value, Typed):
        if value.is_array:
            return struct.pack("<I", GGUFValueType.ARRAY) + _encode_array(value.vtype, value.value)
        return struct.pack("<I", value.vtype) + _encode_scalar(value.vtype, value.value)
    if isinstance(value, np.ndarray | list | tuple):
        return struct.pack("<I", GGUFValueType.ARRAY) + _encode_array(None, value)
    vtype = _infer_scalar_type(value)
    return struct.pack("<I", vtype) + _encode_scalar(vtype, value)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def q8_0_encode(x: np.ndarray) -> np.ndarray:
    """float -> Q8_0 blocks (f16 d = absmax/127, 32 int8), like ggml's quantize_row_q8_0_ref."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1) / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = blocks * inv[:, None]
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(-1)


class _PendingTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]      # numpy order (outermost first)
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
            ne = tuple(reversed(t.shape))           # GGUF stores ggml order, innermost first
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
            written = 0
            for chunk in _payload_chunks(t):
                yield chunk
                written += len(chunk)
            if written != t.n_bytes:
                raise ValueError(f"tensor {t.name!r} ({t.ggml_type.name} {list(t.shape)}): data has "
                                 f"{written} bytes, expected {t.n_bytes}")
            yield b"\0" * (self._padded(written) - written)

    def write(self) -> int:
        """Write the file; returns its size in bytes."""
        with open(self.path, "wb") as f:
            for chunk in self._file_chunks():
                f.write(chunk)
            return f.tell()

    def to_buffer(self) -> np.ndarray:
        """The whole file as one uint8 array, filled tensor by tensor (for GGUFFile.from_buffer)."""
        out = np.zeros(self.file_size(), dtype=np.uint8)
        pos = 0
        for chunk in self._file_chunks():
            data = np.frombuffer(chunk, dtype=np.uint8)
            if pos + len(data) > len(out):
                raise ValueError(f"tensor data overruns the planned file size {len(out)}")
            out[pos:pos + len(data)] = data
            pos += len(data)
        return out


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
    if t.ggml_type == GGMLType.F32:
        return np.ascontiguousarray(arr, dtype="<f4").reshape(-1).view(np.uint8)
    if t.ggml_type == GGMLType.F16:
        return np.ascontiguousarray(arr, dtype="<f2").reshape(-1).view(np.uint8)
    if t.ggml_type == GGMLType.BF16:
        return float_to_bf16_bits(arr).reshape(-1).view(np.uint8)
    raise TypeError(f"tensor {t.name!r}: float chunks only for F32/F16/BF16, not {t.ggml_type.name}")


def _tensor_bytes(t: _PendingTensor, data: object) -> memoryview:
    if isinstance(data, bytes | bytearray | memoryview):
        return memoryview(data)
    if t.ggml_type == GGMLType.I2_S and isinstance(data, tuple):
        values, scale = data
        return memoryview(i2s_encode(np.asarray(values), float(scale)))
    arr = np.asarray(data)
    if arr.dtype == np.uint8 and arr.size == t.n_bytes:
        return memoryview(np.ascontiguousarray(arr).reshape(-1))
    if arr.size != t.n_elements:
        raise ValueError(f"tensor {t.name!r}: {arr.size} values for shape {list(t.shape)}")
    if t.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        return memoryview(_float_payload(t, arr))
    if t.ggml_type == GGMLType.Q8_0:
        return memoryview(q8_0_encode(arr))
    if t.ggml_type == GGMLType.TQ1_0:
        return memoryview(tq1_0_encode(arr))
    if t.ggml_type == GGMLType.TQ2_0:
        return memoryview(tq2_0_encode(arr))
    raise TypeError(f"tensor {t.name!r}: give I2_S data as raw bytes or (values, scale)")


# ---------------------------------------------------------------------------------------------
# Synthetic vocabulary and random BitNet models
# ---------------------------------------------------------------------------------------------

# The chat template of microsoft/bitnet-b1.58-2B-4T (tokenizer_config.json): "Role: content<|eot_id|>"
# per message, BOS before the first, "Assistant: " as the generation prompt.
BITNET_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = message['role'] | capitalize + ': '+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)

LLAMA3_BOS, LLAMA3_EOS, LLAMA3_EOT = 128000, 128001, 128009
TOKEN_TYPE_NORMAL, TOKEN_TYPE_CONTROL = 1, 3


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def synthetic_vocab_metadata(vocab_size: int, *, with_eot_key: bool = False) -> dict[str, object]:
    """A gpt2-style byte-level vocabulary with no merges (every byte is its own token).

    Tokens 0..255: the GPT-2 byte characters (token i is byte i). Then filler tokens "Ġw{i}"
    (decode to " w{i}", never produced by the empty merge list). Special tokens (token_type 3):
    with vocab_size >= 128256 at the Llama 3 ids (<|begin_of_text|> 128000, <|end_of_text|> 128001,
    <|eot_id|> 128009, reserved specials around them), otherwise the last three ids.
    The real 2B-4T file has no eot key; `with_eot_key` adds tokenizer.ggml.eot_token_id.
    """
    if vocab_size < 259:
        raise ValueError(f"vocab_size {vocab_size} too small: 256 byte tokens + 3 special tokens needed")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + [f"Ġw{i}" for i in range(256, vocab_size)]
    token_type = np.full(vocab_size, TOKEN_TYPE_NORMAL, dtype=np.int32)
    if vocab_size >= 128256:
        bos, eos, eot = LLAMA3_BOS, LLAMA3_EOS, LLAMA3_EOT
        for i in range(128000, vocab_size):
            tokens[i] = f"<|reserved_special_token_{i - 128000}|>"
            token_type[i] = TOKEN_TYPE_CONTROL
    else:
        bos, eos, eot = vocab_size - 3, vocab_size - 2, vocab_size - 1
    for tid, text in ((bos, "<|begin_of_text|>"), (eos, "<|end_of_text|>"), (eot, "<|eot_id|>")):
        tokens[tid] = text
        token_type[tid] = TOKEN_TYPE_CONTROL
    md: dict[str, object] = {
        Keys.TOKENIZER_MODEL: "gpt2",
        Keys.TOKENS: tokens,
        Keys.TOKEN_TYPE: token_type,
        Keys.SCORES: np.zeros(vocab_size, dtype=np.float32),
        Keys.MERGES: Typed(GGUFValueType.STRING, [], True),
        Keys.BOS_ID: bos,
        Keys.EOS_ID: eos,
        Keys.PAD_ID: eos,
        Keys.ADD_BOS: True,
        Keys.CHAT_TEMPLATE: BITNET_CHAT_TEMPLATE,
    }
    if with_eot_key:
        md[Keys.EOT_ID] = eot
    return md


def bitnet_model_metadata(arch: str, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                          ffn_dim: int, vocab_size: int, context_length: int, rope_theta: float,
                          norm_eps: float = 1e-5, head_dim: int | None = None,
                          name: str = "bitnet-web random") -> dict[str, object]:
    """The model keys of the 2B-4T file (types as bitnet.cpp's converter writes them)."""
    head_dim = head_dim or dim // n_heads

    def k(key: str) -> str:
        return Keys.arch(key, arch)
    return {
        Keys.ARCHITECTURE: arch,
        Keys.NAME: name,
        k(Keys.VOCAB_SIZE): vocab_size,
        k(Keys.CONTEXT_LENGTH): context_length,
        k(Keys.EMBEDDING_LENGTH): dim,
        k(Keys.BLOCK_COUNT): n_layers,
        k(Keys.FEED_FORWARD_LENGTH): ffn_dim,
        k(Keys.ROPE_DIMENSION_COUNT): head_dim,
        k(Keys.HEAD_COUNT): n_heads,
        k(Keys.HEAD_COUNT_KV): n_kv_heads,
        k(Keys.LAYERNORM_RMS_EPS): float(norm_eps),
        k(Keys.ROPE_FREQ_BASE): float(rope_theta),
        Keys.FILE_TYPE: 40,
        Keys.QUANTIZATION_VERSION: 2,
    }


def write_random_bitnet(path: str, **kwargs) -> int:
    """Write a random BitNet model as GGUF (arguments: see random_bitnet_writer); returns the size."""
    return random_bitnet_writer(path, **kwargs).write()


def random_bitnet_writer(path: str, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int,
                         ffn_dim: int, vocab_size: int, context_length: int = 4096, seed: int = 0,
                         arch: str = "bitnet-b1.58", embed_std: float = 1.0,
                         tokenizer_metadata: dict[str, object] | None = None,
                         rope_theta: float = 500000.0, untied: bool = False, norm_eps: float = 1e-5,
                         sub_norms: bool = True, head_dim: int | None = None) -> GGUFWriter:
    """A GGUFWriter set up with a random BitNet model (nothing generated until `write()`).

    Weights: uniform random ternary I2_S with per-tensor scale U(0.5, 1.5) / sqrt(2/3 * in_features)
    (so a unit-RMS input gives roughly unit-RMS outputs, keeping deep random models finite).
    Norms: F32 U(0.8, 1.2) (never exactly 1, so a skipped norm changes the output). Embedding
    (and output.weight if `untied`): F16 normal with std `embed_std`. Every tensor is generated
    from its own seeded RNG just before it is written, so memory stays small for any shape.
    """
    head_dim = head_dim or dim // n_heads
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    w = GGUFWriter(path)
    w.add_dict(bitnet_model_metadata(arch, dim=dim, n_layers=n_layers, n_heads=n_heads,
                                     n_kv_heads=n_kv_heads, ffn_dim=ffn_dim, vocab_size=vocab_size,
                                     context_length=context_length, rope_theta=rope_theta,
                                     norm_eps=norm_eps, head_dim=head_dim))
    w.add_dict(tokenizer_metadata if tokenizer_metadata is not None else synthetic_vocab_metadata(vocab_size))

    counter = iter(range(1 << 30))

    def rng() -> np.random.Generator:
        return np.random.default_rng([seed, next(counter)])

    def embedding(gen: np.random.Generator) -> Callable[[], Iterator[np.ndarray]]:
        def chunks() -> Iterator[np.ndarray]:
            rows = max(1, (1 << 22) // dim)          # ~4M values per chunk
            for start in range(0, vocab_size, rows):
                n = min(rows, vocab_size - start)
                yield (gen.standard_normal((n, dim), dtype=np.float32) * np.float32(embed_std)).astype("<f2")
        return chunks

    def ternary(gen: np.random.Generator, out_f: int, in_f: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            scale = gen.uniform(0.5, 1.5) / np.sqrt(2.0 / 3.0 * in_f)
            return random_i2s_bytes(gen, out_f * in_f, float(scale))
        return make

    def norm(gen: np.random.Generator, n: int) -> Callable[[], np.ndarray]:
        return lambda: gen.uniform(0.8, 1.2, size=n).astype(np.float32)

    w.add_tensor("token_embd.weight", (vocab_size, dim), GGMLType.F16, embedding(rng()))
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (dim,), GGMLType.F32, norm(rng(), dim))
        w.add_tensor(p + "attn_q.weight", (q_dim, dim), GGMLType.I2_S, ternary(rng(), q_dim, dim))
        w.add_tensor(p + "attn_k.weight", (kv_dim, dim), GGMLType.I2_S, ternary(rng(), kv_dim, dim))
        w.add_tensor(p + "attn_v.weight", (kv_dim, dim), GGMLType.I2_S, ternary(rng(), kv_dim, dim))
        w.add_tensor(p + "attn_output.weight", (dim, q_dim), GGMLType.I2_S, ternary(rng(), dim, q_dim))
        if sub_norms:
            w.add_tensor(p + "attn_sub_norm.weight", (q_dim,), GGMLType.F32, norm(rng(), q_dim))
        w.add_tensor(p + "ffn_norm.weight", (dim,), GGMLType.F32, norm(rng(), dim))
        w.add_tensor(p + "ffn_gate.weight", (ffn_dim, dim), GGMLType.I2_S, ternary(rng(), ffn_dim, dim))
        w.add_tensor(p + "ffn_up.weight", (ffn_dim, dim), GGMLType.I2_S, ternary(rng(), ffn_dim, dim))
        w.add_tensor(p + "ffn_down.weight", (dim, ffn_dim), GGMLType.I2_S, ternary(rng(), dim, ffn_dim))
        if sub_norms:
            w.add_tensor(p + "ffn_sub_norm.weight", (ffn_dim,), GGMLType.F32, norm(rng(), ffn_dim))
    w.add_tensor("output_norm.weight", (dim,), GGMLType.F32, norm(rng(), dim))
    if untied:
        w.add_tensor("output.weight", (vocab_size, dim), GGMLType.F16, embedding(rng()))
    return w
