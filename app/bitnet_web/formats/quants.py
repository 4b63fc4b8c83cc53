"""The codec table: how every tensor type's bytes become values and back (I2_S, TQ1_0, TQ2_0, Q8_0, F16, BF16, F32).

`CODECS[ggml_type]` (gguf-py's quants.py in one table) is what the GGUF reader, the writer and the
converters use; the per-type functions below are its entries. Sizes per type: ggml.GGML_TYPE_SIZES.

I2_S, x86 layout (the hosted 2B-4T file). The tensor, flattened row-major, is cut into blocks of
128 values stored in 32 bytes; byte b of a block holds values b, 32+b, 64+b, 96+b at bit shifts
6, 4, 2, 0. Codes: 0 = -1, 1 = 0, 2 = +1 (3 is never written). After the n/4 code bytes come one
float32 scale (weight = value * scale) and 28 zero bytes: a tensor occupies n/4 + 32 bytes.

I2_S, ARM layout (bitnet.cpp built for ARM NEON): blocks of 64 values in 16 bytes, byte b holding
values b, 16+b, 32+b, 48+b at shifts 6, 4, 2, 0. Same codes, same scale.

How the ARM layout is handled (decision). It cannot be detected from the bytes: both layouts hold
the same 128 values in every 32-byte group, only in a different order inside the group, and since
rows are multiples of 128 the difference is one fixed permutation of columns inside every
128-column group, identical for every row of every matrix. Reading ARM bytes as x86 yields exactly
W[:, P]: per-row and per-column statistics (code histogram, sparsity, row sums) are unchanged, so
no statistical check on a single tensor can tell the layouts apart (tests show this). Hence:
  * the layout is an explicit option (`layout='x86'` default, `'arm'`), with `i2s_decode_arm` and
    `i2s_arm_to_x86` (a byte-level repack) for users who know their file came from an ARM build;
  * `i2s_check_layout` rejects what can be detected: code 3 (never written by either layout, so
    its presence means a foreign or corrupt encoding), a non-finite or negative scale, sizes that
    are not whole 128-value blocks, and non-zero padding bytes.

TQ2_0 (block of 256 values, 66 bytes): qs[64] then f16 d. For each 32-byte half j and shift
l in (0, 2, 4, 6): value j*128 + (l/2)*32 + m = ((qs[j*32 + m] >> l) & 3) - 1, times d.
TQ1_0 (block of 256, 54 bytes): qs[48], qh[4], f16 d. Bytes hold base-3 digits scaled to 0..255
(q = ceil(sum * 256 / 243)); digit n is read as ((q * 3^n) mod 256) * 3 >> 8, most significant
first. qs[0:32] hold values n*32 + m, qs[32:48] values 160 + n*16 + m, qh[j] values 240 + n*4 + j
(4 digits and a 0). Both quantizers use d = absmax of the block, so a BitNet tensor (ternary times
one scale) has the same d in every block that is not all zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .ggml import (
    GGML_TYPE_SIZES,
    I2S_BLOCK,
    I2S_BLOCK_ARM,
    I2S_TAIL_BYTES,
    QK_K,
    GGMLType,
    GGUFFormatError,
    GGUFUnsupportedError,
    TypeSize,
)

# byte -> its four 2-bit codes, most significant first (shifts 6, 4, 2, 0), as values code - 1.
_SHIFTS_DESC = np.array([6, 4, 2, 0], dtype=np.uint8)
_BYTE_TO_VALUES = ((np.arange(256, dtype=np.uint8)[:, None] >> _SHIFTS_DESC) & 3).astype(np.int8) - 1


def _where(where: str | None) -> str:
    return where if where else "I2_S tensor"


def _prod(shape: tuple[int, ...] | int) -> int:
    if isinstance(shape, int | np.integer):
        return int(shape)
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---------------------------------------------------------------------------------------------
# I2_S
# ---------------------------------------------------------------------------------------------


def i2s_nbytes(n_elements: int) -> int:
    """Bytes of an I2_S tensor: n/4 code bytes + float32 scale + 28 bytes padding."""
    return n_elements // 4 + I2S_TAIL_BYTES


def i2s_scale(raw: np.ndarray, n_elements: int, *, where: str | None = None) -> float:
    """The per-tensor scale stored at byte n/4; must be finite and >= 0."""
    off = n_elements // 4
    if len(raw) < off + 4:
        raise GGUFFormatError(
            f"{_where(where)}: {len(raw)} bytes, too short for {n_elements} values "
            f"(scale expected at byte {off}; an I2_S tensor has n/4 + 32 = {i2s_nbytes(n_elements)} bytes)"
        )
    scale = float(raw[off : off + 4].view("<f4")[0])
    if not np.isfinite(scale) or scale < 0:
        raise GGUFFormatError(
            f"{_where(where)}: I2_S scale at byte +{off} of the tensor data is {scale}, "
            "expected a finite non-negative number"
        )
    return scale


def _check_codes(codes: np.ndarray, where: str | None) -> None:
    # A 2-bit field holds 3 exactly when both of its bits are set.
    bad = (codes & (codes >> 1) & 0x55) != 0
    if bad.any():
        i = int(np.argmax(bad))
        raise GGUFFormatError(
            f"{_where(where)}: code 3 at byte +{i} of the tensor data; I2_S only uses codes 0, 1, 2 "
            "(a foreign or corrupt encoding)"
        )


def _check_i2s_size(raw: np.ndarray, n: int, block: int, where: str | None) -> None:
    if n % block:
        raise GGUFFormatError(f"{_where(where)}: {n} values is not a multiple of the I2_S block of {block}")
    if len(raw) < n // 4 + 4:
        raise GGUFFormatError(
            f"{_where(where)}: {len(raw)} bytes, too short for {n} values (needs n/4 + 32 = {i2s_nbytes(n)})"
        )


def i2s_check_layout(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> float:
    """Validate I2_S bytes; returns the scale. Raises GGUFError for what is detectable.

    Detectable: code 3, bad scale, partial blocks, non-zero padding. NOT detectable: ARM vs x86
    block order (a column permutation, see the module docstring); pass `layout='arm'` to decode.
    """
    n = _prod(shape)
    _check_i2s_size(raw, n, I2S_BLOCK, where)
    _check_codes(raw[: n // 4], where)
    scale = i2s_scale(raw, n, where=where)
    pad = raw[n // 4 + 4 : n // 4 + I2S_TAIL_BYTES]
    if pad.any():
        raise GGUFFormatError(
            f"{_where(where)}: padding bytes after the scale (byte +{n // 4 + 4}) are "
            "not zero; not an I2_S tensor as bitnet.cpp writes it"
        )
    return scale


def i2s_decode(
    raw: np.ndarray, shape: tuple[int, ...], *, layout: str = "x86", where: str | None = None
) -> tuple[np.ndarray, float]:
    """I2_S bytes -> (int8 values -1/0/+1 in `shape`, float scale). Rejects code 3 and bad scales."""
    if layout == "arm":
        return i2s_decode_arm(raw, shape, where=where)
    if layout != "x86":
        raise ValueError(f"layout must be 'x86' or 'arm', not {layout!r}")
    n = _prod(shape)
    _check_i2s_size(raw, n, I2S_BLOCK, where)
    scale = i2s_scale(raw, n, where=where)
    codes = raw[: n // 4]
    _check_codes(codes, where)
    # (blocks, byte 0..31, group 0..3) -> (blocks, group, byte): value index group*32 + byte
    values = _BYTE_TO_VALUES[codes.reshape(-1, 32)].transpose(0, 2, 1)
    return values.reshape(shape), scale


def i2s_decode_arm(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> tuple[np.ndarray, float]:
    """Decode the ARM NEON layout: blocks of 64 values in 16 bytes."""
    n = _prod(shape)
    _check_i2s_size(raw, n, I2S_BLOCK_ARM, where)
    scale = i2s_scale(raw, n, where=where)
    codes = raw[: n // 4]
    _check_codes(codes, where)
    values = _BYTE_TO_VALUES[codes.reshape(-1, 16)].transpose(0, 2, 1)
    return values.reshape(shape), scale


_I2S_GROUP = {"x86": I2S_BLOCK // 4, "arm": I2S_BLOCK_ARM // 4}  # bytes per block: byte b holds values b, g+b, ...


def _i2s_group(layout: str, n: int) -> int:
    group = _I2S_GROUP.get(layout)
    if group is None:
        raise ValueError(f"layout must be 'x86' or 'arm', not {layout!r}")
    if n % (4 * group):
        raise ValueError(f"I2_S needs a multiple of {4 * group} values, got {n}")
    return group


def _i2s_tensor(n: int, scale: float) -> np.ndarray:
    """Zeroed bytes of an I2_S tensor of n values with `scale` in its tail; the n/4 code bytes are the caller's."""
    out = np.zeros(n // 4 + I2S_TAIL_BYTES, dtype=np.uint8)
    out[n // 4 : n // 4 + 4] = np.array([scale], dtype="<f4").view(np.uint8)
    return out


def i2s_pack_codes(codes: np.ndarray, scale: float, *, layout: str = "x86") -> np.ndarray:
    """uint8 codes 0/1/2 (value + 1), flattened row-major, and a scale -> I2_S bytes (n/4 + 32).

    The one I2_S encoder: byte b of each block of 4 * g values (g = 32 x86, 16 ARM) holds values
    b, g+b, 2g+b, 3g+b at shifts 6, 4, 2, 0.
    """
    codes = np.asarray(codes, dtype=np.uint8)
    n = codes.size
    group = _i2s_group(layout, n)
    blocks = codes.reshape(-1, 4, group)
    out = _i2s_tensor(n, scale)
    packed = out[: n // 4].reshape(-1, group)
    np.left_shift(blocks[:, 0], 6, out=packed)
    packed |= blocks[:, 1] << 4
    packed |= blocks[:, 2] << 2
    packed |= blocks[:, 3]
    return out


def i2s_encode(values: np.ndarray, scale: float, *, layout: str = "x86") -> np.ndarray:
    """int8 values in {-1, 0, +1} and a scale -> I2_S bytes (n/4 + 32)."""
    v = np.asarray(values)
    _i2s_group(layout, v.size)
    if v.size and (v.min() < -1 or v.max() > 1):
        raise ValueError("I2_S values must be -1, 0 or +1")
    return i2s_pack_codes((v.astype(np.int16) + 1).astype(np.uint8), scale, layout=layout)


def i2s_arm_to_x86(raw: np.ndarray, n_elements: int, *, where: str | None = None) -> np.ndarray:
    """Repack an ARM-layout I2_S tensor into the x86 layout (same values, same scale)."""
    values, scale = i2s_decode_arm(raw, (n_elements,), where=where)
    return i2s_encode(values, scale)


def random_i2s_bytes(rng: np.random.Generator, n_elements: int, scale: float) -> np.ndarray:
    """Uniformly random ternary I2_S tensor, generated directly as bytes (fast for big tensors).

    Each byte's four codes are independent uniform draws from {0, 1, 2}: one draw in 0..80 picks
    all four (81 = 3^4 equally likely byte values).
    """
    digits = np.arange(81)
    table = np.zeros(81, dtype=np.uint8)
    for _ in range(4):  # first draw digit -> shift 6, last -> shift 0
        table = (table << 2) | (digits % 3).astype(np.uint8)
        digits //= 3
    out = _i2s_tensor(n_elements, scale)
    out[: n_elements // 4] = table[rng.integers(0, 81, size=n_elements // 4, dtype=np.uint8)]
    return out


# ---------------------------------------------------------------------------------------------
# Absmean ternarization (BitNet b1.58 weight quantizer)
# ---------------------------------------------------------------------------------------------


def ternarize(w: np.ndarray) -> tuple[np.ndarray, float]:
    """Absmean: scale = mean|w| (at least 1e-5), values = clamp(round(w / scale), -1, 1).

    Matches transformers' BitNet weight quantizer (round half to even, like torch.round).
    """
    w = np.asarray(w, dtype=np.float32)
    scale = max(float(np.abs(w).mean(dtype=np.float64)), 1e-5) if w.size else 1e-5
    inv = np.float32(1.0 / scale)
    values = np.clip(np.round(w * inv), -1, 1).astype(np.int8)
    return values, scale


# ---------------------------------------------------------------------------------------------
# TQ2_0 / TQ1_0 (upstream llama.cpp ternary types)
# ---------------------------------------------------------------------------------------------

_TQ2_BYTES = GGML_TYPE_SIZES[GGMLType.TQ2_0].type_size
_TQ1_BYTES = GGML_TYPE_SIZES[GGMLType.TQ1_0].type_size
_POW3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)


def _tq_blocks(raw: np.ndarray, shape, block_bytes: int, name: str, where: str | None) -> np.ndarray:
    n = _prod(shape)
    if n % QK_K:
        raise GGUFFormatError(f"{where or name}: {n} values is not a multiple of the {name} block of 256")
    need = n // QK_K * block_bytes
    if len(raw) < need:
        raise GGUFFormatError(f"{where or name}: {len(raw)} bytes, {name} with {n} values needs {need}")
    return raw[:need].reshape(-1, block_bytes)


def _lround(x: np.ndarray) -> np.ndarray:
    """C lroundf: halves away from zero."""
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _block_absmax_scales(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's TQ quantizers: d = absmax per block, q = lround(x / d) + 1 in {0, 1, 2}."""
    blocks = np.asarray(w, dtype=np.float32).reshape(-1, QK_K)
    amax = np.abs(blocks).max(axis=1)
    d16 = amax.astype(np.float16)
    inv = np.where(amax > 0, np.float32(1) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = (_lround(blocks * inv[:, None]) + 1).astype(np.uint8)
    return blocks, q, d16


def _tq2_codes(blocks: np.ndarray) -> np.ndarray:
    """(nb, 66) -> codes (nb, 256) in 0..3, value index j*128 + l*32 + m."""
    qs = blocks[:, :64].reshape(-1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs >> shifts) & 3).reshape(-1, QK_K)


def _tq1_codes(blocks: np.ndarray) -> np.ndarray:
    """(nb, 54) -> codes (nb, 256) in 0..2."""

    def digits(b: np.ndarray, count: int) -> np.ndarray:
        # b: (nb, width) -> (nb, count, width); digit n = ((q * 3^n) mod 256) * 3 >> 8
        q = (b[:, None, :] * _POW3[:count, None]).astype(np.uint8)  # wraps mod 256 like uint8_t
        return ((q.astype(np.uint16) * 3) >> 8).astype(np.uint8)

    nb = len(blocks)
    first = digits(blocks[:, :32], 5).reshape(nb, 160)
    second = digits(blocks[:, 32:48], 5).reshape(nb, 80)
    tail = digits(blocks[:, 48:52], 4).reshape(nb, 16)
    return np.concatenate([first, second, tail], axis=1)


def _tq_d(blocks: np.ndarray) -> np.ndarray:
    return blocks[:, -2:].copy().view("<f2").reshape(-1).astype(np.float32)


def tq2_0_decode(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
    """TQ2_0 bytes -> float32 values (q - 1) * d in `shape`, like ggml's dequantize_row_tq2_0."""
    blocks = _tq_blocks(raw, shape, _TQ2_BYTES, "TQ2_0", where)
    vals = _tq2_codes(blocks).astype(np.float32) - 1
    return (vals * _tq_d(blocks)[:, None]).reshape(shape)


def tq1_0_decode(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
    """TQ1_0 bytes -> float32 values in `shape`, like ggml's dequantize_row_tq1_0."""
    blocks = _tq_blocks(raw, shape, _TQ1_BYTES, "TQ1_0", where)
    vals = _tq1_codes(blocks).astype(np.float32) - 1
    return (vals * _tq_d(blocks)[:, None]).reshape(shape)


def tq2_0_encode(w: np.ndarray) -> np.ndarray:
    """Float values -> TQ2_0 bytes, like ggml's quantize_row_tq2_0_ref."""
    _, q, d16 = _block_absmax_scales(w)
    nb = len(q)
    q = q.reshape(nb, 2, 4, 32)
    qs = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)  # (nb, 2, 32)
    out = np.empty((nb, _TQ2_BYTES), dtype=np.uint8)
    out[:, :64] = qs.reshape(nb, 64)
    out[:, 64:] = d16.astype("<f2").view(np.uint8).reshape(nb, 2)
    return out.reshape(-1)


def tq1_0_encode(w: np.ndarray) -> np.ndarray:
    """Float values -> TQ1_0 bytes, like ggml's quantize_row_tq1_0_ref."""
    _, q, d16 = _block_absmax_scales(w)
    nb = len(q)

    def pack(digits: np.ndarray, pad_digit: bool) -> np.ndarray:
        # digits: (nb, count, width), most significant first -> bytes ceil(sum * 256 / 243)
        acc = np.zeros(digits.shape[::2], dtype=np.uint16)
        for k in range(digits.shape[1]):
            acc = acc * 3 + digits[:, k]
        if pad_digit:
            acc = acc * 3
        return ((acc * 256 + 242) // 243).astype(np.uint8)

    out = np.empty((nb, _TQ1_BYTES), dtype=np.uint8)
    out[:, :32] = pack(q[:, :160].reshape(nb, 5, 32), False)
    out[:, 32:48] = pack(q[:, 160:240].reshape(nb, 5, 16), False)
    out[:, 48:52] = pack(q[:, 240:].reshape(nb, 4, 4), True)
    out[:, 52:] = d16.astype("<f2").view(np.uint8).reshape(nb, 2)
    return out.reshape(-1)


def _one_scale(codes: np.ndarray, blocks: np.ndarray, shape, label: str) -> tuple[np.ndarray, float]:
    """TQ codes (nb, 256) and blocks -> (int8 ternary values in `shape`, one per-tensor scale).

    BitNet tensors are ternary times one scale, so every block that is not all zero must carry the
    same d (up to f16 rounding: one f16 ulp). Anything else is not a BitNet tensor: GGUFFormatError.
    """
    values = codes.astype(np.int8) - 1
    d = _tq_d(blocks)
    if not np.isfinite(d).all():
        raise GGUFFormatError(f"{label}: non-finite block scale in block {int(np.argmax(~np.isfinite(d)))}")
    live = (values != 0).any(axis=1)
    if not live.any():
        return values.reshape(shape), 0.0
    ds = d[live]
    lo, hi = float(ds.min()), float(ds.max())
    if hi - lo > hi * 2.0**-10:
        raise GGUFFormatError(
            f"{label}: block scales range from {lo} to {hi}; a BitNet tensor has one scale per tensor, "
            "so this tensor cannot be converted to ternary values + one scale"
        )
    if hi <= 0:
        raise GGUFFormatError(f"{label}: non-zero ternary values with block scale {hi}")
    return values.reshape(shape), float(np.median(ds))


def tq2_0_ternary(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> tuple[np.ndarray, float]:
    """A TQ2_0 tensor -> (int8 ternary values in `shape`, one per-tensor scale); rejects code 3."""
    blocks = _tq_blocks(raw, shape, _TQ2_BYTES, "TQ2_0", where)
    codes = _tq2_codes(blocks)
    if (codes == 3).any():
        raise GGUFFormatError(
            f"{where or 'TQ2_0'}: TQ2_0 code 3 in block {int(np.argmax((codes == 3).any(1)))}; not a ternary tensor"
        )
    return _one_scale(codes, blocks, shape, where or "TQ2_0")


def tq1_0_ternary(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> tuple[np.ndarray, float]:
    """A TQ1_0 tensor -> (int8 ternary values in `shape`, one per-tensor scale)."""
    blocks = _tq_blocks(raw, shape, _TQ1_BYTES, "TQ1_0", where)
    return _one_scale(_tq1_codes(blocks), blocks, shape, where or "TQ1_0")


# ---------------------------------------------------------------------------------------------
# Q8_0 and the float types
# ---------------------------------------------------------------------------------------------

_Q8_BLOCK, _Q8_BYTES = GGML_TYPE_SIZES[GGMLType.Q8_0][:2]


def q8_0_decode(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
    """Q8_0 bytes -> float32 values q * d in `shape`, like ggml's dequantize_row_q8_0."""
    blocks = raw[: _prod(shape) // _Q8_BLOCK * _Q8_BYTES].reshape(-1, _Q8_BYTES)
    d = blocks[:, :2].copy().view("<f2").astype(np.float32)  # (nb, 1)
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # (nb, 32)
    return (q * d).reshape(shape)


def q8_0_encode(x: np.ndarray) -> np.ndarray:
    """float -> Q8_0 blocks (f16 d = absmax/127, 32 int8), like ggml's quantize_row_q8_0_ref."""
    blocks = np.asarray(x, dtype=np.float32).reshape(-1, _Q8_BLOCK)
    d = np.abs(blocks).max(axis=1) / 127
    inv = np.where(d > 0, 1 / np.where(d > 0, d, 1), 0).astype(np.float32)
    v = blocks * inv[:, None]
    q = _lround(v).astype(np.int8)
    out = np.empty((len(blocks), _Q8_BYTES), dtype=np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(-1)


def bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly (the bits become the high half)."""
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def float_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def _plain(dtype: str) -> tuple[Callable, Callable]:
    """(decode, encode) of a type stored as numpy `dtype` values: decode is a view, no copy."""

    def decode(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
        return raw.view(dtype).reshape(shape)

    def encode(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=dtype).reshape(-1).view(np.uint8)

    return decode, encode


def _bf16_decode(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
    return bf16_to_float32(raw.view("<u2")).reshape(shape)


def _bf16_encode(x: np.ndarray) -> np.ndarray:
    return float_to_bf16_bits(x).reshape(-1).view(np.uint8)


def _i2s_values(raw: np.ndarray, shape: tuple[int, ...], *, where: str | None = None) -> np.ndarray:
    values, scale = i2s_decode(raw, shape, where=where)
    return values.astype(np.float32) * np.float32(scale)


def _i2s_from_ternary(values: np.ndarray, scale: float) -> np.ndarray:
    return i2s_encode(np.asarray(values), float(scale))


def _i2s_check(raw: np.ndarray, n_elements: int, *, where: str | None = None) -> None:
    i2s_scale(raw, n_elements, where=where)


# ---------------------------------------------------------------------------------------------
# The codec table
# ---------------------------------------------------------------------------------------------


class Codec(NamedTuple):
    """One GGML type's facts: its sizes and how its bytes become values and back."""

    ggml_type: GGMLType
    size: TypeSize  # values per block, bytes per block, bytes once per tensor
    # (raw uint8, shape, where=) -> values in shape: float32, or views for F32 (<f4) and F16 (<f2)
    decode: Callable[..., np.ndarray]
    # float values (any shape) -> uint8 bytes; None where the type is not made from floats (I2_S)
    encode: Callable[[np.ndarray], np.ndarray] | None
    # (raw, shape, where=) -> (int8 values -1/0/+1 in shape, per-tensor scale): the ternary types
    ternary: Callable[..., tuple[np.ndarray, float]] | None = None
    # (int8 values -1/0/+1, scale) -> uint8 bytes: a type made from ternary values and one scale
    encode_ternary: Callable[[np.ndarray, float], np.ndarray] | None = None
    # (raw, n_elements, where=) -> None, raising GGUFFormatError: what a whole-file check reads
    check: Callable[..., None] | None = None

    @property
    def elementwise(self) -> bool:
        """One value per block: any run of values encodes on its own (streamed chunks)."""
        return self.size.block == 1


def _codecs(*rows: tuple) -> dict[GGMLType, Codec]:
    return {t: Codec(t, GGML_TYPE_SIZES[t], *rest) for t, *rest in rows}


CODECS: dict[GGMLType, Codec] = _codecs(
    (GGMLType.F32, *_plain("<f4")),
    (GGMLType.F16, *_plain("<f2")),
    (GGMLType.BF16, _bf16_decode, _bf16_encode),
    (GGMLType.Q8_0, q8_0_decode, q8_0_encode),
    (GGMLType.TQ1_0, tq1_0_decode, tq1_0_encode, tq1_0_ternary),
    (GGMLType.TQ2_0, tq2_0_decode, tq2_0_encode, tq2_0_ternary),
    (GGMLType.I2_S, _i2s_values, None, i2s_decode, _i2s_from_ternary, _i2s_check),
)
assert set(CODECS) == set(GGMLType), "every GGML type this package knows has a codec"


def codec(ggml_type: GGMLType | int, where: str = "tensor") -> Codec:
    """The codec of a type id; GGUFUnsupportedError naming `where` for a type without one."""
    try:
        return CODECS[GGMLType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFUnsupportedError(f"{where}: GGML type {ggml_type} is not supported") from None
