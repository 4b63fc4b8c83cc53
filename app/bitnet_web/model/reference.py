"""A plain numpy BitNet b1.58 forward pass: the CPU reference the GPU engine is tested against.

It follows `build_bitnet_158` (shared/ground-truth.md) line by line, in float32 with float64
accumulation for the ternary products, and uses nothing from the GPU side. Slow by design: for
tests and for checking a new file, not for chat.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..formats.ggml import OUTPUT, OUTPUT_NORM, TOKEN_EMBD, GGMLType, block_tensor
from ..formats.gguf_reader import GGUFFile
from ..formats.quants import ternarize
from .config import ModelConfig, config_from_gguf


@dataclass
class TernaryWeight:
    values: np.ndarray  # (n_out, n_in) int8 in {-1, 0, +1}
    scale: float  # absmean of the original weights: w = values * scale

    @property
    def values_f32(self) -> np.ndarray:
        """The values as float32, converted once (the matmul's operand)."""
        cached = self.__dict__.get("_values_f32")
        if cached is None:
            cached = self.__dict__["_values_f32"] = self.values.astype(np.float32)
        return cached


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # (dim,)
    wq: TernaryWeight  # (n_heads * head_dim, dim)
    wk: TernaryWeight  # (n_kv_heads * head_dim, dim)
    wv: TernaryWeight  # (n_kv_heads * head_dim, dim)
    attn_sub_norm: np.ndarray | None  # (n_heads * head_dim,)
    wo: TernaryWeight  # (dim, n_heads * head_dim)
    ffn_norm: np.ndarray  # (dim,)
    w_gate: TernaryWeight  # (ffn_dim, dim)
    w_up: TernaryWeight  # (ffn_dim, dim)
    ffn_sub_norm: np.ndarray | None  # (ffn_dim,)
    w_down: TernaryWeight  # (dim, ffn_dim)


def load_ternary(gguf: GGUFFile, name: str) -> TernaryWeight:
    if gguf.tensors[name].ggml_type in (GGMLType.I2_S, GGMLType.TQ1_0, GGMLType.TQ2_0):
        values, scale = gguf.ternary(name)
    else:  # float master weights (experimental post-training ternarization)
        values, scale = ternarize(np.asarray(gguf.tensor(name), dtype=np.float32))
    return TernaryWeight(values, float(scale))


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    x = x.astype(np.float32)
    normed = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed * weight if weight is not None else normed


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token absmax int8: returns (xq int8-valued float32, scale s) with x ~= xq / s."""
    s = (127.0 / np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-5)).astype(np.float32)
    xq = np.clip(np.round(x * s), -128, 127).astype(np.float32)
    return xq, s


def bitlinear(x: np.ndarray, w: TernaryWeight) -> np.ndarray:
    xq, s = quantize_activations(x)
    # Integer-valued products summed in float32 are exact while |sum| < 2^24: 127 * K stays far
    # below that for every K a BitNet layer has (6912 in 2B-4T), so this is the integer dot product.
    acc = xq @ w.values_f32.T
    return (acc.astype(np.float64) * w.scale / s).astype(np.float32)


def rope_tables(positions: np.ndarray, rope_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    inv_freq = 1.0 / (theta ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, style: str) -> np.ndarray:
    """x: (T, heads, head_dim); cos/sin: (T, rope_dim/2). Dims past rope_dim are left alone."""
    half = cos.shape[1]
    rope_dim = 2 * half
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if style == "neox":
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * c - b * s
        out[..., half:rope_dim] = b * c + a * s
    else:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * c - b * s
        out[..., 1:rope_dim:2] = b * c + a * s
    return out


class ReferenceModel:
    """Weights decoded to numpy once; `logits(tokens)` recomputes the whole sequence."""

    def __init__(self, gguf: GGUFFile, config: ModelConfig | None = None):
        self.config = config or config_from_gguf(gguf)
        cfg = self.config
        self.token_embd = np.asarray(gguf.tensor(TOKEN_EMBD), dtype=np.float32)  # (vocab, dim)
        self.output_norm = np.asarray(gguf.tensor(OUTPUT_NORM), dtype=np.float32)  # (dim,)
        if cfg.tied_embeddings:
            self.output = self.token_embd
        else:
            self.output = np.asarray(gguf.tensor(OUTPUT), dtype=np.float32)  # (vocab, dim)
        self.layers = []
        for i in range(cfg.n_layers):

            def norm(short: str, layer: int = i) -> np.ndarray | None:
                key = block_tensor(layer, short)
                return np.asarray(gguf.tensor(key), dtype=np.float32) if key in gguf.tensors else None

            def tern(short: str, layer: int = i) -> TernaryWeight:
                return load_ternary(gguf, block_tensor(layer, short))

            self.layers.append(
                LayerWeights(
                    attn_norm=norm("attn_norm"),
                    wq=tern("attn_q"),
                    wk=tern("attn_k"),
                    wv=tern("attn_v"),
                    attn_sub_norm=norm("attn_sub_norm"),
                    wo=tern("attn_output"),
                    ffn_norm=norm("ffn_norm"),
                    w_gate=tern("ffn_gate"),
                    w_up=tern("ffn_up"),
                    ffn_sub_norm=norm("ffn_sub_norm"),
                    w_down=tern("ffn_down"),
                )
            )

    def logits(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """float32 logits (T, vocab) for every position of `tokens` (causal, positions from 0)."""
        cfg = self.config
        tokens = np.asarray(tokens, dtype=np.int64)
        n = len(tokens)
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        cos, sin = rope_tables(np.arange(n), cfg.rope_dim, cfg.rope_theta)
        causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        x = self.token_embd[tokens].astype(np.float32)  # (T, dim)
        for layer in self.layers:
            # attention: h = norm(x); q,k,v = BitLinear(h); rope; softmax(q k^T / sqrt(hd)) v
            h = rms_norm(x, layer.attn_norm, cfg.norm_eps)
            q = apply_rope(bitlinear(h, layer.wq).reshape(n, nh, hd), cos, sin, cfg.rope_style)
            k = apply_rope(bitlinear(h, layer.wk).reshape(n, nkv, hd), cos, sin, cfg.rope_style)
            v = bitlinear(h, layer.wv).reshape(n, nkv, hd)
            group = nh // nkv
            k = np.repeat(k, group, axis=1)
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + causal
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs = scores / scores.sum(axis=-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, v).reshape(n, nh * hd).astype(np.float32)
            if layer.attn_sub_norm is not None:
                attn = rms_norm(attn, layer.attn_sub_norm, cfg.norm_eps)
            x = x + bitlinear(attn, layer.wo)
            # feed-forward: act(gate(h)) * up(h), sub-norm, down
            h = rms_norm(x, layer.ffn_norm, cfg.norm_eps)
            gate = bitlinear(h, layer.w_gate)
            if cfg.activation == "relu2":
                gate = np.square(np.maximum(gate, 0.0))
            else:
                gate = gate / (1.0 + np.exp(-gate))
            m = gate * bitlinear(h, layer.w_up)
            if layer.ffn_sub_norm is not None:
                m = rms_norm(m, layer.ffn_sub_norm, cfg.norm_eps)
            x = x + bitlinear(m, layer.w_down)
        x = rms_norm(x, self.output_norm, cfg.norm_eps)
        return (x.astype(np.float64) @ self.output.T.astype(np.float64)).astype(np.float32)
