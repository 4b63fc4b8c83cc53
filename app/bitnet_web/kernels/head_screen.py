"""A decode step's LM head in two passes: an int8 screen, then the exact logits of the rows that can win.

The F16 head is a decode step's largest read (657 MB a token for 2B-4T). Greedy decoding needs only
its argmax. `ScreenedArgmax` keeps an int8 copy of the head (made on the GPU from the F16 rows at load,
half their bytes) with one scale and two norms per row (its rounding residual's and its own), and reads
the normed input as two int8 digits with their norms (written by the final norm, `RMSNorm` with
digits), so every row's approximate logit is two exact integer dot products and the F16 logit lies
within a bound of it (shaders/lm_head_screen.wgsl says why). Per step:

    norm     (rmsnorm.wgsl DIGITS)  y, and y as two int8 digits (recorded by the model's step)
    screen   (lm_head_screen.wgsl)  int8 logits -> upper bounds [V], the best lower bound (atomic keys)
    rescore  (lm_head.wgsl RESCORE) rows whose upper bound reaches it: their F16 logits, computed by
                                    the one-row head's own arithmetic, and each slice's best
    combine  (argmax.wgsl SCREENED) the best of the slices -> out_ids[slot]; clears the keys

The argmax's row always survives the screen and its logit is the F16 head's bit for bit, so the token
is exactly `Argmax` over `LMHead`'s logits (ties to the smaller index, NaN never wins). The logits
buffer is not written. Three dispatches, like LMHead + Argmax.

Speculative verify steps screen all of a step's token rows in one pass, the int8 rows read once for
all of them (`_VerifyScreen`; on the H200 the head of 7 rows takes 173-182 us against the F16 head's
401): greedy ones then rescore and combine each row (`ScreenedVerifyArgmax`: every row's token is the F16
head's argmax of that row), sampled ones write each row's logits wherever the sampler's top-k can reach
and -inf elsewhere (`ScreenedVerifyLogits`, the rule of `ScreenedSampling` below), so the speculative
sampler draws as from the F16 head's rows.

Sampled steps (`ScreenedSampling`): the screen over SAMPLED_KEY_SLOTS keys, then the rescore's TOPK
variant lists the F16 logit of every row that can be among the sampler's top candidates
(`record_candidates`; the TAU_RANK-th largest key bounds them), then one workgroup of the GPU sampler
sorts that list and draws (`GPUSampler.draw_from_candidates`): the same token as its four passes over
the F16 logits. The draw empties the list and clears the keys.
"""

from __future__ import annotations

from .. import gpu
from ..text.sampler import GPU_PENALTY_WINDOW_MAX, GPU_TOP_K_MAX, SamplerSettings
from .common import (
    STEP_PARAMS_WGSL,
    KernelCache,
    StepParams,
    ceil_div,
    packed_dot_available,
    subgroups_available,
    wgsl_enables,
)
from .embedding import (
    ARGMAX_PER_THREAD,
    ARGMAX_WORKGROUP,
    MIN_SUBGROUP_SIZE,
    EmbeddingShapeError,
    F16Matrix,
    LMHead,
)
from .sampling import GPUSampler

SCREEN_WORKGROUP = 32  # with 2B-4T's 160 chunks a row, 5 whole chunks per thread (H200: fastest of 32-160)
DIGIT_STATS = 4  # f32 words the final norm writes next to the digits: s1, s2, A, B
SCREEN_ROWS = 8  # int8 rows per screening workgroup: 128256 rows -> 16032 workgroups (H200: 4 rows 4% slower)
RESCORE_SLICE = 256  # rows each rescoring workgroup scans for survivors
# Words a greedy step's screen spreads its atomic maxima over (so they do not queue on one address).
KEY_SLOTS = 128
# How many rows a sampled step's candidates are at least: the sampler's largest top-k plus its longest
# repetition-penalty window (rows whose logits the penalty may lower).
TAU_RANK = GPU_TOP_K_MAX + GPU_PENALTY_WINDOW_MAX
# Words a sampled step's screen spreads its maxima over, each a different row's lower bound: their
# TAU_RANK-th largest bounds the candidates (more words, a tighter bound: ~2,000 rows of the synthetic
# 2B-4T's 128,256 kept, against 5.6-6.9k with the smallest of 128 words).
SAMPLED_KEY_SLOTS = 1024
TAU_WORKGROUP = 256  # threads of the one workgroup that finds that key
QUANTIZE_WORKGROUP = 64
# Heads from this size on are screened by default: the screen saves about half the head's read time,
# a few microseconds below this (the bundled model's 4 MB head), for half its memory again.
SCREEN_MIN_HEAD_BYTES = 64 << 20


