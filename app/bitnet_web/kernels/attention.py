"""Causal grouped-query attention over the KV cache (shaders/attention.wgsl, attention_combine.wgsl).

Two paths, both built at construction, chosen per step by the number of tokens:
- decode (n_tokens <= split_max_tokens, normally 1): the sequence is split into tiles of TILE rows,
  one workgroup per (tile, KV head), then a combine dispatch merges the partial softmaxes. A 4k
  context runs ~64 workgroups per KV head instead of one. Two dispatches.
- prefill (more tokens): one workgroup per (BQ tokens, KV head) walks all visible rows with an
  online softmax and writes the output directly. One dispatch.
"""

from __future__ import annotations

import math

from .. import gpu
from .common import STEP_PARAMS_WGSL, KernelCache, StepParams
from .kv_cache import F32, KVCache

TILE = 64  # key rows per tile = attention workgroup size
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # HD / 4 must divide TILE
PREFILL_QUERY_ROWS = 16  # target query rows (tokens x heads per KV head) per prefill workgroup


class AttentionScratch:
    """Partial results of split-sequence decode, shared by every layer's Attention op.

    acc   [max_tokens_split, n_heads, max_splits, head_dim] f32: unnormalized sum p * V per tile
    stats [max_tokens_split, n_heads, max_splits] vec2<f32>: (max score, sum p) per tile
    """

    def __init__(self, device: gpu.Device, n_heads: int, head_dim: int, max_context: int,
                 max_tokens_split: int = 1):
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.max_tokens_split = max_tokens_split
        self.max_splits = -(-max_context // TILE)
        slots = max_tokens_split * n_heads * self.max_splits
        self.acc = device.buffer(slots * head_dim * F32, gpu.STORAGE_USAGE, "attention split partials")
        self.stats = device.buffer(slots * 2 * F32, gpu.STORAGE_USAGE, "attention split stats")


class Attention:
    """out[t, h*hd:(h+1)*hd] = softmax_j(q_t,h . k_j,g / sqrt(hd)) @ v_j,g over cache rows j <= pos + t,
    with g = h // (n_heads / n_kv_heads).

    q   [max_tokens, n_heads * head_dim] f32 (rotated, from RopeKV)
    out [max_tokens, n_heads * head_dim] f32
    K/V from `cache.k[layer]`, `cache.v[layer]`, rows 0 .. pos + n_tokens - 1 already written.
    """

    def __init__(self, kernels: KernelCache, params: StepParams, cache: KVCache, layer: int, q: gpu.Buffer,
                 out: gpu.Buffer, *, n_heads: int, max_tokens: int, scratch: AttentionScratch | None = None,
                 scale: float | None = None):
        device = kernels.device
        n_kv_heads, head_dim = cache.n_kv_heads, cache.head_dim
        what = f"Attention layer {layer}"
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{what}: head_dim {head_dim} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
        if n_heads % n_kv_heads:
            raise ValueError(f"{what}: n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        if not 0 <= layer < cache.n_layers:
            raise ValueError(f"{what} is outside the cache's {cache.n_layers} layers")
        row_bytes = n_heads * head_dim * F32
        for buffer, name in ((q, "q"), (out, "out")):
            if buffer.nbytes < max_tokens * row_bytes:
                raise ValueError(f"{what}: {name} buffer {buffer.label!r} has {buffer.nbytes} bytes, needs "
                                 f"{max_tokens * row_bytes} for {max_tokens} tokens")
        if scratch is None:
            scratch = AttentionScratch(device, n_heads, head_dim, cache.max_context)
        if (scratch.n_heads, scratch.head_dim) != (n_heads, head_dim) or \
                scratch.max_splits * TILE < cache.max_context:
            raise ValueError(f"{what}: the AttentionScratch was made for other shapes")
        group = n_heads // n_kv_heads
        self.block_tokens = max(1, PREFILL_QUERY_ROWS // group)  # BQ of the prefill kernel
        limit = device.limits.max_compute_workgroup_storage_size
        while self.block_tokens > 1 and _workgroup_bytes(self.block_tokens * group, head_dim) > limit:
            self.block_tokens -= 1
        if _workgroup_bytes(group, head_dim) > limit:
            raise ValueError(f"{what}: {group} query heads per KV head x head_dim {head_dim} need "
                             f"{_workgroup_bytes(group, head_dim)} bytes of workgroup memory, over {limit}")

        self.device = device
        self.params = params
        self.cache = cache
        self.layer = layer
        self.q = q
        self.out = out
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.max_tokens = max_tokens
        self.scratch = scratch
        shape = dict(STEP_PARAMS=STEP_PARAMS_WGSL, HQ=n_heads, HKV=n_kv_heads, HD=head_dim, TILE=TILE,
                     MAX_SPLITS=scratch.max_splits,
                     SCALE=float(1.0 / math.sqrt(head_dim)) if scale is None else float(scale))
        self.prefill_pipeline = kernels.pipeline("attention", BQ=self.block_tokens, SPLIT=False, **shape)
        self.split_pipeline = kernels.pipeline("attention", BQ=1, SPLIT=True, **shape)
        self.combine_pipeline = kernels.pipeline(
            "attention_combine", STEP_PARAMS=STEP_PARAMS_WGSL, HQ=n_heads, HD=head_dim, TILE=TILE,
            MAX_SPLITS=scratch.max_splits,
        )
        self.combine_group = device.bind_group(
            self.combine_pipeline, [params.buffer, scratch.acc, scratch.stats, out], f"attention combine {layer}"
        )
        self.rebind()
        cache.attach(self)

    def rebind(self) -> None:
        """Rebuild the bind groups that name the cache's buffers (after capacity growth)."""
        k, v = self.cache.k[self.layer], self.cache.v[self.layer]
        self.prefill_group = self.device.bind_group(
            self.prefill_pipeline, [self.params.buffer, self.q, k, v, self.out, self.scratch.stats],
            f"attention prefill layer {self.layer}",
        )
        self.split_group = self.device.bind_group(
            self.split_pipeline, [self.params.buffer, self.q, k, v, self.scratch.acc, self.scratch.stats],
            f"attention split layer {self.layer}",
        )

    def record(self, recorder: gpu.Recorder, n_tokens: int, pos: int | None = None) -> None:
        """Add this layer's attention. `pos` (tokens already cached), when given, trims the decode
        dispatch to the tiles in use; without it every tile of the current capacity is dispatched and
        the unused ones exit at once (so a recorded step stays valid for any pos)."""
        if not 0 < n_tokens <= self.max_tokens:
            raise ValueError(f"Attention layer {self.layer}: n_tokens {n_tokens} outside 1..{self.max_tokens}")
        if n_tokens <= self.scratch.max_tokens_split:
            rows = self.cache.capacity if pos is None else pos + n_tokens
            recorder.dispatch(self.split_pipeline, self.split_group, -(-rows // TILE), self.n_kv_heads, n_tokens)
            recorder.dispatch(self.combine_pipeline, self.combine_group, self.n_heads, n_tokens)
        else:
            recorder.dispatch(self.prefill_pipeline, self.prefill_group, 1, self.n_kv_heads,
                              -(-n_tokens // self.block_tokens))


def _workgroup_bytes(query_rows: int, head_dim: int) -> int:
    # qs [NQ, HD] + probs [NQ, TILE] + red [NQ, TILE], all 4-byte
    return query_rows * (head_dim + 2 * TILE) * F32
