"""numpy references for the linear / norm / embedding kernels (helper K1).

Written from shared/ground-truth.md, independently of the kernels and of `bitnet_web.formats.quants`:
the I2_S encoder here is a direct transcription of the layout text, so a mistake shared by the
engine's encoder and its decoder cannot cancel out.
"""

from __future__ import annotations

import numpy as np

I2S_CODE_OF_VALUE = {-1: 0, 0: 1, 1: 2}  # ground truth: codes 0 = -1, 1 = 0, 2 = +1


def ref_i2s_encode(values: np.ndarray, scale: float) -> np.ndarray:
    """Ternary values (any shape, size a multiple of 128) -> I2_S bytes incl. the 32-byte trailer.

    Blocks of 128 values in 32 bytes; byte b holds values b, 32+b, 64+b, 96+b at shifts 6, 4, 2, 0.
    """
    flat = np.asarray(values, dtype=np.int64).reshape(-1)
    assert flat.size % 128 == 0 and np.all(np.abs(flat) <= 1)
    codes = (flat + 1).reshape(-1, 4, 32)  # (block, group g = value // 32, byte b = value % 32)
    packed = (codes[:, 0] << 6) | (codes[:, 1] << 4) | (codes[:, 2] << 2) | codes[:, 3]
    trailer = np.zeros(32, dtype=np.uint8)
    trailer[:4] = np.frombuffer(np.float32(scale).tobytes(), dtype=np.uint8)
    return np.concatenate([packed.reshape(-1).astype(np.uint8), trailer])


def ref_rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm in float64: x / sqrt(mean(x^2) + eps) * weight (rows are tokens)."""
    x = np.asarray(x, dtype=np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * np.asarray(weight, dtype=np.float64)


def ref_quantize_rows(y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """BitLinear activation quantization per row: s = 127 / max(absmax, 1e-5),
    q = clamp(round(y * s), -128, 127) (round half to even, like torch.round / np.round).

    Returns (q int8, 1/s float64, y*s float64 before rounding: lets tests see rounding ties)."""
    y = np.asarray(y, dtype=np.float64)
    s = 127.0 / np.maximum(np.abs(y).max(axis=-1, keepdims=True), 1e-5)
    scaled = y * s
    q = np.clip(np.round(scaled), -128, 127).astype(np.int8)
    return q, (1.0 / s)[..., 0], scaled


def pack_int8_words(q: np.ndarray) -> np.ndarray:
    """int8 rows (T, W) -> u32 words (T, W/4), value 4i+e in byte e (little-endian)."""
    q = np.ascontiguousarray(q, dtype=np.int8)
    return q.view(np.uint32)


def unpack_int8_words(words: np.ndarray, width: int) -> np.ndarray:
    return np.ascontiguousarray(words, dtype=np.uint32).view(np.int8).reshape(-1, width)


def ref_ternary_linear(values: np.ndarray, row_scales: np.ndarray, q: np.ndarray, inv_s: np.ndarray) -> np.ndarray:
    """y[t, n] = row_scale[n] * inv_s[t] * sum_k values[n, k] * q[t, k], in float64 (T, N)."""
    dots = q.astype(np.int64) @ values.astype(np.int64).T
    return dots * np.asarray(row_scales, dtype=np.float64)[None, :] * np.asarray(inv_s, np.float64)[:, None]


def ref_relu2(g: np.ndarray) -> np.ndarray:
    return np.maximum(g, 0.0) ** 2


def ref_silu(g: np.ndarray) -> np.ndarray:
    return g / (1.0 + np.exp(-g))
