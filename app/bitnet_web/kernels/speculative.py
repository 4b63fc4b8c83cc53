"""Speculative decoding on the GPU: prompt-lookup drafts and greedy acceptance, so verify steps queue
without a readback like plain decode steps (shaders/spec_draft.wgsl, spec_accept.wgsl, argmax.wgsl).

A verify step is: `SpecDraft` (fold the previous step's tokens into the history, draft, write the verify
rows and StepParams), a forward pass over K + 1 rows with every row's logits, then an acceptance op
that writes `out` = [n_emitted, tokens...]: `GreedyAccept` here, or the sampled op (spec_sampling.py),
which takes the same buffers. The rules are model/speculation.py's; tests check these kernels against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import gpu
from .common import KernelCache, StepParams, ceil_div, subgroups_available, wgsl_enables
from .embedding import ARGMAX_PER_THREAD, ARGMAX_WORKGROUP
from .head_screen import ScreenedArgmax, ScreenedVerifyArgmax

SPECULATE_MAX = 8  # largest draft (verify rows = draft + 1)
# The engine's largest draft on a hardware GPU when a request does not choose one (Engine.speculate_for).
# A draft is as long as its match warrants (speculation.draft_length) and a verify step pays for the
# rows its draft fills plus a little for the k + 1 - (draft + 1) it dispatches that exit at once; on
# the 2B-4T shape (H200) that makes 6 the best expected speed-up over 9 bundled-model workloads
# (docs/performance.md, "Session 15"), where full drafts of 2 were best before.
SPECULATE_GPU = 6
DRAFT_WORKGROUP = 256  # > SPECULATE_MAX: one invocation per verify row writes it
# The reply's end on the GPU (SpecBuffers.start): its token budget and up to STOP_IDS_MAX stop ids, so
# the steps queued past the end leave at once instead of computing tokens nobody reads. The host stays
# the authority on where a reply ends (more stop ids, stop strings): this only saves GPU time.
STOP_IDS_MAX = 8
NO_BUDGET = 0xFFFFFFFF  # a reply without a token budget (until the context is full)
NO_TOKEN = 0xFFFFFFFF  # an unused stop-id slot
STATE_WORDS = 4 + STOP_IDS_MAX  # SpecBuffers.state, see there


def gpu_stop_ids(stop_ids: Sequence[int]) -> frozenset[int]:
    """The stop ids the GPU checks: the STOP_IDS_MAX smallest (the host checks all of them)."""
    return frozenset(sorted(int(t) for t in stop_ids)[:STOP_IDS_MAX])


class SpecBuffers:
    """The speculative loop's GPU state for drafts of up to `k` tokens.

    history [history_len] u32   prompt + accepted tokens (spec_draft.wgsl appends each step's output)
    state   [STATE_WORDS] u32   [0] draft_len, [1] history length, [2] kv_capacity (host-written),
                                [3] budget: tokens the reply's steps may still emit (0: it has ended,
                                every later step leaves at once and emits nothing), [4..] stop ids
    out     [k + 2] u32         the last verify step's n_emitted, then its emitted tokens
    draft   [max(k, 1)] u32     the drafted tokens of the current step
    """

    def __init__(self, device: gpu.Device, k: int, history_len: int):
        if not 1 <= k <= SPECULATE_MAX:
            raise ValueError(f"speculative drafts take 1..{SPECULATE_MAX} tokens, got {k}")
        self.device, self.k, self.history_len = device, k, history_len
        self.history = device.buffer(4 * history_len, label="speculation history")
        self.state = device.buffer(4 * STATE_WORDS, label="speculation state")
        self.out = device.buffer(4 * (k + 2), label="speculation out")
        self.draft = device.buffer(4 * max(k, 1), label="speculation draft")
        self.buffers = [self.history, self.state, self.out, self.draft]

    def start(
        self, history: list[int], kv_capacity: int, budget: int | None = None, stop_ids: Sequence[int] = ()
    ) -> None:
        """A speculative reply starts: the history (the text so far, its last token not yet verified)
        and no output to fold. The reply ends on the GPU once its steps have emitted `budget` tokens
        (None: never) or a token of `stop_ids` (the first STOP_IDS_MAX of them, smallest first)."""
        if not 1 <= len(history) <= self.history_len:
            raise ValueError(f"speculation history of {len(history)} tokens, room for 1..{self.history_len}")
        if budget is not None and budget < 0:
            raise ValueError(f"speculation budget of {budget} tokens")
        self.device.upload(self.history, 0, np.asarray(history, dtype=np.uint32))
        state = np.full(STATE_WORDS, NO_TOKEN, dtype=np.uint32)
        state[:4] = [0, len(history), kv_capacity, NO_BUDGET if budget is None else min(budget, NO_BUDGET - 1)]
        stops = sorted(gpu_stop_ids(stop_ids))
        state[4 : 4 + len(stops)] = stops
        self.device.upload(self.state, 0, state)
        self.device.upload(self.out, 0, np.zeros(self.k + 2, dtype=np.uint32))

    def reopen(self) -> None:
        """The reply goes on past its end on the GPU (a caller reading past its budget or a stop id):
        no budget and no stop ids from the next submitted step on."""
        state = np.full(STATE_WORDS - 3, NO_TOKEN, dtype=np.uint32)
        state[0] = NO_BUDGET
        self.device.upload(self.state, 12, state)

    def set_kv_capacity(self, kv_capacity: int) -> None:
        """The KV cache grew: later verify steps' StepParams carry the new row count."""
        self.device.upload(self.state, 8, np.asarray([kv_capacity], dtype=np.uint32))

    def release(self) -> None:
        for buffer in self.buffers:
            self.device.release(buffer)
        self.buffers.clear()


