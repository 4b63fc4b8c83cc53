"""The KV cache: per-layer K and V buffers on the GPU that grow by doubling up to the context length.

Layout of every buffer: token-major `[capacity, n_kv_heads * head_dim]`; row p holds the (rotated)
key or the value of the token at absolute position p, heads side by side. Elements are f16 (IEEE
half, little-endian: two per u32 word, the first in the low bits, as WGSL's pack2x16float writes
them and numpy's float16 lays them out), which halves the memory and the attention's reads; `dtype="f32"`
keeps float32 (the accuracy reference). Shaders read and write it through shaders/_kv.wgsl, selected
by `defines`.

Growth allocates new buffers, copies the old rows on the GPU, releases the old buffers and asks every
op bound to the cache to `rebind()` (their bind groups name the old buffers). The model calls
`ensure_capacity(pos + n_tokens)` before recording a step, never during one.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .. import gpu

F32 = 4
KV_DTYPES = {"f16": np.float16, "f32": np.float32}  # cache element type -> numpy dtype of its bytes


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, dtype: str = "f16") -> int:
    """Bytes of K and V one token occupies in the cache over all layers."""
    return 2 * n_layers * n_kv_heads * head_dim * np.dtype(KV_DTYPES[dtype]).itemsize


class KVCacheFullError(ValueError):
    """The conversation would exceed the model's context length."""


class CacheBoundOp(Protocol):
    def rebind(self) -> None: ...


class KVCache:
    """K and V for every layer. `k[layer]`, `v[layer]`: [capacity, n_kv_heads * head_dim] buffers of
    `dtype` ("f16" or "f32") elements."""

    def __init__(
        self,
        device: gpu.Device,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_context: int,
        initial_capacity: int = 256,
        dtype: str = "f16",
    ):
        if dtype not in KV_DTYPES:
            raise ValueError(f"KVCache: dtype must be one of {tuple(KV_DTYPES)}, got {dtype!r}")
        for name, value in (
            ("n_layers", n_layers),
            ("n_kv_heads", n_kv_heads),
            ("head_dim", head_dim),
            ("max_context", max_context),
            ("initial_capacity", initial_capacity),
        ):
            if value <= 0:
                raise ValueError(f"KVCache: {name} must be positive, got {value}")
        self.device = device
        self.n_layers = n_layers
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.max_context = max_context
        self.dtype = dtype
        self.np_dtype = np.dtype(KV_DTYPES[dtype])
        # the shaders' switch for shaders/_kv.wgsl
        self.defines: tuple[str, ...] = ("KV_F32",) if dtype == "f32" else ()
        self.row_values = n_kv_heads * head_dim
        self.row_bytes = self.row_values * self.np_dtype.itemsize
        if max_context * self.row_bytes > device.limits.max_binding:
            raise gpu.GPUOutOfMemoryError(
                f"KVCache: a full context of {max_context} rows x {self.row_bytes} bytes per layer needs "
                f"{max_context * self.row_bytes} bytes in one binding, over this device's limit of "
                f"{device.limits.max_binding} bytes"
            )
        self.capacity = min(initial_capacity, max_context)
        self.k: list[gpu.Buffer] = []  # per layer, [capacity, n_kv_heads * head_dim] of dtype
        self.v: list[gpu.Buffer] = []  # per layer, [capacity, n_kv_heads * head_dim] of dtype
        for layer in range(n_layers):
            self.k.append(self._new_buffer("k", layer, self.capacity))
            self.v.append(self._new_buffer("v", layer, self.capacity))
        self._bound_ops: list[CacheBoundOp] = []
        self.generation = 0  # bumped at every growth, so holders of buffer references can tell

    def _new_buffer(self, kind: str, layer: int, rows: int) -> gpu.Buffer:
        return self.device.buffer(rows * self.row_bytes, gpu.STORAGE_USAGE, f"kv cache {kind} layer {layer}")

    def write_rows(self, layer: int, first_row: int, k: np.ndarray, v: np.ndarray) -> None:
        """Upload float K and V rows ([n, n_kv_heads, head_dim] or [n, n_kv_heads * head_dim]) from
        `first_row` on, converted to the cache's element type (benchmarks and tests fill caches this way)."""
        for buffers, rows, kind in ((self.k, k, "k"), (self.v, v, "v")):
            rows = np.ascontiguousarray(rows, dtype=self.np_dtype).reshape(-1, self.row_values)
            if first_row < 0 or first_row + rows.shape[0] > self.capacity:
                raise ValueError(
                    f"KVCache.write_rows: {kind} rows {first_row}..{first_row + rows.shape[0] - 1} are outside "
                    f"the {self.capacity} allocated"
                )
            self.device.upload(buffers[layer], first_row * self.row_bytes, rows)

    def attach(self, op: CacheBoundOp) -> None:
        """Register an op whose bind groups name this cache's buffers; it is rebound after every growth."""
        self._bound_ops.append(op)

    def ensure_capacity(self, n_rows: int) -> bool:
        """Make room for rows 0..n_rows-1 (grow by doubling, keeping old rows). True if buffers changed.

        Raises KVCacheFullError past the model's context length.
        """
        if n_rows > self.max_context:
            raise KVCacheFullError(
                f"KV cache: {n_rows} tokens exceed the model's context length of {self.max_context}; "
                f"start a new conversation or shorten the prompt"
            )
        if n_rows <= self.capacity:
            return False
        new_capacity = self.capacity
        while new_capacity < n_rows:
            new_capacity *= 2
        new_capacity = min(new_capacity, self.max_context)
        old_bytes = self.capacity * self.row_bytes
        recorder = self.device.begin()
        old_buffers = []
        for layer in range(self.n_layers):
            for buffers, kind in ((self.k, "k"), (self.v, "v")):
                new = self._new_buffer(kind, layer, new_capacity)
                recorder.copy(buffers[layer], 0, new, 0, old_bytes)
                old_buffers.append(buffers[layer])
                buffers[layer] = new
        recorder.submit()
        # WebGPU keeps a destroyed buffer alive until the submitted copies that use it are done.
        for old in old_buffers:
            self.device.release(old)
        self.capacity = new_capacity
        self.generation += 1
        for op in self._bound_ops:
            op.rebind()
        return True

    def release(self) -> None:
        for buffer in self.k + self.v:
            self.device.release(buffer)
        self.k.clear()
        self.v.clear()
