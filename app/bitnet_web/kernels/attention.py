"""Causal grouped-query attention over the KV cache (shaders/attention.wgsl, attention_combine.wgsl).

Two paths, both built at construction, chosen per step by the number of tokens:
- decode (n_tokens <= scratch.max_tokens_split, normally 1): the sequence's tiles are dealt to up to
  MAX_SPLITS workgroups per KV head, then a combine dispatch merges their partial softmaxes, so a 4k
  context keeps 64 workgroups per KV head busy instead of one. Two dispatches.
- prefill (more tokens): one workgroup per (BQ tokens, KV head) walks all visible rows with an
  online softmax and writes the output directly. One dispatch. `attention_prefill.wgsl` (32 query
  rows x 32 keys per tile, register-blocked) where the head dim and workgroup memory allow it, else
  attention.wgsl's prefill path (8 query rows x 16 keys).
Built with `rope=` (the layer's RopeKV), a one-token step also folds RoPE + the KV append into the
attention kernel, and runs in a single dispatch (no split) while pos < DIRECT_MAX_TILES tiles; so do the
2..max_tokens_split rows of a speculative verify step (its DRAFT_ROWS variant), each row as its decode step.
One-token workgroups (decode, verify rows) walk their rows by lane groups where the device has
subgroups (attention.wgsl `attend_lanes`: no barrier inside the walk), else by 16-row tiles in
workgroup memory; the kernel checks the subgroup size itself and falls back to the tiles.
What this costs in a whole step, part by part (the dispatches, the combine, the tile loop's phases):
docs/performance.md, sessions 14 and 16 (`tools/bench_kernels.py --ablate none,combine,attention`,
`--walks tiles,lanes`).
"""

from __future__ import annotations

import math

from .. import gpu
from .common import STEP_PARAMS_WGSL, KernelCache, StepParams, subgroups_available, wgsl_enables
from .kv_cache import F32, KVCache
from .rope import RopeKV

WORKGROUP = 256  # invocations of the attention and combine workgroups (the WebGPU default maximum)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)  # HD / 4 must divide WORKGROUP
MAX_SPLITS = 64  # partial slots per KV head and token (a power of two: the combine's tree)
# Most workgroups one KV head's decode is split over (partials merged by the combine). With 5 KV heads,
# 52 splits are 260 workgroups, what the H200's 132 SMs run at once two a SM; 64 made one-row 2B-4T
# steps 4-5% longer wherever the used splits passed that (2.5k, 3.5k-4k rows). Verify steps of 3 and 7
# rows were shorter with 32 at 3.5k-4k, but a verify row must split as its decode step does
# (docs/performance.md, session 18; `tools/bench_kernels.py --walks lanes-c64,lanes-c52,lanes-c32`).
SPLIT_CAP = 52
# Fused decode up to this many tiles runs in one dispatch, without split + combine: past 128 rows one
# workgroup per KV head costs more than the combine dispatch (tools/bench_kernels.py --walks).
DIRECT_MAX_TILES = 8
# attention_prefill.wgsl: query rows per workgroup (tried largest first until workgroup memory fits) and
# query rows per thread (the workgroup has 16 * rows / RQ threads).
PREFILL_QUERY_ROWS = (32, 16)
PREFILL_ROWS_PER_THREAD = 4
PREFILL_KEYS = 32  # key rows per tile of attention_prefill.wgsl (its TK)
# The lane-group walk of one-token workgroups (attention.wgsl `attend_lanes`, where the device has
# subgroups): invocations sharing a K/V row on a GPU (at most; a CPU adapter's subgroups are narrower)
# and rows each lane group takes per step.
USE_LANES = True
LANES_GPU = 32
LANES_CPU = 8
LANE_ROWS = 2