def verify_screen_rows(tokens: int) -> int:
    """int8 rows per screening workgroup of a verify step of `tokens` token rows: each row's sums for every
    token row stay in registers, so more token rows take fewer int8 rows (H200, whole 2B-4T verify steps:
    4 fastest for 2-3 token rows, 2 from 4 rows, as fast as 1; 8 slower everywhere)."""
    return 4 if tokens <= 3 else 2


def float_slack(n_cols: int) -> float:
    """A bound on the float32 rounding of the F16 head's length-n dot product in any order, relative
    to sum |w x| <= ||w|| ||x|| (about n * 2^-24), and of the screen's scaled integer sums, with room
    to spare."""
    return 2 * 1.25 * (n_cols + 4) * 2.0**-24


class ScreenedArgmax:
    """out_ids[slot] = argmax of `head`'s logits for x's row 0, from an int8 screen (module docstring).

    `x` is the normed row the F16 head reads; `digits` ([2, n_cols / 4] u32) and `digit_stats`
    ([DIGIT_STATS] f32) hold it as two int8 digits (`RMSNorm` with digits writes all three: record it
    before each step's `record`). `prepare(recorder)` must run once before the first `record` (after the
    pipelines exist): it makes the int8 copy. Buffers (`buffers`): the int8 shards (the F16 shards'
    rows, n_cols bytes a row), scales / upper [V] f32, norms [V] vec2<f32>, keys [SAMPLED_KEY_SLOTS] u32
    (a greedy step uses the first KEY_SLOTS), partials [rescoring workgroups] vec2<u32>, candidates
    (shaders/_candidates.wgsl: a count, then up to V (logit bits, row) pairs).
    """

    def __init__(
        self,
        kernels: KernelCache,
        head: LMHead,
        matrix: F16Matrix,
        x: gpu.Buffer,
        digits: gpu.Buffer,
        digit_stats: gpu.Buffer,
        out_ids: gpu.Buffer,
        vocab_size: int,
        slot: int = 0,
        label: str = "screened argmax",
    ):
        n_rows, n_cols = matrix.n_rows, matrix.n_cols
        if n_cols % 16:
            raise EmbeddingShapeError(f"{label}: {n_cols} columns; the int8 screen needs a multiple of 16")
        if digits.nbytes < 2 * n_cols or digit_stats.nbytes < 4 * DIGIT_STATS:
            raise EmbeddingShapeError(
                f"{label}: digits of {digits.nbytes} bytes and stats of {digit_stats.nbytes} for {n_cols} "
                f"columns (expected {2 * n_cols} and {4 * DIGIT_STATS})"
            )
        if not 0 < vocab_size <= n_rows or out_ids.nbytes < 4 * (slot + 1):
            raise EmbeddingShapeError(
                f"{label}: vocabulary of {vocab_size} over a {n_rows}-row head, out_ids of {out_ids.nbytes} "
                f"bytes for slot {slot}"
            )
        device = kernels.device
        limit = device.limits.max_compute_workgroups_per_dimension
        subgroups = subgroups_available(device)
        enables = wgsl_enables(device, subgroups=subgroups)
        sg = ("SUBGROUPS",) if subgroups else ()
        dot = ("DOT4",) if packed_dot_available(device) else ()
        slots = ceil_div(SCREEN_WORKGROUP, MIN_SUBGROUP_SIZE) if subgroups else SCREEN_WORKGROUP
        d16 = n_cols // 16
        variant = sg + dot + (("WHOLE",) if d16 % SCREEN_WORKGROUP == 0 else ())

        def buffer(nbytes: int, what: str) -> gpu.Buffer:
            made = device.buffer(nbytes, label=f"{label} {what}")
            self.buffers.append(made)
            return made

        self.buffers: list[gpu.Buffer] = []
        self.scales = buffer(4 * n_rows, "int8 row scales")
        self.norms = buffer(8 * n_rows, "int8 row residual and row norms")  # (n_rows, 2) f32
        self.upper = buffer(4 * n_rows, "upper bounds")  # (n_rows,) f32
        # (SAMPLED_KEY_SLOTS,) u32, zero between steps, then a sampled step's tau key
        self.keys = buffer(4 * (SAMPLED_KEY_SLOTS + 1), "lower-bound keys")
        self.candidates = buffer(8 + 8 * vocab_size, "sampling candidates")  # count, pad, (V,) vec2<u32>
        self.int8_shards: list[tuple[int, int, gpu.Buffer]] = []  # (start, stop, int8 rows)
        self._screen_constants = dict(
            enables=enables,
            defines=variant,
            SLOTS=slots,
            ITERS=ceil_div(d16, SCREEN_WORKGROUP),
            VOCAB=vocab_size,
            SLACK=f"{float_slack(n_cols):.9e}",
            D16=d16,
            WG=SCREEN_WORKGROUP,
        )
        self.kernels, self.head, self.matrix, self.vocab_size = kernels, head, matrix, vocab_size
        self.rescore_groups = [ceil_div(stop - start, RESCORE_SLICE) for start, stop, _ in matrix.shards]
        self.quantize_ops: list[tuple[gpu.Pipeline, gpu.BindGroup, int]] = []
        self.screen_ops: list[tuple[gpu.Pipeline, gpu.BindGroup, int]] = []
        self.sampled_screen_ops: list[tuple[gpu.Pipeline, gpu.BindGroup, int]] = []
        self.partials = buffer(8 * sum(self.rescore_groups), "partials")
        for i, (start, stop, f16_rows) in enumerate(matrix.shards):
            rows = stop - start
            int8_rows = buffer(n_cols * rows, f"int8 rows {start}:{stop}")
            common = dict(D16=d16, SHARD_ROWS=rows, START=start, WG=SCREEN_WORKGROUP)
            quantize = kernels.pipeline(
                "lm_head_screen",
                defines=("QUANTIZE",),
                QGROUPS=min(rows, limit),
                **{**common, "WG": QUANTIZE_WORKGROUP},
            )
            self.quantize_ops.append(
                (
                    quantize,
                    device.bind_group(
                        quantize, [f16_rows, int8_rows, self.scales, self.norms], f"{label} quantize {i}"
                    ),
                    min(rows, limit),
                )
            )
            self.int8_shards.append((start, stop, int8_rows))
            screen_rows = max(SCREEN_ROWS, ceil_div(rows, limit))
            binds = [int8_rows, self.scales, self.norms, digits, digit_stats, self.upper, self.keys]
            for key_slots, ops in ((KEY_SLOTS, self.screen_ops), (SAMPLED_KEY_SLOTS, self.sampled_screen_ops)):
                screen = self._screen_pipeline(i, screen_rows, 1, key_slots)
                ops.append(
                    (screen, device.bind_group(screen, binds, f"{label} screen {i}"), ceil_div(rows, screen_rows))
                )
        self.rescore_ops = head.rescoring(
            self.upper, self.keys, self.partials, RESCORE_SLICE, KEY_SLOTS, vocab_size, self.rescore_groups
        )
        tau = kernels.pipeline(
            "lm_head_screen_tau",
            WG=TAU_WORKGROUP,
            KEY_SLOTS=SAMPLED_KEY_SLOTS,
            KEY_STRIDE=SAMPLED_KEY_SLOTS + 1,
            TAU_RANK=TAU_RANK,
        )
        self.tau_op = (tau, device.bind_group(tau, [self.keys], f"{label} tau"), 1)
        self.candidate_ops = head.rescoring(
            self.upper,
            self.keys,
            self.candidates,
            RESCORE_SLICE,  # H200: slices of 32-128 rows no faster for a sampled step's ~2,000 kept rows
            SAMPLED_KEY_SLOTS,
            vocab_size,
            self.rescore_groups,
            top_k=True,
        )
        self._combine_args = (kernels, enables, sg, vocab_size, sum(self.rescore_groups))
        self.label = label
        self.combine = self.combine_into(out_ids, slot)
        self.prepared = False

    def _screen_pipeline(
        self, shard: int, rows: int, tokens: int, key_slots: int, bounded: bool = False, key_stride: int | None = None
    ) -> gpu.Pipeline:
        """lm_head_screen.wgsl's SCREEN for shard `shard`: `rows` int8 rows a workgroup, `tokens` token rows
        (`bounded`: StepParams' n_tokens of them are live)."""
        start, stop, _ = self.matrix.shards[shard]
        constants = dict(self._screen_constants)
        defines = constants.pop("defines") + (("BOUNDED",) if bounded else ())
        return self.kernels.pipeline(
            "lm_head_screen",
            defines=defines,
            SHARD_ROWS=stop - start,
            START=start,
            ROWS=rows,
            TOKENS=tokens,
            KEY_SLOTS=key_slots,
            KEY_STRIDE=key_slots if key_stride is None else key_stride,
            STEP_PARAMS=STEP_PARAMS_WGSL,
            **constants,
        )

    def combine_into(self, out_ids: gpu.Buffer, slot: int) -> tuple[gpu.Pipeline, gpu.BindGroup, int]:
        """A combine dispatch that writes the token to out_ids[slot] (`record(recorder, combine)`:
        a speculative draft-off step's token goes to its acceptance's buffer)."""
        combine = self._combine_pipeline(slot)
        bind = self.kernels.device.bind_group(combine, [self.partials, out_ids, self.keys], f"{self.label} combine")
        return combine, bind, 1

    def _combine_pipeline(self, slot: int = 0) -> gpu.Pipeline:
        """argmax.wgsl's SCREENED combine over the rescore's partials, token row r (dispatched as x)
        to out_ids[slot + r]."""
        kernels, enables, sg, vocab_size, groups = self._combine_args
        return kernels.pipeline(
            "argmax",
            enables=enables,
            defines=sg + ("COMBINE", "SCREENED"),
            V=vocab_size,
            ROW=0,
            SLOT=slot,
            WG=ARGMAX_WORKGROUP,
            PER=ARGMAX_PER_THREAD,
            GROUPS=groups,
            KEY_SLOTS=KEY_SLOTS,
        )

    def prepare(self, recorder: gpu.Recorder) -> None:
        """Record the int8 copy's making (once; the F16 head must be uploaded)."""
        for pipeline, bind, groups in self.quantize_ops:
            recorder.dispatch(pipeline, bind, groups)
        self.prepared = True

    def record(self, recorder: gpu.Recorder, combine: tuple[gpu.Pipeline, gpu.BindGroup, int] | None = None) -> None:
        """The greedy token, to out_ids[slot] (or where `combine`, from combine_into, writes it)."""
        if not self.prepared:  # an unmade copy would screen out the wrong rows: wrong tokens, silently
            raise RuntimeError(f"{self.label}: prepare() must record the int8 copy before the first step")
        for pipeline, bind, groups in self.screen_ops + self.rescore_ops:
            recorder.dispatch(pipeline, bind, groups)
        recorder.dispatch(*(combine or self.combine))

    def record_candidates(self, recorder: gpu.Recorder) -> None:
        """The candidate list a top-k sampler needs (`candidates`, shaders/_candidates.wgsl): the F16
        logit (bit for bit) and row of every row that can be among the top GPU_TOP_K_MAX after a
        repetition penalty of at least 1, in no order. The keys stay set and the list full: the
        sampler's draw clears both (`GPUSampler.draw_from_candidates`)."""
        if not self.prepared:
            raise RuntimeError(f"{self.label}: prepare() must record the int8 copy before the first step")
        for pipeline, bind, groups in self.sampled_screen_ops + [self.tau_op] + self.candidate_ops:
            recorder.dispatch(pipeline, bind, groups)

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()


