"""Rotary position embedding of q and k, fused with the KV-cache append (shaders/rope.wgsl).

Angles are exactly Hugging Face's: inv_freq[i] = 1 / theta^(2i / rope_dim) computed in float32 (as
`_compute_default_rope_parameters` does), angle = position * inv_freq[i]. The cos/sin table is
evaluated on the CPU in float64 once at load, so large positions keep full float32 accuracy (a GPU
`cos(4000.0 * f)` would lose ~1e-4 to the f32 product and the driver's range reduction).
"""

from __future__ import annotations

import numpy as np

from .. import gpu
from .common import STEP_PARAMS_WGSL, KernelCache, StepParams
from .kv_cache import F32, KVCache

ROPE_STYLES = ("neox", "interleaved")
WORKGROUP = 64


def rope_inv_freq(rope_dim: int, theta: float) -> np.ndarray:
    """HF's inverse frequencies, [rope_dim / 2] float32."""
    exponents = np.arange(0, rope_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope_dim)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_cos_sin_table(rope_dim: int, theta: float, n_positions: int) -> np.ndarray:
    """[n_positions, rope_dim / 2, 2] float32: (cos, sin) of position * inv_freq[i]."""
    angles = np.arange(n_positions, dtype=np.float64)[:, None] * rope_inv_freq(rope_dim, theta).astype(np.float64)
    return np.stack([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)


class RopeTable:
    """The cos/sin table on the GPU, shared by every layer: [n_positions, rope_dim / 2] vec2<f32>."""

    def __init__(self, device: gpu.Device, rope_dim: int, theta: float, n_positions: int):
        if rope_dim <= 0 or rope_dim % 2:
            raise ValueError(f"RopeTable: rope_dim must be a positive even number, got {rope_dim}")
        if not theta > 0:
            raise ValueError(f"RopeTable: rope theta (freq_base) must be positive, got {theta}")
        self.rope_dim = rope_dim
        self.theta = theta
        self.n_positions = n_positions
        table = rope_cos_sin_table(rope_dim, theta, n_positions)
        self.buffer = device.buffer(table.nbytes, gpu.STORAGE_USAGE, "rope cos/sin table")
        device.upload(self.buffer, 0, table)


class RopeKV:
    """Rotates this step's q into `q_out` and appends rotated k and plain v to the layer's KV cache.

    qkv   [max_tokens, (n_heads + 2 * n_kv_heads) * head_dim] f32: fused projection (q, k, v heads)
    q_out [max_tokens, n_heads * head_dim] f32
    Cache rows written: pos .. pos + n_tokens - 1 (StepParams), in `cache.k[layer]` / `cache.v[layer]`,
    in the cache's element type.
    One dispatch per step.
    """

    def __init__(
        self,
        kernels: KernelCache,
        params: StepParams,
        cache: KVCache,
        layer: int,
        table: RopeTable,
        qkv: gpu.Buffer,
        q_out: gpu.Buffer,
        *,
        n_heads: int,
        style: str,
        max_tokens: int,
    ):
        n_kv_heads, head_dim = cache.n_kv_heads, cache.head_dim
        if style not in ROPE_STYLES:
            raise ValueError(f"RopeKV layer {layer}: rope style must be one of {ROPE_STYLES}, got {style!r}")
        if head_dim % 4:
            raise ValueError(f"RopeKV layer {layer}: head_dim must be a multiple of 4, got {head_dim}")
        if table.rope_dim > head_dim:
            raise ValueError(f"RopeKV layer {layer}: rope_dim {table.rope_dim} exceeds head_dim {head_dim}")
        if n_heads % n_kv_heads:
            raise ValueError(f"RopeKV layer {layer}: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        if table.n_positions < cache.max_context:
            raise ValueError(
                f"RopeKV layer {layer}: the rope table covers {table.n_positions} positions but the cache "
                f"holds up to {cache.max_context}"
            )
        if not 0 <= layer < cache.n_layers:
            raise ValueError(f"RopeKV: layer {layer} is outside the cache's {cache.n_layers} layers")
        _check_size(qkv, max_tokens * (n_heads + 2 * n_kv_heads) * head_dim * F32, f"RopeKV layer {layer}: qkv")
        _check_size(q_out, max_tokens * n_heads * head_dim * F32, f"RopeKV layer {layer}: q_out")
        self.device = kernels.device
        self.params = params
        self.cache = cache
        self.layer = layer
        self.table = table
        self.qkv = qkv
        self.q_out = q_out
        self.max_tokens = max_tokens
        self.style = style
        self.pipeline = kernels.pipeline(
            "rope",
            defines=cache.defines,
            STEP_PARAMS=STEP_PARAMS_WGSL,
            HQ=n_heads,
            HKV=n_kv_heads,
            HD=head_dim,
            ROPE_DIM=table.rope_dim,
            NEOX=style == "neox",
            WG=WORKGROUP,
        )
        self.groups_x = -(-(n_heads + 2 * n_kv_heads) * head_dim // 4 // WORKGROUP)
        self.bind_group: gpu.BindGroup
        self.rebind()
        cache.attach(self)

    def rebind(self) -> None:
        """Rebuild the bind group after the cache's buffers were replaced (capacity growth)."""
        self.bind_group = self.device.bind_group(
            self.pipeline,
            [
                self.params.buffer,
                self.qkv,
                self.table.buffer,
                self.q_out,
                self.cache.k[self.layer],
                self.cache.v[self.layer],
            ],
            f"rope+kv layer {self.layer}",
        )

    def record(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        if not 0 < n_tokens <= self.max_tokens:
            raise ValueError(f"RopeKV layer {self.layer}: n_tokens {n_tokens} outside 1..{self.max_tokens}")
        recorder.dispatch(self.pipeline, self.bind_group, self.groups_x, n_tokens)


def _check_size(buffer: gpu.Buffer, needed: int, what: str) -> None:
    if buffer.nbytes < needed:
        raise ValueError(f"{what} buffer {buffer.label!r} has {buffer.nbytes} bytes, needs at least {needed}")