class SpecDraft:
    """spec_draft.wgsl bound to `buffers`, the model's token_ids (the verify pass's input rows) and its
    StepParams buffer, which the kernel writes (as storage) for the rest of the step to read as its
    uniform: no copy between them, so a verify step is one compute pass like a decode step.

    `k`: the tokens it drafts, buffers.k unless given; 0 makes the draft-off step's kernel (the fold
    and a one-row step), which the decode loop queues between drafting steps on the same buffers."""

    def __init__(
        self,
        kernels: KernelCache,
        buffers: SpecBuffers,
        token_ids: gpu.Buffer,
        step_params: gpu.Buffer,
        ngram_max: int,
        k: int | None = None,
    ):
        k = buffers.k if k is None else k
        if not 0 <= k <= buffers.k:
            raise ValueError(f"speculation draft of {k} tokens: its buffers hold drafts of 0..{buffers.k}")
        if token_ids.nbytes < 4 * (k + 1):
            raise ValueError(f"token_ids ({token_ids.nbytes} bytes) must hold the {k + 1} verify rows")
        if step_params.nbytes < StepParams.NBYTES or not step_params.usage & gpu.STORAGE:
            raise ValueError(
                f"step params buffer {step_params.label!r}: needs {StepParams.NBYTES} bytes and STORAGE usage"
            )
        self.pipeline = kernels.pipeline(
            "spec_draft",
            K=k,
            OUT_K=buffers.k,
            NGRAM=ngram_max,
            WG=DRAFT_WORKGROUP,
            HISTORY=buffers.history_len,
            STOPS=STOP_IDS_MAX,
        )
        self.bind = kernels.device.bind_group(
            self.pipeline,
            [buffers.history, buffers.state, buffers.out, buffers.draft, token_ids, step_params],
            "speculation draft" if k else "speculation draft off",
        )

    def record(self, recorder: gpu.Recorder) -> None:
        recorder.dispatch(self.pipeline, self.bind, 1)