class _VerifyScreen:
    """The screen over a verify step's `max_rows` token rows, shared by its greedy and sampled forms: one
    pass reads the int8 rows once for all token rows (`verify_screen_rows` int8 rows a workgroup: the
    decode screen's 8, times the token rows' sums, hold too many registers). Rows from StepParams'
    n_tokens on are skipped and set no keys. `digits` / `digit_stats` hold the rows' digits
    ([max_rows, 2, n_cols / 4] u32, [max_rows, DIGIT_STATS] f32: the final norm's `record(...,
    digits=True)` over all rows); the rescore reads the normed rows from the screen's `x`. Buffers:
    upper [max_rows, V] f32, keys [max_rows, key_stride] u32 (each row's first key_slots zero between
    steps)."""

    def __init__(
        self,
        screen: ScreenedArgmax,
        digits: gpu.Buffer,
        digit_stats: gpu.Buffer,
        step: StepParams,
        max_rows: int,
        key_slots: int,
        key_stride: int,
        label: str,
    ):
        n_cols, vocab = screen.matrix.n_cols, screen.vocab_size
        if digits.nbytes < 2 * n_cols * max_rows or digit_stats.nbytes < 4 * DIGIT_STATS * max_rows:
            raise EmbeddingShapeError(
                f"{label}: digits of {digits.nbytes} bytes and stats of {digit_stats.nbytes} for {max_rows} rows "
                f"of {n_cols} columns (expected {2 * n_cols * max_rows} and {4 * DIGIT_STATS * max_rows})"
            )
        device = screen.kernels.device
        self.buffers: list[gpu.Buffer] = []
        self.upper = self._buffer(device, 4 * max_rows * vocab, f"{label} upper bounds")  # (max_rows, V) f32
        self.keys = self._buffer(device, 4 * max_rows * key_stride, f"{label} lower-bound keys")
        limit = device.limits.max_compute_workgroups_per_dimension
        self.screen_ops = []
        for i, (start, stop, int8_rows) in enumerate(screen.int8_shards):
            rows = max(verify_screen_rows(max_rows), ceil_div(stop - start, limit))
            pipeline = screen._screen_pipeline(i, rows, max_rows, key_slots, bounded=True, key_stride=key_stride)
            binds = [int8_rows, screen.scales, screen.norms, digits, digit_stats, self.upper, self.keys, step.buffer]
            bind = device.bind_group(pipeline, binds, f"{label} screen {i}")
            self.screen_ops.append((pipeline, bind, ceil_div(stop - start, rows)))
        self.max_rows = max_rows

    def _buffer(self, device: gpu.Device, nbytes: int, label: str) -> gpu.Buffer:
        made = device.buffer(nbytes, label=label)
        self.buffers.append(made)
        return made

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()


