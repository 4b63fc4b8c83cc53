"""Speculative sampling decided on the GPU (shaders/spec_sample.wgsl): which drafted tokens a verify
pass keeps and the token drawn after them, at temperature > 0, written where the next step reads
them, so sampled speculative steps queue without a readback.

The rule is model/speculation.py `accept_sampled`, p being the GPU sampler's distribution
(kernels/sampling.py: repetition penalty, top-k, top-p, min-p, temperature) for each verify row.
Draw numbers: row r uses draws c + 2r (keep drafted token r or not) and c + 2r + 1 (the token drawn
at the first rejected row, from p without the drafted token in token-id order, or from p at row
draft_len when every drafted token was kept, in the sampler's order); c then goes up by 2 per
emitted token. Temperature 0 with a penalty works too (top-k 1: greedy acceptance).
"""

from __future__ import annotations

import numpy as np

from .. import gpu
from ..text.sampler import GPU_PENALTY_WINDOW_MAX, GPU_TOP_K_MAX, SamplerSettings
from .common import KernelCache, ceil_div
from .head_screen import SAMPLED_KEY_SLOTS, ScreenedArgmax, ScreenedVerifyLogits
from .sampling import SORT_SHAPE, SORT_WIDTH, GPUSampler, candidate_draw_constants

MAX_ROWS = 9  # verify rows: the last token and up to 8 drafted ones


