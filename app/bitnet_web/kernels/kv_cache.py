"""The KV cache: per-layer K and V buffers on the GPU that grow by doubling up to the context length.

Layout of every buffer: token-major f32 `[capacity, n_kv_heads * head_dim]`; row p holds the (rotated)
key or the value of the token at absolute position p, heads side by side.

Growth allocates new buffers, copies the old rows on the GPU, releases the old buffers and asks every
op bound to the cache to `rebind()` (their bind groups name the old buffers). The model calls
`ensure_capacity(pos + n_tokens)` before recording a step, never during one.
"""

from __future__ import annotations

from typing import Protocol

from .. import gpu

F32 = 4


class KVCacheFullError(ValueError):
    """The conversation would exceed the model's context length."""


class CacheBoundOp(Protocol):
    def rebind(self) -> None: ...


class KVCache:
    """K and V for every layer. `k[layer]`, `v[layer]`: [capacity, n_kv_heads * head_dim] f32 buffers."""

    def __init__(
        self,
        device: gpu.Device,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_context: int,
        initial_capacity: int = 256,
    ):
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
        self.row_floats = n_kv_heads * head_dim
        self.row_bytes = self.row_floats * F32
        if max_context * self.row_bytes > device.limits.max_binding:
            raise gpu.GPUOutOfMemoryError(
                f"KVCache: a full context of {max_context} rows x {self.row_bytes} bytes per layer needs "
                f"{max_context * self.row_bytes} bytes in one binding, over this device's limit of "
                f"{device.limits.max_binding} bytes"
            )
        self.capacity = min(initial_capacity, max_context)
        self.k: list[gpu.Buffer] = []  # per layer, [capacity, n_kv_heads * head_dim] f32
        self.v: list[gpu.Buffer] = []  # per layer, [capacity, n_kv_heads * head_dim] f32
        for layer in range(n_layers):
            self.k.append(self._new_buffer("k", layer, self.capacity))
            self.v.append(self._new_buffer("v", layer, self.capacity))
        self._bound_ops: list[CacheBoundOp] = []
        self.generation = 0  # bumped at every growth, so holders of buffer references can tell

    def _new_buffer(self, kind: str, layer: int, rows: int) -> gpu.Buffer:
        return self.device.buffer(rows * self.row_bytes, gpu.STORAGE_USAGE, f"kv cache {kind} layer {layer}")

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