class ScreenedVerifyArgmax(_VerifyScreen):
    """out_ids[t] = argmax of `screen`'s head for each token row t of a greedy verify step, through its
    int8 copy: the same tokens as the F16 head's rows and an argmax each (a verify row's logits are its
    decode step's bit for bit, and the rescore computes them with the one-row head's arithmetic). The
    screen (_VerifyScreen), then each row's rescore and combine (which clears the row's keys); rows past
    the step's n_tokens keep nothing and get token 0. Buffers: _VerifyScreen's and the partials."""

    def __init__(
        self,
        screen: ScreenedArgmax,
        digits: gpu.Buffer,
        digit_stats: gpu.Buffer,
        step: StepParams,
        out_ids: gpu.Buffer,
        max_rows: int,
        label: str = "verify screened argmax",
    ):
        if out_ids.nbytes < 4 * max_rows:
            raise EmbeddingShapeError(f"{label}: out_ids of {out_ids.nbytes} bytes for {max_rows} rows")
        super().__init__(screen, digits, digit_stats, step, max_rows, KEY_SLOTS, KEY_SLOTS, label)
        device = screen.kernels.device
        groups = screen.rescore_groups
        # (max_rows, sum(groups)) vec2<u32>
        self.partials = self._buffer(device, 8 * max_rows * sum(groups), f"{label} partials")
        self.rescore_ops = screen.head.rescoring(
            self.upper, self.keys, self.partials, RESCORE_SLICE, KEY_SLOTS, screen.vocab_size, groups
        )
        self.combine = screen._combine_pipeline()
        self.combine_bind = device.bind_group(self.combine, [self.partials, out_ids, self.keys], f"{label} combine")
        self.out_ids = out_ids

    def record(self, recorder: gpu.Recorder) -> None:
        """Every row's token to out_ids (rows past the step's n_tokens get 0); the final norm's digits
        over all rows must be recorded before."""
        for pipeline, bind, groups in self.screen_ops:
            recorder.dispatch(pipeline, bind, groups)
        for pipeline, bind, groups in self.rescore_ops:
            recorder.dispatch(pipeline, bind, groups, self.max_rows)
        recorder.dispatch(self.combine, self.combine_bind, self.max_rows)