class GreedyAccept:
    """out = accept_greedy(draft, argmax of every verify row): argmax.wgsl over `max_rows` logits rows
    (partials, then one combine workgroup per row into `chosen`) and spec_accept.wgsl.

    Same constructor and `record` as the sampled acceptance op, so the decode loop takes either.
    """

    def __init__(
        self,
        kernels: KernelCache,
        logits: gpu.Buffer,
        draft: gpu.Buffer,
        state: gpu.Buffer,
        out: gpu.Buffer,
        vocab_size: int,
        max_rows: int,
    ):
        device = kernels.device
        k = max_rows - 1
        if logits.nbytes < 4 * vocab_size * max_rows or out.nbytes < 4 * (k + 2):
            raise ValueError(
                f"greedy acceptance: logits ({logits.nbytes} bytes) must hold {max_rows} rows of {vocab_size} f32 "
                f"and out ({out.nbytes} bytes) {k + 2} words"
            )
        subgroups = subgroups_available(device)
        enables = wgsl_enables(device, subgroups=subgroups)
        defines = ("SUBGROUPS",) if subgroups else ()
        self.groups = ceil_div(vocab_size, ARGMAX_WORKGROUP * ARGMAX_PER_THREAD)
        constants = dict(V=vocab_size, ROW=0, SLOT=0, WG=ARGMAX_WORKGROUP, PER=ARGMAX_PER_THREAD)
        self.partials = device.buffer(8 * self.groups * max_rows, label="verify argmax partials")
        self.chosen = device.buffer(4 * max_rows, label="verify argmax")
        self.buffers = [self.partials, self.chosen]
        self.partial = kernels.pipeline("argmax", enables=enables, defines=defines, **constants)
        self.combine = kernels.pipeline("argmax", enables=enables, defines=defines + ("COMBINE",), **constants)
        self.accept = kernels.pipeline("spec_accept", K=k)
        self.partial_bind = device.bind_group(self.partial, [logits, self.partials], "verify argmax partial")
        self.combine_bind = device.bind_group(self.combine, [self.partials, self.chosen], "verify argmax combine")
        self.accept_bind = device.bind_group(self.accept, [self.chosen, draft, state, out], "verify accept")
        self.max_rows = max_rows
        self.screen: ScreenedArgmax | None = None
        self.screened_combine: tuple[gpu.Pipeline, gpu.BindGroup, int] | None = None  # use_screen builds it
        self.verify_screen: ScreenedVerifyArgmax | None = None  # use_verify_screen sets it

    def use_screen(self, screen: ScreenedArgmax) -> None:
        """Draft-off steps (one row, no draft) may take their token from `screen` (`record_screened`):
        its combine writes the greedy token where spec_accept.wgsl reads row 0's argmax."""
        self.screened_combine = screen.combine_into(self.chosen, 0)
        self.screen = screen

    def record_screened(self, recorder: gpu.Recorder) -> None:
        """A draft-off step's acceptance through the screen (the step recorded the final norm's digits,
        not logits): the same token as `record(recorder, 1)`."""
        self.screen.record(recorder, self.screened_combine)
        recorder.dispatch(self.accept, self.accept_bind, 1)

    def use_verify_screen(self, verify: ScreenedVerifyArgmax) -> None:
        """Verify steps may take their rows' argmaxes from `verify` (`record_rows_screened`), which must
        write them to `chosen`."""
        if verify.out_ids is not self.chosen or verify.max_rows != self.max_rows:
            raise ValueError("greedy acceptance: the verify screen must write this op's rows to `chosen`")
        self.verify_screen = verify

    def record_rows_screened(self, recorder: gpu.Recorder, n_rows: int) -> None:
        """A verify step's acceptance through the int8 screen (the step recorded the final norm's digits
        for every row, not logits): the same tokens as `record(recorder, n_rows)`."""
        if self.verify_screen is None or n_rows != self.max_rows:
            raise ValueError(f"greedy acceptance: a screened verify step of {n_rows} rows needs use_verify_screen")
        self.verify_screen.record(recorder)
        recorder.dispatch(self.accept, self.accept_bind, 1)

    def record(self, recorder: gpu.Recorder, n_rows: int) -> None:
        if not 0 < n_rows <= self.max_rows:
            raise ValueError(f"greedy acceptance: {n_rows} rows, built for 1..{self.max_rows}")
        recorder.dispatch(self.partial, self.partial_bind, self.groups, n_rows)
        recorder.dispatch(self.combine, self.combine_bind, n_rows)
        recorder.dispatch(self.accept, self.accept_bind, 1)

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()
