"""How a model's shapes are laid out on the GPU: widths padded to what the kernels take, KV heads repeated.

The kernels take BitLinear inputs in whole I2_S blocks of 128 values, head dims of 32/64/128/256 and
at most `max_query_heads_per_kv(head_dim)` query heads per KV head. Any other BitNet shape runs by
changing the layout at upload, never the math:

- widths (hidden, FFN, heads * head_dim) are zero-padded: weight rows and columns past the true width
  are zero, so padded activations stay exactly zero; RMSNorms divide by the true width
  (`mean_width`) and zeros change neither the sum of squares nor the int8 absmax;
- each head is zero-padded to `head_dim` (q . k and p @ V unchanged; the padded dims of the output
  are zero and meet zero columns of W_o); RoPE rotates the true `rope_dim` only and the attention
  scale stays 1 / sqrt(true head_dim);
- a KV head serving more query heads than one workgroup holds is repeated `kv_repeat` times (its
  K/V weight rows duplicated), so each copy serves a group that fits.
The cost is the padding itself (e.g. head_dim 100 -> 128 reads 28% more KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels.attention import SUPPORTED_HEAD_DIMS, max_query_heads_per_kv
from ..kernels.linear import I2S_BLOCK
from .config import HeadWidths, ModelConfig


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class GPULayout(HeadWidths):
    """Padded widths and repeated KV heads of one model (see the module docstring)."""

    dim: int  # hidden width, multiple of I2S_BLOCK
    ffn_dim: int  # FFN width, multiple of I2S_BLOCK
    head_dim: int  # one of SUPPORTED_HEAD_DIMS, with n_heads * head_dim a multiple of I2S_BLOCK
    n_heads: int
    n_kv_heads: int  # the model's KV heads times kv_repeat
    kv_repeat: int


def gpu_layout(cfg: ModelConfig) -> GPULayout:
    """The layout for `cfg`; config_from_gguf has refused head dims above the largest supported one."""
    head_dim = min(d for d in SUPPORTED_HEAD_DIMS if d >= cfg.head_dim and cfg.n_heads * d % I2S_BLOCK == 0)
    group = cfg.n_heads // cfg.n_kv_heads
    fits = max_query_heads_per_kv(head_dim)
    served = max(g for g in range(1, min(group, fits) + 1) if group % g == 0)  # query heads per KV copy
    return GPULayout(
        dim=round_up(cfg.dim, I2S_BLOCK),
        ffn_dim=round_up(cfg.ffn_dim, I2S_BLOCK),
        head_dim=head_dim,
        n_heads=cfg.n_heads,
        n_kv_heads=cfg.n_heads // served,
        kv_repeat=group // served,
    )


def gather_index(cfg: ModelConfig, layout: GPULayout, axis: str) -> np.ndarray | None:
    """For each position of a padded axis, the model's index that goes there (-1: zero padding), or None
    where the axis is not changed. Axes: 'dim', 'ffn', 'q' (heads, head dims), 'kv' (repeated heads)."""
    if axis in ("dim", "ffn"):
        true, padded = (cfg.dim, layout.dim) if axis == "dim" else (cfg.ffn_dim, layout.ffn_dim)
        if true == padded:
            return None
        index = np.arange(padded)
        index[true:] = -1
        return index
    heads, repeat = (cfg.n_heads, 1) if axis == "q" else (cfg.n_kv_heads, layout.kv_repeat)
    if layout.head_dim == cfg.head_dim and repeat == 1:
        return None
    dims = np.arange(layout.head_dim)
    source_head = np.repeat(np.arange(heads), repeat)  # copies of a KV head sit next to each other
    index = source_head[:, None] * cfg.head_dim + dims[None, :]
    index[:, cfg.head_dim :] = -1
    return index.reshape(-1)


def gather(values: np.ndarray, rows: np.ndarray | None, cols: np.ndarray | None = None) -> np.ndarray:
    """`values` (1-D, or 2-D with `cols`) laid out by gather indices, zeros where an index is -1."""
    if rows is not None:
        out = np.zeros((len(rows),) + values.shape[1:], dtype=values.dtype)
        keep = rows >= 0
        out[keep] = values[rows[keep]]
        values = out
    if cols is not None:
        out = np.zeros((values.shape[0], len(cols)), dtype=values.dtype)
        keep = cols >= 0
        out[:, keep] = values[:, cols[keep]]
        values = out
    return values