class ScreenedVerifyLogits(_VerifyScreen):
    """A sampled verify step's logits rows through `screen`'s int8 copy: in each live token row, every
    row that can be among its top TAU_RANK logits after a repetition penalty of at least 1 (the rule
    of `ScreenedSampling`) gets its F16 logit bit for bit, every other row -inf. The speculative
    sampler (top-k at most GPU_TOP_K_MAX, penalty window at most GPU_PENALTY_WINDOW_MAX) then draws as
    from the F16 head's rows. The screen over SAMPLED_KEY_SLOTS keys a row, each row's tau
    (lm_head_screen_tau.wgsl CLEAR, which also clears the row's keys), then the rescore's LOGITS
    variant; rows past the step's n_tokens are left as they were."""

    def __init__(
        self,
        screen: ScreenedArgmax,
        logits: gpu.Buffer,
        digits: gpu.Buffer,
        digit_stats: gpu.Buffer,
        step: StepParams,
        max_rows: int,
        label: str = "verify screened logits",
    ):
        vocab = screen.vocab_size
        if logits.nbytes < 4 * screen.matrix.n_rows * max_rows:
            raise EmbeddingShapeError(f"{label}: logits of {logits.nbytes} bytes for {max_rows} rows of {vocab}")
        stride = SAMPLED_KEY_SLOTS + 1  # a row's keys, then its tau
        super().__init__(screen, digits, digit_stats, step, max_rows, SAMPLED_KEY_SLOTS, stride, label)
        kernels = screen.kernels
        tau = kernels.pipeline(
            "lm_head_screen_tau",
            defines=("CLEAR",),
            WG=TAU_WORKGROUP,
            KEY_SLOTS=SAMPLED_KEY_SLOTS,
            KEY_STRIDE=stride,
            TAU_RANK=TAU_RANK,
        )
        self.tau_op = (tau, kernels.device.bind_group(tau, [self.keys], f"{label} tau"), max_rows)
        self.rescore_ops = screen.head.rescoring(
            self.upper,
            self.keys,
            logits,
            RESCORE_SLICE,
            SAMPLED_KEY_SLOTS,
            vocab,
            screen.rescore_groups,
            top_k=True,
            key_stride=stride,
            into_logits=True,
            bounded_by=step,
        )
        self.logits = logits

    def record(self, recorder: gpu.Recorder) -> None:
        """Every live row's logits (the final norm's digits over all rows must be recorded before)."""
        for pipeline, bind, groups in self.screen_ops:
            recorder.dispatch(pipeline, bind, groups)
        recorder.dispatch(*self.tau_op)
        for pipeline, bind, groups in self.rescore_ops:
            recorder.dispatch(pipeline, bind, groups, self.max_rows)


class ScreenedSampling:
    """A sampled decode step's token through the screen: `record_candidates`, then `sampler`'s draw from
    them (`GPUSampler.draw_from_candidates`, which empties the list and clears the keys). The same
    token as `sampler` over the F16 head's logits, for settings `serves` accepts: a repetition penalty
    below 1 raises logits past their screened bound."""

    def __init__(self, screen: ScreenedArgmax, sampler: GPUSampler):
        if sampler.candidate_draw is None or sampler.cleared_keys is not screen.keys:
            raise RuntimeError(f"{screen.label}: the sampler must draw from the screen's candidates")
        self.screen, self.sampler = screen, sampler

    @staticmethod
    def serves(settings: SamplerSettings) -> bool:
        return settings.repetition_penalty >= 1.0

    def record(self, recorder: gpu.Recorder) -> None:
        self.screen.record_candidates(recorder)
        self.sampler.record_candidate_draw(recorder)
