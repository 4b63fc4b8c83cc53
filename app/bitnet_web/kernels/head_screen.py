"""Greedy decoding's LM head in two passes: an int8 screen, then the exact logits of the rows that can win.

The F16 head is a decode step's largest read (657 MB a token for 2B-4T). Greedy decoding needs only
its argmax. `Int8HeadCopy` is an int8 copy of the head (made on the GPU from the F16 rows at load,
half their bytes) with one scale and one error norm per row, such that every F16 logit lies within
errs[r] * ||x||_2 of the int8 logit (shaders/lm_head_screen.wgsl says why). `ScreenedArgmax`, per
token row of a decode step or a greedy verify step:

    screen   (lm_head_screen.wgsl)  int8 logits -> upper bounds [V], the best lower bound (atomic keys)
    rescore  (lm_head.wgsl RESCORE) rows whose upper bound reaches it: their F16 logits, computed by
                                    the one-row head's own arithmetic, and each slice's best
    combine  (argmax.wgsl SCREENED) the best of the slices -> out_ids[slot + t]; clears the keys

The argmax's row always survives the screen and its logit is the F16 head's bit for bit, so the token
is exactly `Argmax` over `LMHead`'s logits (ties to the smaller index, NaN never wins): decode steps and
verify rows choose alike, screened or not. The logits buffer is not written. Three dispatches, like
LMHead + Argmax.
"""

from __future__ import annotations

from .. import gpu
from .common import STEP_PARAMS_WGSL, KernelCache, StepParams, ceil_div, subgroups_available, wgsl_enables
from .embedding import (
    ARGMAX_PER_THREAD,
    ARGMAX_WORKGROUP,
    MIN_SUBGROUP_SIZE,
    EmbeddingShapeError,
    F16Matrix,
    LMHead,
)

SCREEN_WORKGROUP = 32  # with 2B-4T's 160 chunks a row, 5 whole chunks per thread (H200: fastest of 32-160)
SCREEN_ROWS = 4  # int8 rows per screening workgroup: 128256 rows -> 32064 workgroups
RESCORE_SLICE = 256  # rows each rescoring workgroup scans for survivors
KEY_SLOTS = 32  # words the screen's workgroups spread their atomic maxima over
QUANTIZE_WORKGROUP = 64
# Heads from this size on are screened by default: the screen saves about half the head's read time,
# a few microseconds below this (the bundled model's 4 MB head), for half its memory again.
SCREEN_MIN_HEAD_BYTES = 64 << 20


def float_slack(n_cols: int) -> float:
    """A bound on the float32 rounding of a length-n dot product in any order, relative to
    sum |w x| <= ||w|| ||x||, for both the F16 head's sum and the int8 screen's (each about
    n * 2^-24), with a quarter to spare."""
    return 2 * 1.25 * (n_cols + 4) * 2.0**-24


class Int8HeadCopy:
    """The int8 copy of an F16 head that screens draw on: int8 shards over the F16 shards' rows
    (n_cols bytes a row), scales and error norms [n_rows] f32 (lm_head_screen.wgsl QUANTIZE).
    `prepare(recorder)` records its making from the F16 rows, once, before any screen runs."""

    def __init__(self, kernels: KernelCache, matrix: F16Matrix, label: str = "head int8 copy"):
        n_rows, n_cols = matrix.n_rows, matrix.n_cols
        if n_cols % 16:
            raise EmbeddingShapeError(f"{label}: {n_cols} columns; the int8 screen needs a multiple of 16")
        device = kernels.device
        limit = device.limits.max_compute_workgroups_per_dimension
        self.matrix, self.label = matrix, label
        self.scales = device.buffer(4 * n_rows, label=f"{label} scales")
        self.errs = device.buffer(4 * n_rows, label=f"{label} error norms")
        self.buffers = [self.scales, self.errs]
        self.shards: list[tuple[int, int, gpu.Buffer]] = []
        self.quantize_ops: list[tuple[gpu.Pipeline, gpu.BindGroup, int]] = []
        for i, (start, stop, f16_rows) in enumerate(matrix.shards):
            rows = stop - start
            int8_rows = device.buffer(n_cols * rows, label=f"{label} rows {start}:{stop}")
            self.buffers.append(int8_rows)
            self.shards.append((start, stop, int8_rows))
            groups = min(rows, limit)
            quantize = kernels.pipeline(
                "lm_head_screen",
                defines=("QUANTIZE",),
                D16=n_cols // 16,
                SHARD_ROWS=rows,
                START=start,
                WG=QUANTIZE_WORKGROUP,
                QGROUPS=groups,
                SLACK=f"{float_slack(n_cols):.9e}",
            )
            binds = [f16_rows, int8_rows, self.scales, self.errs]
            self.quantize_ops.append((quantize, device.bind_group(quantize, binds, f"{label} quantize {i}"), groups))

    def prepare(self, recorder: gpu.Recorder) -> None:
        for pipeline, bind, groups in self.quantize_ops:
            recorder.dispatch(pipeline, bind, groups)

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()