class SpecSampleAccept(GPUSampler):
    """After a verify pass: out = [n, tokens...] (the kept drafted tokens, then one drawn token).

    `logits` (max_rows, vocab) f32: row j scores the token after [last token, draft_0 .. draft_{j-1}]
    (the repetition penalty is applied to it in place). `draft` u32: the drafted tokens. `state` u32:
    word 0 = draft_len (0 .. n_rows - 1, written on the GPU by the draft kernel; read only).
    `out` u32[max_rows + 1]. Shares GPUSampler's parameter block, `configure` and state layout (draw
    counter, status, penalty ring), held in its own buffer `self.state`; after the ring, two words
    count the drafted tokens proposed and accepted since `configure` (`totals`).
    """

    STATE_NBYTES = GPUSampler.STATE_NBYTES + 8
    TOTALS_AT = GPUSampler.STATE_NBYTES

    def __init__(
        self,
        kernels: KernelCache,
        logits: gpu.Buffer,
        draft: gpu.Buffer,
        state: gpu.Buffer,
        out: gpu.Buffer,
        vocab_size: int,
        max_rows: int,
        label: str = "speculative sampler",
    ):
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"{label}: max_rows must be in 1..{MAX_ROWS}, got {max_rows}")
        sizes = {
            "logits": (logits, 4 * vocab_size * max_rows),
            "draft": (draft, 4 * max(max_rows - 1, 1)),
            "state": (state, 4),
            "out": (out, 4 * (max_rows + 1)),
        }
        for name, (buffer, needed) in sizes.items():
            if buffer.nbytes < needed:
                raise ValueError(f"{label}: {name} holds {buffer.nbytes} bytes, needs {needed} (max_rows={max_rows})")
        device = kernels.device
        self.device = device
        self.max_rows = max_rows
        self.logits = logits
        shape = SORT_SHAPE
        self.buffers: list[gpu.Buffer] = []

        def lists(n_pairs: int) -> gpu.Buffer:
            buffer = device.buffer(8 * n_pairs * max_rows, label=f"{label} candidates {len(self.buffers)}")
            self.buffers.append(buffer)
            return buffer

        self.levels: list[tuple[gpu.Pipeline, object, int]] = []  # dispatched (groups, n_rows)
        groups = ceil_div(vocab_size, SORT_WIDTH)
        spans = kernels.pipeline("spec_sample", defines=("SPANS", "LEVEL"), V=vocab_size, GROUPS=groups, **shape)
        pairs = groups * GPU_TOP_K_MAX
        current = lists(pairs)
        self.levels.append((spans, device.bind_group(spans, [logits, current], f"{label} spans"), groups))
        while pairs > SORT_WIDTH:
            groups = ceil_div(pairs, SORT_WIDTH)
            merge = kernels.pipeline(
                "spec_sample", defines=("MERGE", "LISTS", "LEVEL"), N_IN=pairs, GROUPS=groups, **shape
            )
            merged = lists(groups * GPU_TOP_K_MAX)
            self.levels.append((merge, device.bind_group(merge, [current, merged], f"{label} merge"), groups))
            current, pairs = merged, groups * GPU_TOP_K_MAX
        self.params = device.buffer(self.PARAMS_NBYTES, gpu.UNIFORM_USAGE, f"{label} params")
        self.state = device.buffer(self.STATE_NBYTES, label=f"{label} state")
        decisions = device.buffer(4 * (1 + 2 * max_rows), label=f"{label} decisions")
        self.buffers += [self.params, self.state, decisions]
        penalty = kernels.pipeline("spec_sample", defines=("PENALTY",), V=vocab_size, **shape)
        bind = device.bind_group(penalty, [logits, self.params, self.state, draft, state], f"{label} penalty")
        self.penalty = (penalty, bind)
        self.penalty_active = False
        final = kernels.pipeline("spec_sample", defines=("FINAL", "LISTS"), N_IN=pairs, **shape)
        bind = device.bind_group(final, [current, self.params, self.state, draft, state, decisions], f"{label} rows")
        self.final = (final, bind)
        accept = kernels.pipeline("spec_sample", defines=("ACCEPT",), RING_MAX=GPU_PENALTY_WINDOW_MAX, **shape)
        self.accept = (accept, device.bind_group(accept, [decisions, self.params, self.state, out], f"{label} accept"))
        self._screen_args = (kernels, state, decisions, label)
        self.screen: ScreenedArgmax | None = None
        self.screened_draw: tuple[gpu.Pipeline, gpu.BindGroup, int] | None = None  # use_screen builds it
        self.verify_screen: ScreenedVerifyLogits | None = None  # use_verify_screen sets it

    def use_screen(self, screen: ScreenedArgmax) -> None:
        """Draft-off steps (one row, no draft) may draw their token from `screen`'s candidates
        (`record_screened`), for settings ScreenedSampling.serves."""
        kernels, spec_state, decisions, label = self._screen_args
        draw = kernels.pipeline(
            "spec_sample", defines=("FINAL", "CANDIDATES"), **candidate_draw_constants(SAMPLED_KEY_SLOTS)
        )
        binds = [screen.candidates, self.params, self.state, spec_state, decisions, screen.keys]
        self.screened_draw = (draw, kernels.device.bind_group(draw, binds, f"{label} draw from candidates"), 1)
        self.screen = screen

    def use_verify_screen(self, verify: ScreenedVerifyLogits) -> None:
        """Verify steps may take their rows' logits from `verify` (`record_rows_screened`), which must
        write them where this op reads them."""
        if verify.logits is not self.logits or verify.max_rows != self.max_rows:
            raise ValueError("speculative sampler: the verify screen must write this op's logits rows")
        self.verify_screen = verify

    def record_rows_screened(self, recorder: gpu.Recorder, n_rows: int) -> None:
        """A verify step's decision with its rows' logits from the int8 screen (the step recorded the final
        norm's digits for every row, not the F16 head): the same tokens as `record(recorder, n_rows)` after
        the F16 head, for settings ScreenedSampling.serves."""
        if self.verify_screen is None or n_rows != self.max_rows:
            raise ValueError(f"speculative sampler: a screened verify step of {n_rows} rows needs use_verify_screen")
        self.verify_screen.record(recorder)
        self.record(recorder, n_rows)

    def record_screened(self, recorder: gpu.Recorder) -> None:
        """A draft-off step's decision through the screen (the step recorded the final norm's digits,
        not logits): the same token as `record(recorder, 1)` over the F16 logits, for a repetition
        penalty of at least 1. The draw empties the candidate list and clears the screen's keys."""
        self.screen.record_candidates(recorder)
        recorder.dispatch(*self.screened_draw)
        recorder.dispatch(*self.accept, 1)

    def configure(self, settings: SamplerSettings, seed: int, first_draw: int, history: list[int] = ()) -> int:
        """As GPUSampler.configure; the next verify step's row r uses draws first_draw + 2r and + 2r + 1.
        Also zeroes the proposed / accepted totals."""
        window = super().configure(settings, seed, first_draw, history)
        self.device.upload(self.state, self.TOTALS_AT, np.zeros(2, dtype=np.uint32))
        return window

    def record(self, recorder: gpu.Recorder, n_rows: int = 1) -> None:
        """One verify step's decision over `n_rows` = k + 1 rows of logits (draft_len <= k)."""
        if not 1 <= n_rows <= self.max_rows:
            raise ValueError(f"n_rows must be in 1..{self.max_rows}, got {n_rows}")
        if self.penalty_active:
            recorder.dispatch(*self.penalty, n_rows)
        for pipeline, bind, groups in self.levels:
            recorder.dispatch(pipeline, bind, groups, n_rows)
        recorder.dispatch(*self.final, 1, n_rows)
        recorder.dispatch(*self.accept, 1)

    def totals(self) -> tuple[int, int]:
        """(drafted tokens proposed, drafted tokens accepted) since `configure` (reads back: call at
        the end of a generation, not per step)."""
        words = self.device.read_sync(self.state, self.TOTALS_AT, 8).view(np.uint32)
        return int(words[0]), int(words[1])
