"""F16 token embedding, LM head and GPU argmax.

The tied embedding of BitNet 2B-4T is 128256 x 2560 F16 (657 MB): more than one storage binding on
many devices (lavapipe 128 MiB, some browsers 128-256 MiB), so `F16Matrix` splits it by rows into
shards and both ops run one dispatch per shard. On a device that binds it whole that is one
dispatch each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import gpu
from .common import (
    SMALL_T_MAX,
    STEP_PARAMS_WGSL,
    KernelCache,
    StepParams,
    ceil_div,
    check_token_pick,
    subgroups_available,
    wgsl_enables,
)

EMBED_WORKGROUP = 64
# The head's threads per workgroup fix each logit's summation order, so one-row (decode) and small-T
# (verify) heads must share it: a verify row's logits are then its decode step's, bit for bit. 64
# threads (a 2560-wide row: 5 of its 320 16-byte chunks per thread) read the 2B-4T head as fast as 160
# for one row and cost verify steps of 3-7 rows 1-2% less (fewer subgroup sums per weight read;
# docs/performance.md, session 23).
LM_HEAD_WORKGROUP = 64
LM_HEAD_ROWS = 3  # rows per workgroup of the one-row head: 128256 rows -> 42752 workgroups (limit 65535)
MIN_SUBGROUP_SIZE = 4  # WebGPU's smallest subgroup size: bounds the reduction slots per workgroup
LM_HEAD_TOKENS = 4  # token rows per workgroup when logits of several tokens are wanted
# Matrix rows per workgroup of the small-T head (all 2..SMALL_T_MAX rows in one pass); each thread holds
# ROWS x T accumulators, so from LONG_T_TOKENS token rows at most LONG_T_ROWS (H200, 64 threads: 4 best
# for 2-5 rows, 3 and 4 alike at 7, 3 best for 8-9).
LM_HEAD_SMALL_T_ROWS = 4
LM_HEAD_LONG_T_TOKENS = 8
LM_HEAD_LONG_T_ROWS = 3
# Kept rows a rescoring workgroup computes at a time (their loads in flight together); each row's
# arithmetic is the one-row head's whatever the count
RESCORE_ROWS = 4
ARGMAX_WORKGROUP = 256
ARGMAX_PER_THREAD = 4  # logits per thread in the first pass: 128256 -> 126 workgroups


class EmbeddingShapeError(ValueError):
    """An embedding / LM-head matrix or binding with a shape the kernels cannot handle."""


@dataclass
class F16Matrix:
    """A (n_rows, n_cols) F16 matrix on the GPU, split by rows into shards of at most one binding.

    shards: [(first row, end row, buffer (end - first, n_cols) f16)]
    """

    shards: list[tuple[int, int, gpu.Buffer]]
    n_rows: int
    n_cols: int
    label: str

    @classmethod
    def upload(cls, device: gpu.Device, matrix: np.ndarray, label: str) -> F16Matrix:
        """Upload a 2-D float array as F16 (float32/bfloat16-as-float inputs are rounded to F16)."""
        matrix = np.asarray(matrix)
        if matrix.ndim != 2:
            raise EmbeddingShapeError(f"{label}: expected a 2-D matrix, got shape {matrix.shape}")
        n_rows, n_cols = matrix.shape
        if n_cols % 8 or n_cols <= 0 or n_rows <= 0:
            raise EmbeddingShapeError(f"{label}: {n_cols} columns; the kernels need a positive multiple of 8")
        if matrix.dtype != np.float16:
            if np.abs(matrix).max() > 65504:
                raise EmbeddingShapeError(f"{label}: values beyond the F16 range cannot be stored as F16")
            matrix = matrix.astype(np.float16)
        shards = []
        for start, stop in gpu.shard_rows(n_rows, 2 * n_cols, device.limits.max_binding):
            buffer = device.buffer(2 * n_cols * (stop - start), label=f"{label} rows {start}:{stop}")
            device.upload(buffer, 0, np.ascontiguousarray(matrix[start:stop]))
            shards.append((start, stop, buffer))
        return cls(shards, n_rows, n_cols, label)

    def release(self, device: gpu.Device) -> None:
        for _, _, buffer in self.shards:
            device.release(buffer)


@dataclass
class Int8Matrix:
    """An int8 copy of a (n_rows, n_cols) matrix with one f32 scale per row (row = scale * q), for
    an LM head that reads half the bytes of F16. Lossy: each row is rounded to 255 levels of its
    largest magnitude. Sharded by rows like F16Matrix; `scales` is one (n_rows,) f32 buffer.
    """

    shards: list[tuple[int, int, gpu.Buffer]]
    scales: gpu.Buffer
    n_rows: int
    n_cols: int
    label: str

    QUANTIZE_ROWS = 8192  # rows converted at a time: bounds the float32 temporaries on the host

    @staticmethod
    def quantize(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(int8 values, f32 scales) with matrix ~= values * scales[:, None]."""
        rows = np.asarray(matrix, dtype=np.float32)
        scales = np.abs(rows).max(axis=1) / 127.0
        safe = np.where(scales > 0, scales, 1.0)
        values = np.clip(np.rint(rows / safe[:, None]), -127, 127).astype(np.int8)
        return values, scales.astype(np.float32)

    @classmethod
    def upload(cls, device: gpu.Device, matrix: np.ndarray, label: str) -> Int8Matrix:
        matrix = np.asarray(matrix)
        if matrix.ndim != 2:
            raise EmbeddingShapeError(f"{label}: expected a 2-D matrix, got shape {matrix.shape}")
        n_rows, n_cols = matrix.shape
        if n_cols % 16 or n_cols <= 0 or n_rows <= 0:
            raise EmbeddingShapeError(f"{label}: {n_cols} columns; the int8 head needs a positive multiple of 16")
        scales = np.empty(n_rows, dtype=np.float32)
        shards = []
        for start, stop in gpu.shard_rows(n_rows, n_cols, device.limits.max_binding):
            buffer = device.buffer(n_cols * (stop - start), label=f"{label} int8 rows {start}:{stop}")
            for first in range(start, stop, cls.QUANTIZE_ROWS):
                last = min(first + cls.QUANTIZE_ROWS, stop)
                values, scales[first:last] = cls.quantize(matrix[first:last])
                device.upload(buffer, n_cols * (first - start), values)
            shards.append((start, stop, buffer))
        scale_buffer = device.buffer(4 * n_rows, label=f"{label} int8 row scales")
        device.upload(scale_buffer, 0, scales)
        return cls(shards, scale_buffer, n_rows, n_cols, label)

    def release(self, device: gpu.Device) -> None:
        for _, _, buffer in self.shards:
            device.release(buffer)
        device.release(self.scales)