class ScreenedArgmax:
    """out_ids[slot + t] = argmax of `head`'s logits for row t of x, t < n_rows (a decode step's one row,
    or a greedy verify step's), from an int8 screen over `copy` (module docstring).

    Buffers (`buffers`, owned): upper [max_rows, V] f32, keys [max_rows, KEY_SLOTS] u32 (zero between
    steps), partials [max_rows, rescoring workgroups] vec2<u32>. The copy is shared, not owned.
    """

    def __init__(
        self,
        kernels: KernelCache,
        head: LMHead,
        copy: Int8HeadCopy,
        x: gpu.Buffer,
        out_ids: gpu.Buffer,
        vocab_size: int,
        slot: int = 0,
        max_rows: int = 1,
        step: StepParams | None = None,
        label: str = "screened argmax",
    ):
        matrix = copy.matrix
        n_rows, n_cols = matrix.n_rows, matrix.n_cols
        if not 0 < vocab_size <= n_rows or out_ids.nbytes < 4 * (slot + max_rows):
            raise EmbeddingShapeError(
                f"{label}: vocabulary of {vocab_size} over a {n_rows}-row head, out_ids of {out_ids.nbytes} "
                f"bytes for slots {slot}..{slot + max_rows - 1}"
            )
        if x.nbytes < 4 * n_cols * max_rows:
            raise EmbeddingShapeError(f"{label}: x ({x.nbytes} bytes) must hold {max_rows} rows of {n_cols} f32")
        device = kernels.device
        self.kernels, self.copy, self.x, self.step, self.label = kernels, copy, x, step, label
        self.vocab_size, self.max_rows, self.out_ids = vocab_size, max_rows, out_ids
        self.subgroups = subgroups_available(device)
        self.enables = wgsl_enables(device, subgroups=self.subgroups)
        sg = ("SUBGROUPS",) if self.subgroups else ()

        def buffer(nbytes: int, what: str) -> gpu.Buffer:
            made = device.buffer(nbytes, label=f"{label} {what}")
            self.buffers.append(made)
            return made

        self.buffers: list[gpu.Buffer] = []
        self.upper = buffer(4 * n_rows * max_rows, "upper bounds")
        self.keys = buffer(4 * KEY_SLOTS * max_rows, "lower-bound keys")
        groups = [ceil_div(stop - start, RESCORE_SLICE) for start, stop, _ in matrix.shards]
        self.partials = buffer(8 * sum(groups) * max_rows, "partials")
        self._screens: dict[tuple[int, bool], list[tuple[gpu.Pipeline, gpu.BindGroup, int]]] = {}
        self.rescore_ops = head.rescoring(
            self.upper, self.keys, self.partials, RESCORE_SLICE, KEY_SLOTS, vocab_size, groups
        )
        self.combine = kernels.pipeline(
            "argmax",
            enables=self.enables,
            defines=sg + ("COMBINE", "SCREENED"),
            V=vocab_size,
            ROW=0,
            SLOT=slot,
            WG=ARGMAX_WORKGROUP,
            PER=ARGMAX_PER_THREAD,
            GROUPS=sum(groups),
            KEY_SLOTS=KEY_SLOTS,
        )
        self.combine_bind = device.bind_group(self.combine, [self.partials, out_ids, self.keys], f"{label} combine")
        self.screen_ops(1, bounded=step is not None)  # built now: the load's pipeline batch compiles it

    def screen_ops(self, n_rows: int, bounded: bool) -> list[tuple[gpu.Pipeline, gpu.BindGroup, int]]:
        """(pipeline, bindings, workgroups) per shard of the screen over `n_rows` token rows (`bounded`:
        StepParams.n_tokens may say fewer), built on first use."""
        found = self._screens.get((n_rows, bounded))
        if found is not None:
            return found
        if not 0 < n_rows <= self.max_rows or (bounded and self.step is None):
            raise EmbeddingShapeError(f"{self.label}: {n_rows} rows (bounded: {bounded}), built for 1..{self.max_rows}")
        device, matrix = self.kernels.device, self.copy.matrix
        limit = device.limits.max_compute_workgroups_per_dimension
        d16 = matrix.n_cols // 16
        slots = ceil_div(SCREEN_WORKGROUP, MIN_SUBGROUP_SIZE) if self.subgroups else SCREEN_WORKGROUP
        defines = (("SUBGROUPS",) if self.subgroups else ()) + (("WHOLE",) if d16 % SCREEN_WORKGROUP == 0 else ())
        params = dict(STEP_PARAMS=STEP_PARAMS_WGSL) if bounded else {}
        found = []
        for i, (start, stop, int8_rows) in enumerate(self.copy.shards):
            rows = max(SCREEN_ROWS, ceil_div(stop - start, limit))
            pipeline = self.kernels.pipeline(
                "lm_head_screen",
                enables=self.enables,
                defines=defines + (("MULTI",) if bounded else ()),
                D16=d16,
                SHARD_ROWS=stop - start,
                START=start,
                WG=SCREEN_WORKGROUP,
                ROWS=rows,
                TOK=n_rows,
                V=matrix.n_rows,
                SLOTS=slots,
                ITERS=ceil_div(d16, SCREEN_WORKGROUP),
                KEY_SLOTS=KEY_SLOTS,
                VOCAB=self.vocab_size,
                **params,
            )
            binds = [int8_rows, self.copy.scales, self.copy.errs, self.x, self.upper, self.keys]
            binds += [self.step.buffer] if bounded else []
            bind = device.bind_group(pipeline, binds, f"{self.label} screen {i} rows={n_rows}")
            found.append((pipeline, bind, ceil_div(stop - start, rows)))
        self._screens[(n_rows, bounded)] = found
        return found

    def record(self, recorder: gpu.Recorder, n_rows: int = 1, bounded: bool = False) -> None:
        """The tokens of x's rows 0..n_rows-1; `bounded`: StepParams.n_tokens (written on the GPU) may
        say fewer rows, even none (their slots then get token 0, as Argmax gives a row without a valid
        logit)."""
        for pipeline, bind, groups in self.screen_ops(n_rows, bounded):
            recorder.dispatch(pipeline, bind, groups)
        for pipeline, bind, groups in self.rescore_ops:
            recorder.dispatch(pipeline, bind, groups, n_rows)
        recorder.dispatch(self.combine, self.combine_bind, n_rows)

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()