def split_count(kv_len: int, tile: int, max_splits: int) -> int:
    """Workgroups per KV head of a one-token attention that sees kv_len cache rows: shaders/_split_plan.wgsl's
    rule (1 while the rows fit in DIRECT_MAX_TILES tiles, then one per tile up to SPLIT_CAP)."""
    n_tiles = -(-kv_len // tile)
    return 1 if kv_len <= DIRECT_MAX_TILES * tile else min(n_tiles, SPLIT_CAP, max_splits)


def tile_rows(head_dim: int) -> int:
    """Key rows per attention tile: a K tile is 2 vec4 per invocation (TILE * head_dim / 4 = 2 * WORKGROUP)."""
    return 2 * WORKGROUP * 4 // head_dim


def lane_shape(
    head_dim: int, group: int, cpu: bool, lane_rows: int | None = None, subgroup_min_size: int | None = None
) -> dict[str, int]:
    """The lane walk's constants: LANES invocations per row (each VPL vec4 columns), NLG lane groups
    (as many as the workgroup holds, fewer where their partials would not fit the K and V tiles'
    workgroup memory, which the final merge borrows), LANE_ROWS rows per group and step.

    LANES is at most the device's smallest subgroup where it is known, so every pipeline takes the lane
    walk (a device that picks a subgroup size per pipeline could otherwise run decode steps and verify
    rows by different walks, whose sums round differently)."""
    c4 = head_dim // 4
    lanes = min(LANES_CPU if cpu else LANES_GPU, c4, subgroup_min_size or c4)
    groups = WORKGROUP // lanes
    tiles_vec4 = tile_rows(head_dim) * (2 * c4 + 1)  # ks [TILE, C4 + 1] and vs [TILE, C4]
    while groups > 1 and groups * group * c4 > tiles_vec4:
        groups //= 2
    return dict(
        LANES=lanes,
        LANE_VECS=c4 // lanes,
        LANE_GROUPS=groups,
        LANE_ROWS=lane_rows or LANE_ROWS,
        LANE_LEVELS=lanes.bit_length() - 1,
        GQ=group,
    )


def max_query_heads_per_kv(head_dim: int) -> int:
    """Most query heads one KV head can serve: its query rows share one workgroup (one invocation per
    (query row, output vec4) and per (query row, tile row)). Models with more are run with their KV
    heads repeated (model/layout.py)."""
    return WORKGROUP // max(head_dim // 4, tile_rows(head_dim))


class AttentionScratch:
    """Partial results of split-sequence decode, shared by every layer's Attention op.

    acc   [max_tokens_split, n_heads, max_splits, head_dim] f32: unnormalized sum p * V per split
    stats [max_tokens_split, n_heads, max_splits] vec2<f32>: (max score, sum p) per split
    The size does not depend on `max_context` (splits are capped at max_splits, tiles dealt evenly).
    """

    def __init__(
        self,
        device: gpu.Device,
        n_heads: int,
        head_dim: int,
        max_context: int,
        max_tokens_split: int = 1,
        max_splits: int | None = None,
    ):
        max_splits = MAX_SPLITS if max_splits is None else max_splits
        # attention_combine.wgsl reduces the partials' maxima in one tree over a workgroup
        if max_splits & (max_splits - 1) or not 0 < max_splits <= WORKGROUP:
            raise ValueError(f"AttentionScratch: max_splits must be a power of two up to {WORKGROUP}, got {max_splits}")
        self.n_heads = n_heads
        self.head_dim = head_dim
        self.max_tokens_split = max_tokens_split
        self.max_splits = max_splits
        slots = max_tokens_split * n_heads * self.max_splits
        self.acc = device.buffer(slots * head_dim * F32, gpu.STORAGE_USAGE, "attention split partials")
        self.stats = device.buffer(slots * 2 * F32, gpu.STORAGE_USAGE, "attention split stats")


class Attention:
    """out[t, h*hd:(h+1)*hd] = softmax_j(q_t,h . k_j,g / sqrt(hd)) @ v_j,g over cache rows j <= pos + t,
    with g = h // (n_heads / n_kv_heads).

    q   [max_tokens, n_heads * head_dim] f32 (rotated, from RopeKV)
    out [max_tokens, n_heads * head_dim] f32
    K/V from `cache.k[layer]`, `cache.v[layer]` (f16 or f32: `cache.defines`), rows 0 .. pos + n_tokens - 1
    already written.

    With `rope` (the layer's RopeKV, writing into `q`), `record` runs the rotation too: for one token
    fused into the attention kernel (reading rope.qkv; one dispatch fewer), otherwise as rope's own
    dispatch first. The model then records only this op per layer.
    """

    def __init__(
        self,
        kernels: KernelCache,
        params: StepParams,
        cache: KVCache,
        layer: int,
        q: gpu.Buffer,
        out: gpu.Buffer,
        *,
        n_heads: int,
        max_tokens: int,
        scratch: AttentionScratch | None = None,
        scale: float | None = None,
        rope: RopeKV | None = None,
        tiled_prefill: bool = True,
        prefill_query_rows: int | None = None,
        prefill_rows_per_thread: int | None = None,
        lanes: bool | None = None,
    ):
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
                raise ValueError(
                    f"{what}: {name} buffer {buffer.label!r} has {buffer.nbytes} bytes, needs "
                    f"{max_tokens * row_bytes} for {max_tokens} tokens"
                )
        if rope is not None and (rope.cache is not cache or rope.layer != layer or rope.q_out is not q):
            raise ValueError(f"{what}: the RopeKV passed as `rope` must write this layer's cache and q buffer")
        if scratch is None:
            scratch = AttentionScratch(device, n_heads, head_dim, cache.max_context)
        if (scratch.n_heads, scratch.head_dim) != (n_heads, head_dim):
            raise ValueError(f"{what}: the AttentionScratch was made for other shapes")
        group = n_heads // n_kv_heads
        # One invocation per (query row, output vec4) and per (query row, tile row).
        self.tile = tile_rows(head_dim)
        max_query_rows = max_query_heads_per_kv(head_dim)
        if group > max_query_rows:
            raise ValueError(
                f"{what}: {group} query heads per KV head with head_dim {head_dim} exceed one "
                f"workgroup (at most {max_query_rows})"
            )
        self.block_tokens = max_query_rows // group  # BQ: tokens per prefill workgroup
        limit = device.limits.max_compute_workgroup_storage_size
        if _workgroup_bytes(self.block_tokens * group, head_dim) > limit:
            raise ValueError(
                f"{what}: needs {_workgroup_bytes(self.block_tokens * group, head_dim)} bytes of "
                f"workgroup memory, over this device's {limit}"
            )

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
        self.rope = rope
        # The fused path rotates whole vec4 columns: rotary dims must fill them.
        self.fused_rope = rope is not None and rope.table.rope_dim % 8 == 0
        shape = dict(
            STEP_PARAMS=STEP_PARAMS_WGSL,
            HQ=n_heads,
            HKV=n_kv_heads,
            HD=head_dim,
            TILE=self.tile,
            WG=WORKGROUP,
            MAX_SPLITS=scratch.max_splits,
            SPLIT_CAP=min(SPLIT_CAP, scratch.max_splits),
            DIRECT_TILES=DIRECT_MAX_TILES,
            SCALE=float(1.0 / math.sqrt(head_dim)) if scale is None else float(scale),
            ROPE_DIM=rope.table.rope_dim if rope is not None else head_dim,
            NEOX=rope.style == "neox" if rope is not None else True,
            SCORE_ITERS=head_dim // 32,  # the score and tile loops, unrolled by 8 (shaders/attention.wgsl)
            TILE_ITERS=self.tile // 8,
        )
        kv = cache.defines  # the cache's element type (shaders/_kv.wgsl)
        self.prefill_pipeline = kernels.pipeline("attention", defines=kv, BQ=self.block_tokens, SPLIT=False, **shape)
        # One-token workgroups (decode, verify rows) walk with lane groups where subgroups exist.
        self.lanes = (USE_LANES if lanes is None else lanes) and subgroups_available(device)
        one = dict(shape, BQ=1)
        if self.lanes:
            one.update(lane_shape(head_dim, group, device.is_cpu, LANE_ROWS, device.subgroup_min_size))
            one["enables"] = wgsl_enables(device, subgroups=True)
        lanes_kv = (*kv, "LANES") if self.lanes else kv
        self.tiled = None  # (pipeline, tokens per workgroup) of attention_prefill.wgsl, when it fits
        if tiled_prefill:
            self.tiled = _tiled_prefill_pipeline(
                kernels, shape, kv, group, prefill_query_rows, prefill_rows_per_thread or PREFILL_ROWS_PER_THREAD
            )
        # Split kernels write the output of a token whose rows fit one split themselves (DIRECT_OUT):
        # a queued verify step records them on an upper bound of its position (attention.wgsl)
        split_kv = (*lanes_kv, "DIRECT_OUT")
        self.split_pipeline = kernels.pipeline("attention", defines=split_kv, SPLIT=True, DIRECT_OUT_BINDING=6, **one)
        if self.fused_rope:
            rope_kv = (*lanes_kv, "ROPE")
            self.rope_split_pipeline = kernels.pipeline(
                "attention", defines=(*split_kv, "ROPE"), SPLIT=True, DIRECT_OUT_BINDING=7, **one
            )
            self.rope_direct_pipeline = kernels.pipeline("attention", defines=rope_kv, SPLIT=False, **one)
        # Verify rows (2..max_tokens_split tokens) with RoPE and the KV append fused in, where the
        # draft's rows fit in workgroup memory beside the tiles: one dispatch fewer per layer. Built
        # now on a GPU (compiled with the rest during the load); on a CPU adapter, which does not
        # draft by default, by `prepare_draft_rows` on first use.
        self.draft_rows_max = scratch.max_tokens_split if self.fused_rope and scratch.max_tokens_split > 1 else 0
        draft_bytes = 2 * self.draft_rows_max * head_dim * cache.np_dtype.itemsize  # draft_k, draft_v
        if _workgroup_bytes(group, head_dim) + draft_bytes > limit:
            self.draft_rows_max = 0
        self.draft_rows = 0  # verify rows up to this take the DRAFT_ROWS kernels (0: not built)
        self._rows_pipeline_args = dict(defines=(*lanes_kv, "DRAFT_ROWS"), MAX_DRAFT=self.draft_rows_max, **one)
        self._kernels = kernels
        self.combine_pipeline = kernels.pipeline(
            "attention_combine",
            STEP_PARAMS=STEP_PARAMS_WGSL,
            HQ=n_heads,
            HD=head_dim,
            TILE=self.tile,
            WG=WORKGROUP,
            MAX_SPLITS=scratch.max_splits,
            SPLIT_CAP=min(SPLIT_CAP, scratch.max_splits),
            DIRECT_TILES=DIRECT_MAX_TILES,
        )
        self.combine_group = device.bind_group(
            self.combine_pipeline, [params.buffer, scratch.acc, scratch.stats, out], f"attention combine {layer}"
        )
        self.rebind()
        cache.attach(self)
        if not device.is_cpu:
            self.prepare_draft_rows()

    def rebind(self) -> None:
        """Rebuild the bind groups that name the cache's buffers (after capacity growth)."""
        k, v = self.cache.k[self.layer], self.cache.v[self.layer]
        params, stats, label = self.params.buffer, self.scratch.stats, f"layer {self.layer}"
        self.prefill_group = self.device.bind_group(
            self.prefill_pipeline, [params, self.q, k, v, self.out, stats], f"attention prefill {label}"
        )
        if self.tiled is not None:
            self.tiled_group = self.device.bind_group(
                self.tiled[0], [params, self.q, k, v, self.out], f"tiled attention prefill {label}"
            )
        self.split_group = self.device.bind_group(
            self.split_pipeline, [params, self.q, k, v, self.scratch.acc, stats, self.out], f"attention split {label}"
        )
        if self.fused_rope:
            qkv, table = self.rope.qkv, self.rope.table.buffer
            self.rope_split_group = self.device.bind_group(
                self.rope_split_pipeline,
                [params, qkv, k, v, self.scratch.acc, stats, table, self.out],
                f"rope+attention split {label}",
            )
            self.rope_direct_group = self.device.bind_group(
                self.rope_direct_pipeline, [params, qkv, k, v, self.out, stats, table], f"rope+attention {label}"
            )
        self._bind_draft_rows()

    def prepare_draft_rows(self) -> None:
        """Build the verify-rows kernels (DRAFT_ROWS) if this device can run them and they are not yet."""
        if self.draft_rows or not self.draft_rows_max:
            return
        args = self._rows_pipeline_args
        self.rope_rows_split_pipeline = self._kernels.pipeline(
            "attention", SPLIT=True, **dict(args, defines=(*args["defines"], "DIRECT_OUT"), DIRECT_OUT_BINDING=7)
        )
        self.rope_rows_direct_pipeline = self._kernels.pipeline("attention", SPLIT=False, **args)
        self.draft_rows = self.draft_rows_max
        self._bind_draft_rows()

    def _bind_draft_rows(self) -> None:
        if self.draft_rows:
            k, v = self.cache.k[self.layer], self.cache.v[self.layer]
            params, stats, label = self.params.buffer, self.scratch.stats, f"layer {self.layer}"
            qkv, table = self.rope.qkv, self.rope.table.buffer
            self.rope_rows_split_group = self.device.bind_group(
                self.rope_rows_split_pipeline,
                [params, qkv, k, v, self.scratch.acc, stats, table, self.out],
                f"rope+attention rows split {label}",
            )
            self.rope_rows_direct_group = self.device.bind_group(
                self.rope_rows_direct_pipeline,
                [params, qkv, k, v, self.out, stats, table],
                f"rope+attention rows {label}",
            )

    def record(self, recorder: gpu.Recorder, n_tokens: int, pos: int | None = None) -> None:
        """Add this layer's attention (and RoPE + KV append when built with `rope`).

        `pos` (tokens already cached) is optional: given, the decode dispatch covers the splits its rows
        use (`split_count`) rounded up to a power of two (surplus ones exit at once), so the recorded
        command list, and with it the browser's replayed program, changes at a few sizes only, and a
        short context takes a single dispatch; without it the dispatch covers scratch.max_splits splits,
        valid for any position.
        """
        if not 0 < n_tokens <= self.max_tokens:
            raise ValueError(f"Attention layer {self.layer}: n_tokens {n_tokens} outside 1..{self.max_tokens}")
        max_splits = self.scratch.max_splits
        if pos is None:
            splits = max_splits
        else:
            used = split_count(pos + n_tokens, self.tile, max_splits)  # the last row's: the count only grows
            splits = min(max_splits, 1 << (used - 1).bit_length())
        if self.fused_rope and n_tokens == 1:
            if pos is not None and pos < DIRECT_MAX_TILES * self.tile:
                recorder.dispatch(self.rope_direct_pipeline, self.rope_direct_group, 1, self.n_kv_heads, 1)
            else:
                recorder.dispatch(self.rope_split_pipeline, self.rope_split_group, splits, self.n_kv_heads, 1)
                recorder.dispatch(self.combine_pipeline, self.combine_group, self.n_heads, 1)
            return
        if 1 < n_tokens <= self.draft_rows:  # a verify step: rows as their decode steps, RoPE fused
            if pos is not None and pos + n_tokens <= DIRECT_MAX_TILES * self.tile:
                recorder.dispatch(
                    self.rope_rows_direct_pipeline, self.rope_rows_direct_group, 1, self.n_kv_heads, n_tokens
                )
            else:
                recorder.dispatch(
                    self.rope_rows_split_pipeline, self.rope_rows_split_group, splits, self.n_kv_heads, n_tokens
                )
                recorder.dispatch(self.combine_pipeline, self.combine_group, self.n_heads, n_tokens)
            return
        if self.rope is not None:
            self.rope.record(recorder, n_tokens)
        if n_tokens <= self.scratch.max_tokens_split:
            recorder.dispatch(self.split_pipeline, self.split_group, splits, self.n_kv_heads, n_tokens)
            recorder.dispatch(self.combine_pipeline, self.combine_group, self.n_heads, n_tokens)
        elif self.tiled is not None:
            pipeline, block = self.tiled
            recorder.dispatch(pipeline, self.tiled_group, -(-n_tokens // block), self.n_kv_heads, 1)
        else:
            recorder.dispatch(
                self.prefill_pipeline, self.prefill_group, 1, self.n_kv_heads, -(-n_tokens // self.block_tokens)
            )


def _tiled_prefill_pipeline(
    kernels: KernelCache,
    shape: dict,
    defines: tuple[str, ...],
    group: int,
    query_rows: int | None,
    rows_per_thread: int,
) -> tuple[gpu.Pipeline, int] | None:
    """attention_prefill.wgsl's pipeline and tokens per workgroup for these shapes, or None where it
    does not apply (head_dim not a multiple of 64, more query heads per KV head than rows, or too
    little workgroup memory / too few invocations on this device for every row count)."""
    head_dim, limits = shape["HD"], kernels.device.limits
    c4 = head_dim // 4
    if head_dim % 64 or rows_per_thread not in (1, 2, 4, 8):
        return None
    for rows in (query_rows,) if query_rows else PREFILL_QUERY_ROWS:
        threads = 16 * rows // rows_per_thread
        # qs [rows, C4] + kv [TK, C4 + 1] vec4, scores [rows, TK + 1] + three per-row f32
        nbytes = 16 * (rows * c4 + PREFILL_KEYS * (c4 + 1)) + 4 * rows * (PREFILL_KEYS + 4)
        if (
            rows % rows_per_thread
            or rows < group
            or nbytes > limits.max_compute_workgroup_storage_size
            or threads > limits.max_compute_invocations_per_workgroup
        ):
            continue
        block = rows // group
        keep = ("STEP_PARAMS", "HQ", "HKV", "HD", "SCALE")
        pipeline = kernels.pipeline(
            "attention_prefill",
            defines=defines,
            BQ=block,
            NQP=rows,
            RQ=rows_per_thread,
            WG=threads,
            CV=c4 // 16,
            KV_ITEMS=PREFILL_KEYS * c4 // threads,
            Q_ITEMS=rows * c4 // threads,
            **{k: shape[k] for k in keep},
        )
        return pipeline, block
    return None


def _workgroup_bytes(query_rows: int, head_dim: int) -> int:
    # ks [TILE, HD + 4] + vs [TILE, HD] + qs [NQ, HD] + probs, red [NQ, TILE] + m/l/alpha [NQ], all 4-byte;
    # the lane walk's new row (2 HD, as f32 at most), merge (m, l) [WG / 2] and flag
    tile = tile_rows(head_dim)
    lanes = 2 * head_dim + WORKGROUP + 1
    return (tile * (2 * head_dim + 4) + query_rows * (head_dim + 2 * tile + 3) + lanes) * F32