class EmbeddingLookup:
    """token_ids (T,) u32 -> x (T, n_cols) f32: rows of an F16 matrix, one dispatch per shard."""

    def __init__(
        self,
        kernels: KernelCache,
        table: F16Matrix,
        token_ids: gpu.Buffer,
        x: gpu.Buffer,
        step: StepParams | None = None,
        label: str = "embedding",
    ):
        d = table.n_cols
        if x.nbytes < 4 * d or token_ids.nbytes < 4:
            raise EmbeddingShapeError(
                f"{label}: x ({x.nbytes} bytes) must hold a row of {d} f32 and token_ids "
                f"({token_ids.nbytes} bytes) at least one id"
            )
        self.max_tokens = min(x.nbytes // (4 * d), token_ids.nbytes // 4)
        self.groups_x = ceil_div(d // 4, EMBED_WORKGROUP)
        self.dispatches = []
        for i, (start, stop, buffer) in enumerate(table.shards):
            pipeline = kernels.pipeline(
                "embedding", D4=d // 4, START=start, STOP=stop, V=table.n_rows, FIRST_SHARD=i == 0, WG=EMBED_WORKGROUP
            )
            bind = kernels.device.bind_group(pipeline, [token_ids, buffer, x], f"{label} shard {i}")
            self.dispatches.append((pipeline, bind))

    def record(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        for pipeline, bind in self.dispatches:
            recorder.dispatch(pipeline, bind, self.groups_x, n_tokens)


class LMHead:
    """x (T, n_cols) f32 -> logits (T, n_rows) f32 = x @ matrix.T, one dispatch per shard.

    `record(recorder, n)`: logits for rows 0..n-1 of x. For n > 1 the kernel bounds token rows by
    StepParams.n_tokens, which must then equal n (all-logits prefill). For 2..SMALL_T_MAX rows (a
    speculative verify step) one workgroup covers all n rows, so the matrix is read once, not once
    per LM_HEAD_TOKENS rows; `small_t_rows` sets its matrix rows per workgroup.
    """

    def __init__(
        self,
        kernels: KernelCache,
        matrix: F16Matrix | Int8Matrix,
        x: gpu.Buffer,
        logits: gpu.Buffer,
        step: StepParams,
        label: str = "lm_head",
        rows_per_workgroup: int = LM_HEAD_ROWS,
        workgroup_size: int = LM_HEAD_WORKGROUP,
        small_t_rows: int = LM_HEAD_SMALL_T_ROWS,
    ):
        d, v = matrix.n_cols, matrix.n_rows
        int8 = isinstance(matrix, Int8Matrix)
        if x.nbytes < 4 * d or logits.nbytes < 4 * v:
            raise EmbeddingShapeError(
                f"{label}: x ({x.nbytes} bytes) must hold a row of {d} f32 and logits "
                f"({logits.nbytes} bytes) a row of {v} f32"
            )
        self.max_tokens = min(x.nbytes // (4 * d), logits.nbytes // (4 * v))
        self.logits = logits
        device = kernels.device
        limit = device.limits.max_compute_workgroups_per_dimension
        subgroups = subgroups_available(device)
        enables = wgsl_enables(device, subgroups=subgroups)
        chunks = d // (16 if int8 else 8)  # 16-byte loads per row
        # WHOLE: every thread's chunks are inside the row, so the kernel needs no clamps or zero selects
        whole = chunks % workgroup_size == 0
        shape_defines = (("SUBGROUPS",) if subgroups else ()) + (("WHOLE",) if whole else ())
        slots = ceil_div(workgroup_size, MIN_SUBGROUP_SIZE) if subgroups else workgroup_size
        # Token rows per workgroup of the all-logits variant: as many as fit WebGPU's default 16 KB of
        # workgroup memory (browsers grant more only when asked; the speed difference is small).
        room = min(device.limits.max_compute_workgroup_storage_size, 16384)
        self.multi_tokens = next((t for t in (LM_HEAD_TOKENS, 2) if 4 * rows_per_workgroup * t * slots + 4 <= room), 1)
        workgroup_bytes = 4 * rows_per_workgroup * self.multi_tokens * slots + 4
        if workgroup_bytes > room:
            raise EmbeddingShapeError(
                f"{label}: {rows_per_workgroup} rows x {workgroup_size} threads need "
                f"{workgroup_bytes} bytes of workgroup memory, over the device's "
                f"{device.limits.max_compute_workgroup_storage_size}"
            )
        if workgroup_size > device.limits.max_compute_invocations_per_workgroup:
            raise EmbeddingShapeError(
                f"{label}: {workgroup_size} threads per workgroup, over the device's "
                f"{device.limits.max_compute_invocations_per_workgroup}"
            )
        self.single, self.multi = [], []
        self._small_t_args = (kernels, matrix, x, logits, step, label, enables, shape_defines, slots, room)
        self._small_t_rows = small_t_rows
        self._shard_constants: list[dict[str, int]] = []
        self._small: dict[int, list[tuple[gpu.Pipeline, gpu.BindGroup, int]]] = {}
        for i, (start, stop, buffer) in enumerate(matrix.shards):
            # more rows per workgroup where a shard would need more workgroups than a dispatch allows
            # (a vocabulary over 196,605 rows at 3): rows per workgroup leave each logit's sums as they are
            rows = max(rows_per_workgroup, ceil_div(stop - start, limit))
            groups = ceil_div(stop - start, rows)
            if 4 * rows * self.multi_tokens * slots + 4 > room:
                raise EmbeddingShapeError(
                    f"{label}: a shard of {stop - start} rows needs {rows} rows per workgroup, whose partial "
                    f"sums need more than the {room} bytes of workgroup memory allowed"
                )
            common = dict(
                D8=chunks,
                SHARD_ROWS=stop - start,
                START=start,
                V=v,
                ROWS=rows,
                WG=workgroup_size,
                SLOTS=slots,
                ITERS=ceil_div(chunks, workgroup_size),
            )
            self._shard_constants.append(common)
            variant = shape_defines + (("INT8",) if int8 else ())
            extra = [matrix.scales] if int8 else []
            one = kernels.pipeline("lm_head", enables=enables, defines=variant, TOK=1, **common)
            many = kernels.pipeline(
                "lm_head",
                enables=enables,
                defines=variant + ("MULTI",),
                TOK=self.multi_tokens,
                STEP_PARAMS=STEP_PARAMS_WGSL,
                **common,
            )
            self.single.append((one, device.bind_group(one, [buffer, x, logits, *extra], f"{label} shard {i}"), groups))
            self.multi.append(
                (
                    many,
                    device.bind_group(
                        many, [buffer, x, logits, *extra, step.buffer], f"{label} shard {i} (all tokens)"
                    ),
                    groups,
                )
            )
        self._single_bounded: list[tuple[gpu.Pipeline, gpu.BindGroup, int]] | None = None
        # rows up to which one pass covers all tokens (longer steps: passes of multi_tokens rows)
        fits = [n for n in range(2, min(SMALL_T_MAX, self.max_tokens) + 1) if self._small_t_shape(n)]
        self.small_max = max(fits, default=1)

    def _small_t_shape(self, n_tokens: int) -> int | None:
        """Matrix rows per workgroup for `n_tokens` rows in one pass, or None where none fits."""
        kernels, matrix, _, _, _, _, _, _, slots, room = self._small_t_args
        rows = self._small_t_rows
        if n_tokens >= LM_HEAD_LONG_T_TOKENS:
            rows = min(rows, LM_HEAD_LONG_T_ROWS)
        largest = max(stop - start for start, stop, _ in matrix.shards)
        limit = kernels.device.limits.max_compute_workgroups_per_dimension
        rows = max(rows, ceil_div(largest, limit))  # as for the one-row head (__init__)
        while rows > 1 and 4 * rows * n_tokens * slots + 4 > room:
            rows //= 2
        return None if 4 * rows * n_tokens * slots + 4 > room or ceil_div(largest, rows) > limit else rows

    def small_t(self, n_tokens: int) -> list[tuple[gpu.Pipeline, gpu.BindGroup, int]]:
        """(pipeline, bindings, workgroups) per shard for exactly `n_tokens` (2..SMALL_T_MAX) rows, built
        on first use, with `small_t_rows` matrix rows per workgroup, lowered until the partial sums
        fit the workgroup memory."""
        found = self._small.get(n_tokens)
        if found is not None:
            return found
        kernels, matrix, x, logits, step, label, enables, shape_defines, slots, room = self._small_t_args
        if not 2 <= n_tokens <= self.small_max:
            raise EmbeddingShapeError(f"{label}: the small-T head takes 2..{self.small_max} rows, got {n_tokens}")
        rows = self._small_t_shape(n_tokens)
        if rows is None:
            raise EmbeddingShapeError(f"{label}: no workgroup shape for {n_tokens} rows fits this device's limits")
        int8 = isinstance(matrix, Int8Matrix)
        device = kernels.device
        variant = shape_defines + (("INT8",) if int8 else ()) + ("MULTI",)
        extra = [matrix.scales] if int8 else []
        found = []
        for i, (start, stop, buffer) in enumerate(matrix.shards):
            constants = {**self._shard_constants[i], "ROWS": rows}
            pipeline = kernels.pipeline(
                "lm_head", enables=enables, defines=variant, TOK=n_tokens, STEP_PARAMS=STEP_PARAMS_WGSL, **constants
            )
            bind = device.bind_group(
                pipeline, [buffer, x, logits, *extra, step.buffer], f"{label} shard {i} rows={n_tokens}"
            )
            found.append((pipeline, bind, ceil_div(stop - start, rows)))
        self._small[n_tokens] = found
        return found

    def single_bounded(self) -> list[tuple[gpu.Pipeline, gpu.BindGroup, int]]:
        """The one-row head that reads StepParams.n_tokens (0: it leaves at once), per shard: the
        single-row kernel's arithmetic, for steps whose row count is written on the GPU (a speculative
        draft-off step past the reply's end). Built on first use."""
        if self._single_bounded is None:
            kernels, matrix, x, logits, step, label, enables, shape_defines, _, _ = self._small_t_args
            variant = shape_defines + (("INT8",) if isinstance(matrix, Int8Matrix) else ()) + ("MULTI",)
            extra = [matrix.scales] if isinstance(matrix, Int8Matrix) else []
            found = []
            for i, ((_, _, groups), constants) in enumerate(zip(self.single, self._shard_constants, strict=True)):
                pipeline = kernels.pipeline(
                    "lm_head", enables=enables, defines=variant, TOK=1, STEP_PARAMS=STEP_PARAMS_WGSL, **constants
                )
                buffer = matrix.shards[i][2]
                bind = kernels.device.bind_group(
                    pipeline, [buffer, x, logits, *extra, step.buffer], f"{label} shard {i} (bounded)"
                )
                found.append((pipeline, bind, groups))
            self._single_bounded = found
        return self._single_bounded

    def rescoring(
        self,
        upper: gpu.Buffer,
        keys: gpu.Buffer,
        partials: gpu.Buffer,
        slice_rows: int,
        key_slots: int,
        vocab_size: int,
        groups: list[int],
        top_k: bool = False,
        key_stride: int | None = None,
        into_logits: bool = False,
        bounded_by: StepParams | None = None,
    ) -> list[tuple[gpu.Pipeline, gpu.BindGroup, int]]:
        """(pipeline, bindings, workgroups) per shard of lm_head.wgsl's RESCORE variant for
        kernels/head_screen.py: the logits of the rows an int8 screen kept, by this head's one-row
        arithmetic (its threads, chunks and slots; RESCORE_ROWS kept rows at a time), so they are the
        bits `record(recorder, 1)` would write. Shard i's `groups[i]` workgroups write their best from
        partials[sum(groups[:i])] (token row t, dispatched as the y dimension: from t * sum(groups),
        reading its row of x, upper and keys); rows from `vocab_size` on are never kept (as Argmax scans).
        `top_k`: the TOPK variant, where `partials` is a candidate list (shaders/_candidates.wgsl) that
        gets the rows reaching the key at keys[key_slots] (shaders/lm_head_screen_tau.wgsl).
        `key_stride`: words between token rows' keys (default key_slots, + 1 with top_k). `into_logits`
        (with top_k): `partials` is a logits buffer [rows, V] whose rows get the kept rows' logits and
        -inf elsewhere. `bounded_by`: StepParams whose n_tokens bounds the token rows."""
        kernels, matrix, x, _, _, label, enables, shape_defines, _, _ = self._small_t_args
        if isinstance(matrix, Int8Matrix):
            raise EmbeddingShapeError(f"{label}: an int8 head has no exact logits to rescore")
        found, base = [], 0
        for i, ((_, _, buffer), count) in enumerate(zip(matrix.shards, groups, strict=True)):
            constants = {**self._shard_constants[i], "ROWS": RESCORE_ROWS}
            pipeline = kernels.pipeline(
                "lm_head",
                enables=enables,
                defines=shape_defines
                + ("RESCORE",)
                + (("TOPK",) if top_k else ())
                + (("LOGITS",) if into_logits else ())
                + (("BOUNDED",) if bounded_by else ()),
                TOK=1,
                KEY_STRIDE=key_slots + top_k if key_stride is None else key_stride,
                STEP_PARAMS=STEP_PARAMS_WGSL,
                SLICE=slice_rows,
                KEY_SLOTS=key_slots,
                PART_BASE=base,
                PART_ROW=sum(groups),
                VOCAB=vocab_size,
                **constants,
            )
            binds = [buffer, x, upper, keys, partials] + ([bounded_by.buffer] if bounded_by else [])
            bind = kernels.device.bind_group(pipeline, binds, f"{label} rescore {i}")
            found.append((pipeline, bind, count))
            base += count
        return found

    def record(self, recorder: gpu.Recorder, n_tokens: int = 1, bounded: bool = False) -> None:
        """`bounded`: one row whose StepParams are written on the GPU and may say 0 rows (more rows
        always read them)."""
        if n_tokens == 1:
            for pipeline, bind, groups in self.single_bounded() if bounded else self.single:
                recorder.dispatch(pipeline, bind, groups)
        elif n_tokens <= self.small_max:
            for pipeline, bind, groups in self.small_t(n_tokens):
                recorder.dispatch(pipeline, bind, groups)
        else:
            token_groups = ceil_div(n_tokens, self.multi_tokens)
            for pipeline, bind, groups in self.multi:
                recorder.dispatch(pipeline, bind, groups, token_groups)


class Argmax:
    """out_ids[slot] = argmax(logits[row]) on the GPU (greedy decoding without a read-back).

    Two dispatches (argmax.wgsl): many workgroups each find the best of a span of logits, then
    one workgroup combines their partial results (kept in a small buffer owned by the op).
    """

    def __init__(
        self,
        kernels: KernelCache,
        logits: gpu.Buffer,
        out_ids: gpu.Buffer,
        vocab_size: int,
        slot: int = 0,
        row: int = 0,
        label: str = "argmax",
        per_thread: int = ARGMAX_PER_THREAD,
    ):
        check_token_pick(label, logits, out_ids, vocab_size, row, slot, EmbeddingShapeError)
        device = kernels.device
        subgroups = subgroups_available(device)
        self.groups = ceil_div(vocab_size, ARGMAX_WORKGROUP * per_thread)
        self.partials = device.buffer(8 * self.groups, label=f"{label} partials")  # (groups,) vec2<u32>
        enables = wgsl_enables(device, subgroups=subgroups)
        sg = ("SUBGROUPS",) if subgroups else ()
        constants = dict(V=vocab_size, ROW=row, SLOT=slot, WG=ARGMAX_WORKGROUP, PER=per_thread)
        self.partial = kernels.pipeline("argmax", enables=enables, defines=sg, **constants)
        self.combine = kernels.pipeline("argmax", enables=enables, defines=sg + ("COMBINE",), **constants)
        self.partial_bind = device.bind_group(self.partial, [logits, self.partials], f"{label} partial")
        self.combine_bind = device.bind_group(self.combine, [self.partials, out_ids], f"{label} combine")
        self.pipeline = self.partial  # the first dispatch (tests inspect its variant)

    def record(self, recorder: gpu.Recorder, n_tokens: int = 1) -> None:
        recorder.dispatch(self.partial, self.partial_bind, self.groups)
        recorder.dispatch(self.combine, self.combine_bind, 1)

    def release(self, device: gpu.Device) -> None:
        device.release(self.partials)
