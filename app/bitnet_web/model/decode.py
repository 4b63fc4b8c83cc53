"""The GPU decode loop: tokens chosen on the GPU (greedy argmax or seeded sampling), steps queued ahead,
several to a submit; and its speculative form, where each step verifies a prompt-lookup draft.

Apart from the math (forward.py), as gpt-fast keeps generate.py apart from model.py. `GPUDecodeLoop`
is a base class of `BitNetModel`; it uses the model's `_record_step`, `token_ids`, `argmax`, `screened_argmax`,
`logits`, `x_digits`, `x_digit_stats`, `gpu_sampler`, `step`, `step_advance`, `cached_tokens`, `device`,
`kv_cache`, `layer_ops` and `_buffers`, and owns the staging ring it reads token ids from.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from .. import gpu
from ..kernels.embedding import Argmax
from ..kernels.head_screen import ScreenedArgmax, ScreenedSampling, ScreenedVerifyArgmax, ScreenedVerifyLogits
from ..kernels.linear import split_min_live_rows
from ..kernels.sampling import GPUSampler
from ..kernels.spec_sampling import SpecSampleAccept
from ..kernels.speculative import (
    NO_BUDGET,
    SPECULATE_MAX,
    GreedyAccept,
    SpecBuffers,
    SpecDraft,
    gpu_stop_ids,
)
from ..kernels.step_advance import VerifyStepLog
from ..text.sampler import SamplerSettings
from .speculation import NGRAM_MAX, SpeculationPolicy, prompt_lookup_draft


class Acceptance(Protocol):
    """What decides a verify step's output on the GPU: writes out = [n_emitted, tokens...] (SpecBuffers).
    A draft-off step (one row) may decide through an int8 screen instead of logits (`use_screen`, then
    `record_screened`): GreedyAccept, SpecSampleAccept; a verify step's rows too where `verify_screen` is
    set (`record_rows_screened`: GreedyAccept the rows' tokens, SpecSampleAccept their logits)."""

    screen: ScreenedArgmax | None
    verify_screen: ScreenedVerifyArgmax | ScreenedVerifyLogits | None

    def record(self, recorder: gpu.Recorder, n_rows: int) -> None: ...

    def use_screen(self, screen: ScreenedArgmax) -> None: ...

    def record_screened(self, recorder: gpu.Recorder) -> None: ...


@dataclass
class SpeculationOps:
    """The GPU state and ops of speculative steps with drafts of up to `buffers.k` tokens: the draft
    kernels of verify steps and of draft-off steps (both on `buffers`), greedy acceptance, and the
    log each step of a submit leaves its output in."""

    buffers: SpecBuffers
    draft: SpecDraft
    draft_off: SpecDraft
    greedy: GreedyAccept
    log: VerifyStepLog


@dataclass
class FirstToken:
    """A reply's first token, chosen on the GPU by the prompt's last submit (BitNetModel.prefill with
    `choose`): it is already the next step's input in token_ids[0], and its value reaches the host
    through `staging` (a read started with that submit). A decode loop given one queues its steps
    behind the prompt at once, with no host round trip between them, and yields the token first.
    `copies`: (buffer, byte offset) where the loop's first submit copies the token before its steps
    (a speculative reply's history and penalty window, uploaded with a placeholder in its place)."""

    staging: gpu.Buffer
    copies: list[tuple[gpu.Buffer, int]] = field(default_factory=list)
    taken: bool = False  # its read was taken (awaited or cancelled)

    async def read(self, device: gpu.Device) -> int:
        self.taken = True
        return int((await device.read_staging(self.staging, 4)).view(np.uint32)[0])

    def discard(self, device: gpu.Device) -> None:
        """Cancel the read if no decode loop took it (one that failed first, or never ran), so the
        staging buffer is free for the next prompt."""
        if not self.taken:
            self.taken = True
            device.cancel_read(self.staging)


# Verify steps take their rows' tokens (greedy) or logits (sampled, for settings ScreenedSampling
# serves) through the int8 screen where the model has one (kernels/head_screen.py ScreenedVerifyArgmax,
# ScreenedVerifyLogits: the same tokens as through the F16 head)
SCREEN_VERIFY_ROWS = True
MAX_STEPS_PER_SUBMIT = 16  # decode steps one submit may hold (slots of the model's StepAdvance log)
# Steps of a reply's first submit, at most: the GPU waits for that submit's recording (in a browser
# ~0.4 ms a 2B-4T step), so a short one starts it sooner and brings the first tokens out early, while
# the host records the full-sized submits behind it.
FIRST_SUBMIT_STEPS = 4


class RecordedAhead:
    """One submit recorded (and encoded) ahead, while the host waits for a readback, so that only its
    submit stands between the readback and the GPU's next work. The next launch takes it only if it
    is still the submit wanted then: the same shape (steps, kind), at a position the recording covers."""

    def __init__(self, covers: Callable[[int, int], bool]) -> None:
        self._covers = covers  # covers(recorded position, wanted position)
        self._slot: tuple[int, Hashable, gpu.Recorder] | None = None

    def keep(self, position: int, shape: Hashable, rec: gpu.Recorder) -> None:
        """`shape`: what else the submit must match (its number of steps, their kind)."""
        self._slot = (position, shape, rec)

    def take(self, position: int, shape: Hashable) -> gpu.Recorder | None:
        slot, self._slot = self._slot, None
        if slot is not None and slot[1] == shape and self._covers(slot[0], position):
            return slot[2]
        return None


def read_ends_reply(words: np.ndarray, n: int, stride: int, budget: int, stops: frozenset[int]) -> bool:
    """Whether the `n` speculative steps read back (`stride` words each: n_emitted, the tokens, ...) end
    the reply: a step past its end, a stop token, or the budget's last tokens."""
    emitted = 0
    for j in range(n):
        count = int(words[stride * j])
        if count == 0 or not stops.isdisjoint(words[stride * j + 1 : stride * j + 1 + count].tolist()):
            return True
        emitted += count
    return budget != NO_BUDGET and emitted >= budget


class GPUDecodeLoop:
    """Decoding with the next token id kept on the GPU: only 4 bytes per token come back."""

    _staging: list[gpu.Buffer] | None = None  # ring of host-readable buffers for the chosen ids
    _speculation: dict[int, SpeculationOps] | None = None  # per draft size
    _spec_samplers: dict[int, SpecSampleAccept] | None = None  # sampled acceptance, per draft size
    # of the last speculative decode: drafted tokens, those yielded, verify steps whose output was read,
    # tokens of draft-off steps, steps read back that had run past the reply's end, and steps submitted
    draft_proposed = draft_accepted = verify_steps = plain_steps = idle_steps = launched_steps = 0
    draft_length_counts: list[int] = []  # of the last speculative decode: verify steps per draft length 0..k
    encode_seconds = 0.0  # time spent recording decode steps (Python's share of a token)

    # Decode steps recorded into one submit, and such submits queued on the GPU at once (see
    # _decode_on_gpu): None takes the device's `decode_batching`; tests and benchmarks set it.
    DECODE_BATCHING: tuple[int, int] | None = None
    # Verify steps whose draft lengths give the rows the next submit's steps are expected to keep
    DRAFT_WINDOW = 8

    def decode_batching(self) -> tuple[int, int]:
        """(steps per submit, submits in flight) for the GPU decode loop."""
        steps, in_flight = self.DECODE_BATCHING or self.device.decode_batching
        return max(1, min(int(steps), MAX_STEPS_PER_SUBMIT)), max(1, int(in_flight))

    def _staging_ring(self, count: int, nbytes: int) -> list[gpu.Buffer]:
        """`count` host-readable buffers of at least `nbytes` (kept while the batching stays the same)."""
        ring = self._staging
        if ring is None or len(ring) != count or ring[0].nbytes < nbytes:
            for buffer in ring or ():
                self._buffers.remove(buffer)
                self.device.release(buffer)
            ring = self._staging = [self.device.staging(max(16, nbytes), f"next tokens {i}") for i in range(count)]
            self._buffers.extend(ring)
        return ring

    def _record_gpu_steps(
        self, chooser: Argmax | ScreenedArgmax | GPUSampler | ScreenedSampling, pos: int, k: int, staging: gpu.Buffer
    ) -> gpu.Recorder:
        """`k` decode steps at positions pos.. in one recorder, chained on the GPU: the host writes step
        0's StepParams (queue order: after the submits before this one); step j reads its input id from
        token_ids[0], writes the id chosen on the GPU back there (step j+1's input), logs it at slot j
        and advances StepParams to step j+1 (StepAdvance); one copy after the last step hands the k ids
        to `staging`."""
        self.kv_cache.ensure_capacity(pos + k)  # before recording: growing submits a copy of its own
        self.step.write(1, pos, self.kv_cache.capacity, slot=0)
        rec = self.device.begin()
        logits = not isinstance(chooser, (ScreenedArgmax, ScreenedSampling))  # a screen reads x's digits
        for j in range(k):
            self._record_step(1, all_logits=False, rec=rec, pos=pos + j, params_ready=True, logits=logits)
            chooser.record(rec)
            self.step_advance.record(rec)
        self.step_advance.copy_log(rec, staging, k)
        return rec

    def greedy_chooser(self) -> Argmax | ScreenedArgmax:
        """What picks a greedy decode step's token on the GPU: the screened head where the model has
        one (the step then computes no logits), else the F16 head's logits and Argmax: the same token."""
        return self.screened_argmax or self.argmax

    def decode_greedy(
        self, first_token: int | FirstToken, limit: int | None = None, stop_ids: Sequence[int] = ()
    ) -> AsyncIterator[int]:
        """Feed `first_token`, then yield greedy (argmax) tokens one by one until the context is full
        (the caller stops earlier); a FirstToken (chosen on the GPU by the prompt's last submit, by
        `self.argmax`) is yielded first. `limit`: how many tokens the caller will take at most, so no step
        is queued past it (more are still produced, one submit at a time, if asked for). `stop_ids`:
        tokens after which the caller probably stops (no submit is queued ahead of yielding them)."""
        return self._decode_on_gpu(first_token, self.greedy_chooser(), limit, stop_ids)

    def decode_sampled(
        self,
        first_token: int | FirstToken,
        settings: SamplerSettings,
        seed: int,
        first_draw: int,
        history: list[int] = (),
        limit: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> AsyncIterator[int]:
        """Like decode_greedy, but each token is drawn on the GPU under `settings` (top_k at most
        GPU_TOP_K_MAX, repetition penalty over the tail of `history`, the tokens so far including
        `first_token`) with draws first_draw, first_draw + 1, ... of the stream `seed`
        (sampler.uniform): the same tokens the CPU Sampler would draw from the same logits.
        A FirstToken was drawn by `self.gpu_sampler`, configured before the prompt's last submit, whose
        state (the draw count, the penalty's window) goes on on the GPU: `settings`, `seed`,
        `first_draw` and `history` are then that configuration's and are not uploaded again."""
        if not isinstance(first_token, FirstToken):
            self.gpu_sampler.configure(settings, seed, first_draw, history)
        chooser: GPUSampler | ScreenedSampling = self.gpu_sampler
        if self.screened_argmax is not None and ScreenedSampling.serves(settings):
            chooser = ScreenedSampling(self.screened_argmax, self.gpu_sampler)  # the same tokens
        return self._decode_on_gpu(first_token, chooser, limit, stop_ids)

    async def _decode_on_gpu(
        self,
        first_token: int | FirstToken,
        chooser: Argmax | ScreenedArgmax | GPUSampler | ScreenedSampling,
        limit: int | None = None,
        stop_ids: Sequence[int] = (),
    ) -> AsyncIterator[int]:
        """The next token id never leaves the GPU: each step's choice is the next step's input. Steps
        go to the GPU `steps` to a submit, `in_flight` submits queued at once (decode_batching), and
        the host reads each submit's ids with one readback: in a browser every await of a readback
        costs far more than a step's GPU work (docs/performance.md), so the host must not wait once
        per token. The queue is refilled as soon as a submit's ids are read, before they are yielded
        (in a browser a readback arrives about when the next submit is done, so the GPU waits for
        whatever the caller does with the ids), unless one of them is in `stop_ids`: then after they
        are all yielded, so an end of text wastes at most the steps already queued.

        Invariant: `cached_tokens` holds the inputs of the submitted steps that the host knows (step
        0's is `first_token`, once read if it is a FirstToken; step j's is step j-1's output once
        read); so stopping at any yield leaves the cache consistent (steps already queued past a stop
        token just compute KV rows past `n_cached`, which later steps overwrite).
        """
        steps, in_flight = self.decode_batching()
        ring = self._staging_ring(in_flight + 1, 4 * steps)
        context = self.config.context_length
        stops = frozenset(int(t) for t in stop_ids)
        start = self.n_cached  # step j runs at position start + j
        pending = first_token if isinstance(first_token, FirstToken) else None
        if pending is None:
            self.device.upload(self.token_ids, 0, np.asarray([first_token], dtype=np.uint32))
        queued: deque[tuple[gpu.Buffer, int]] = deque()  # submitted, not read: (staging, steps)
        submitted = launched = 0

        def room() -> int:  # steps the next submit should hold (<= 0: none is needed now)
            n = min(steps, context - start - submitted)
            return n if limit is None else min(n, limit - submitted)

        ahead_rec = RecordedAhead(operator.eq)  # a decode step's recording holds its exact position

        def prepare(k: int) -> gpu.Recorder:
            """Record (and encode) the next submit's k steps without submitting them."""
            encode_start = time.perf_counter()
            rec = self._record_gpu_steps(chooser, start + submitted, k, ring[launched % len(ring)])
            rec.finish()
            self.encode_seconds += time.perf_counter() - encode_start
            return rec

        def launch(k: int) -> None:
            nonlocal submitted, launched
            rec = ahead_rec.take(start + submitted, k) or prepare(k)
            staging = ring[launched % len(ring)]
            rec.submit()
            self.device.start_read(staging)  # before any later submit (gpu.Device.start_read)
            self.last_dispatches, self.last_passes = rec.dispatches // k, rec.passes / k
            queued.append((staging, k))
            submitted += k
            launched += 1

        try:
            if pending is None or room() > 0:  # (a FirstToken alone may be all the caller takes)
                launch(max(1, min(room(), FIRST_SUBMIT_STEPS)))
            if pending is None:
                self.cached_tokens.append(first_token)
            while len(queued) < in_flight and room() > 0:
                launch(room())  # their inputs are earlier steps' outputs, still on the GPU
            if pending is not None:
                first = await pending.read(self.device)
                self.cached_tokens.append(first)
                yield first
            read = 0
            while True:
                if not queued:  # the caller takes more than `limit`: the first token's step, now
                    launch(max(1, room()))
                staging, k = queued.popleft()
                ahead = room() if queued else 0
                if ahead > 0:
                    # The submit that will refill the queue once these ids are yielded, recorded now,
                    # while the host waits for them: then only its submit stands between the readback
                    # and the GPU's next work. Used only if it is still the submit wanted then.
                    ahead_rec.keep(start + submitted, ahead, prepare(ahead))
                tokens = (await self.device.read_staging(staging, 4 * k)).view(np.uint32)[:k].tolist()
                if queued and stops.isdisjoint(tokens):
                    while len(queued) < in_flight and room() > 0:
                        launch(room())  # inputs on the GPU: the queued submit's last output
                for token in tokens:
                    read += 1
                    if read < submitted:
                        self.cached_tokens.append(token)  # it is already the input of a submitted step
                    yield token
                if not queued:  # nothing submitted consumes the last token read
                    if start + submitted >= context:
                        return  # the context is full
                    self.cached_tokens.append(token)
                    launch(max(1, room()))
                while len(queued) < in_flight and room() > 0:
                    launch(room())
        finally:
            for staging, _ in queued:  # stopped early: steps still queued are never read
                self.device.cancel_read(staging)

    # Speculative decoding ----------------------------------------------------------------------

    def speculation_buffers(self, k: int) -> SpecBuffers:
        """The GPU state of verify steps with drafts of `k` tokens: what an acceptance op passed to
        decode_speculative is built on (its `draft`, `state` and `out` buffers, with `self.logits`)."""
        return self._speculation_ops(k).buffers

    def _speculation_ops(self, k: int) -> SpeculationOps:
        """The buffers and ops of verify steps with drafts of `k` tokens (built on first use)."""
        if not 1 <= k <= SPECULATE_MAX:
            raise ValueError(f"speculate takes 0..{SPECULATE_MAX} drafted tokens, got {k}")
        if k + 1 > self.logits_rows:
            raise ValueError(f"speculate={k} needs {k + 1} rows per step; this model was built for {self.logits_rows}")
        if self._speculation is None:
            self._speculation = {}
        ops = self._speculation.get(k)
        if ops is None:
            for layer in self.layer_ops:  # verify rows with RoPE fused in (built at load on a GPU)
                layer.attention.prepare_draft_rows()
            self.lm_head.single_bounded()  # draft-off steps' head, not compiled mid-reply
            if k + 1 <= self.lm_head.small_max:
                self.lm_head.small_t(k + 1)  # verify steps' head (LMHead.record's choice for k + 1 rows)
            # history: the context, plus the tokens a last verify step emits past it
            buffers = SpecBuffers(self.device, k, self.config.context_length + k + 2)
            draft, draft_off = (
                SpecDraft(self.kernels, buffers, self.token_ids, self.step.buffer, NGRAM_MAX, k=size) for size in (k, 0)
            )
            greedy = GreedyAccept(
                self.kernels, self.logits, buffers.draft, buffers.state, buffers.out, self.config.vocab_size, k + 1
            )
            if self.screened_argmax is not None:  # draft-off steps' screened kernels, not compiled mid-reply
                greedy.use_screen(self.screened_argmax)
                if SCREEN_VERIFY_ROWS:  # verify rows through the screen too
                    verify = ScreenedVerifyArgmax(
                        self.screened_argmax, self.x_digits, self.x_digit_stats, self.step, greedy.chosen, k + 1
                    )
                    greedy.use_verify_screen(verify)
                    self._buffers.extend(verify.buffers)
            log = VerifyStepLog(self.kernels, buffers.out, buffers.state, self.step, k, MAX_STEPS_PER_SUBMIT)
            self._buffers.extend(buffers.buffers + greedy.buffers + [log.log])
            ops = self._speculation[k] = SpeculationOps(buffers, draft, draft_off, greedy, log)
        return ops

    def _spec_sampler(self, k: int) -> SpecSampleAccept:
        """The speculative sampling rule's acceptance for drafts of `k` tokens (built on first use)."""
        if self._spec_samplers is None:
            self._spec_samplers = {}
        op = self._spec_samplers.get(k)
        if op is None:
            buffers = self.speculation_buffers(k)
            vocab = self.config.vocab_size
            op = SpecSampleAccept(self.kernels, self.logits, buffers.draft, buffers.state, buffers.out, vocab, k + 1)
            if self.screened_argmax is not None:
                op.use_screen(self.screened_argmax)
                if SCREEN_VERIFY_ROWS:  # verify rows' logits through the screen too
                    verify = ScreenedVerifyLogits(
                        self.screened_argmax, self.logits, self.x_digits, self.x_digit_stats, self.step, k + 1
                    )
                    op.use_verify_screen(verify)
                    self._buffers.extend(verify.buffers)
            self._buffers.extend(op.buffers)
            self._spec_samplers[k] = op
        return op

    def decode_speculative_sampled(
        self,
        first_token: int | FirstToken,
        k: int,
        settings: SamplerSettings,
        seed: int,
        first_draw: int,
        history: list[int],
        limit: int | None = None,
        policy: SpeculationPolicy | None = None,
        stop_ids: Sequence[int] = (),
    ) -> AsyncIterator[int]:
        """decode_speculative with the speculative sampling rule (kernels/spec_sampling.py: a drafted
        token is kept with probability p(x), else one is drawn from p without it), so the tokens are
        distributed as decode_sampled's under `settings`; seeded runs repeat. Draws first_draw.. of
        stream `seed`, two per token (a different sequence from decode_sampled's). `history`: the
        tokens so far including `first_token` (the repetition penalty's window); without it if that is
        a FirstToken (drawn by `self.gpu_sampler` at the draw before first_draw), which the first
        submit copies into the window on the GPU."""
        op = self._spec_sampler(k)
        if isinstance(first_token, FirstToken):
            window = op.configure(settings, seed, first_draw, [*history, 0])  # 0: the token, copied on the GPU
            if window:
                first_token.copies.append((op.state, 4 * (op.RING_AT + window - 1)))
        else:
            op.configure(settings, seed, first_draw, history)
        screened = ScreenedSampling.serves(settings)  # a penalty below 1 keeps the F16 head
        return self.decode_speculative(first_token, k, limit, op, policy, stop_ids, screened)

    def _record_verify_steps(
        self,
        k: int,
        n_steps: int,
        rows: int,
        staging: gpu.Buffer,
        pos_bound: int,
        accept: Acceptance,
        live_rows: float | None = None,
        first_copies: Sequence[tuple[gpu.Buffer, int]] = (),
        rec: gpu.Recorder | None = None,
        screened: bool = False,
    ) -> gpu.Recorder:
        """`n_steps` steps of `rows` rows each (k + 1: verify steps of drafts of k tokens; 1: draft-off
        steps) in one recorder. Step j drafts on the GPU (which also sets its StepParams), runs its
        rows with every row's logits, accepts, and logs its out slice and draft_len at slot j
        (VerifyStepLog); one copy after the last step hands words (k + 3) j.. to `staging`.
        `pos_bound`: the largest position step 0 can have (each step advances 1..rows): attention
        dispatches enough splits for it. `live_rows`: the rows a step is expected to keep (draft + 1),
        which picks the BitLinears' kernels (NormTernaryLinear.record). `first_copies`: where token_ids[0]
        (a FirstToken) is copied before the first step (FirstToken.copies). `rec`: record into this one
        (a profiled recorder) instead of a new one. `screened`: draft-off steps take their token through
        the screen `accept` uses (`use_screen`), from the final norm's digits instead of logits."""
        ops = self._speculation_ops(k)
        draft = ops.draft if rows > 1 else ops.draft_off
        self.step.reset_slot()  # queue order: after the submits before this one
        rec = rec or self.device.begin()
        for buffer, offset in first_copies:
            rec.copy(self.token_ids, 0, buffer, offset, 4)
        through_screen = screened and rows == 1
        rows_screened = screened and rows > 1 and accept.verify_screen is not None
        for j in range(n_steps):
            draft.record(rec)  # also writes the step's StepParams
            pos = pos_bound + j * rows
            if through_screen:
                self._record_step(1, all_logits=False, rec=rec, pos=pos, params_on_gpu=True, logits=False)
                accept.record_screened(rec)
            elif rows_screened:
                self._record_step(
                    rows, all_logits=True, rec=rec, pos=pos, params_on_gpu=True, live_rows=live_rows, logits=False
                )
                accept.record_rows_screened(rec, rows)
            else:
                self._record_step(rows, all_logits=True, rec=rec, pos=pos, params_on_gpu=True, live_rows=live_rows)
                accept.record(rec, rows)
            ops.log.record(rec)
        ops.log.copy_log(rec, staging, n_steps)
        return rec

    async def decode_speculative(
        self,
        first_token: int | FirstToken,
        k: int,
        limit: int | None = None,
        accept: Acceptance | None = None,
        policy: SpeculationPolicy | None = None,
        stop_ids: Sequence[int] = (),
        screened: bool = True,
    ) -> AsyncIterator[int]:
        """Greedy decoding, `first_token` first fed, with steps that verify a prompt-lookup draft of up
        to `k` tokens (model/speculation.py's rules, run on the GPU): the same tokens as decode_greedy,
        1..k+1 of them per forward pass. `limit` as in decode_greedy. `accept`: the acceptance op in
        place of greedy acceptance (decode_speculative_sampled: the speculative sampling rule). A
        FirstToken (chosen on the GPU by the prompt's last submit) is yielded first; the first submit
        copies it into the draft history (and `first_token.copies`) before its steps.

        Every step's input and position are known on the GPU only (each step folds the tokens the
        previous one emitted), so steps queue without readbacks, `steps` to a submit and `in_flight`
        submits at once (decode_batching), and the host reads each submit's output once. A submit
        holds verify steps (k + 1 rows) or draft-off steps (one row, no lookup: a decode step that
        also folds): draft-off where `policy` (fed every token) says verifying does not pay, and near
        the context end, where a verify step's k + 1 rows no longer fit; without a policy every step
        that fits verifies. Steps of both kinds share the GPU state, so switching between them costs
        no readback: the GPU never waits for the host.

        A verify step computes the KV rows of its input token and of every accepted draft token; its
        last emitted token is the next step's input; rows of rejected drafts lie past `n_cached` and
        are overwritten later. `cached_tokens` holds the inputs of the submitted steps the host knows
        (as in _decode_on_gpu), so stopping at any yield leaves the cache consistent.

        The reply also ends on the GPU, after `limit` tokens or a token of `stop_ids` (SpecBuffers.start):
        the steps queued past its end (up to a submit or two: the host learns of the end only from a
        readback) then leave every kernel at once and emit nothing, instead of costing a whole step
        each. The host tracks that end exactly (such steps compute no row, so their input is not
        cached); a caller that reads on past it reopens the reply (SpecBuffers.reopen) and gets the
        same tokens as without the end.

        `draft_proposed` / `draft_accepted` count the drafted tokens of the verify steps whose output
        was yielded, and those of them yielded (each step's last token is the model's own choice);
        `verify_steps` those steps (`draft_length_counts[d]`: those with a draft of d tokens),
        `plain_steps` the tokens of draft-off steps, `idle_steps` the steps read back that the GPU ran
        past the reply's end, `launched_steps` the steps submitted (read or not).

        `screened`: draft-off steps take their token through the model's int8 screen where it has one
        (the same token; decode_speculative_sampled passes False for a repetition penalty below 1).
        """
        self.draft_proposed = self.draft_accepted = self.verify_steps = self.plain_steps = self.idle_steps = 0
        self.launched_steps = 0
        self.draft_length_counts = [0] * (k + 1)
        ops = self._speculation_ops(k)  # a bad k fails here, before any step
        accept = accept or ops.greedy
        # draft-off steps take their token through the int8 screen where the model has one (and
        # `screened`: the caller's settings allow it); verify steps' rows read the F16 head's logits
        screen = self.screened_argmax if screened else None
        if screen is not None and accept.screen is not screen:
            accept.use_screen(screen)
        draft_off_screened = screen is not None
        first_pending = first_token if isinstance(first_token, FirstToken) else None
        known = [] if first_pending else [first_token]  # the first token, once the host knows it
        if policy is not None and known:
            policy.start(self.cached_tokens + known)
        steps, in_flight = self.decode_batching()
        split_min = split_min_live_rows(self.device)  # the rows that make a recording take the split path
        stride = k + 3
        ring = self._staging_ring(in_flight + 1, 4 * stride * steps)
        context = self.config.context_length
        pos = self.n_cached  # the next unread step's position (exact: every step before it is read)
        emitted = 0  # tokens yielded (first_token not counted)
        start_history = self.cached_tokens + (known or [0])  # 0: a FirstToken, copied in on the GPU
        ops.buffers.start(start_history, self.kv_cache.capacity, limit, stop_ids)
        first_copies = []
        if first_pending is not None:
            first_copies = [(ops.buffers.history, 4 * (len(start_history) - 1)), *first_pending.copies]
        # what the GPU's budget is once every step read so far has folded (0: the reply ended there),
        # tracked exactly: so the host knows which queued steps run and which leave at once
        budget = NO_BUDGET if limit is None else limit
        gpu_stops = gpu_stop_ids(stop_ids)
        stops = frozenset(int(t) for t in stop_ids)  # where the caller probably stops (it checks them all)
        queued: deque[tuple[gpu.Buffer, int, int]] = deque()  # submitted, not read: (staging, steps, rows)
        pending = pending_rows = 0  # steps submitted and not read; the most rows they can take
        launched = 0
        last = known[0] if known else 0  # the next step's input, not in cached_tokens until a step computes it
        # draft lengths of the last verify steps read; first, of the one the first step will draft
        # (guessed from the text before a FirstToken: it only picks the first submits' kernels)
        recent_drafts = deque([len(prompt_lookup_draft(self.cached_tokens + known, k))], maxlen=self.DRAFT_WINDOW)
        recent_emitted = deque([1 + recent_drafts[0]], maxlen=self.DRAFT_WINDOW)  # tokens of those steps

        def expected_live(n: int) -> float:
            """Rows each verify step of a submit of `n` launched now is expected to keep: 1 + the recent
            mean draft; 1 where the submit probably reaches the reply's limit (the split path's steps
            past the end cost more than the fused one's: its extra dispatches)."""
            per_step = sum(recent_emitted) / len(recent_emitted)
            if limit is not None and emitted + (pending + n) * per_step >= limit:
                return 1.0
            return 1.0 + sum(recent_drafts) / len(recent_drafts)

        def next_submit() -> tuple[int, int]:
            """(steps, rows per step) of the next submit; no steps when none is due now."""
            rows = k + 1
            if budget == 0:
                return 0, rows  # the reply ended on the GPU: more only if the caller reads on
            if policy is not None and not policy.speculating:
                rows = 1
            elif pos + pending_rows + k + 1 > context:  # a verify step may not fit
                if pending:
                    return 0, rows  # decided once the queued steps are read and the position is exact
                rows = 1
            n = min(steps, (context - pos - pending_rows) // rows)
            return (n if limit is None else min(n, limit - emitted - pending)), rows

        # a recording made for a larger position bound is as exact (attention covers more splits, unused ones exit)
        ahead_rec = RecordedAhead(operator.ge)

        def prepare(n: int, rows: int, bound: int, live: float) -> gpu.Recorder:
            """Record (and encode) n steps of `rows` rows, the first at a position <= bound, without submitting."""
            encode_start = time.perf_counter()
            if self.kv_cache.ensure_capacity(bound + n * rows):
                ops.buffers.set_kv_capacity(self.kv_cache.capacity)
            copies = first_copies if launched == 0 else ()
            staging = ring[launched % len(ring)]
            rec = self._record_verify_steps(
                k, n, rows, staging, bound, accept, live, copies, screened=draft_off_screened
            )
            rec.finish()
            self.encode_seconds += time.perf_counter() - encode_start
            return rec

        def launch(n: int, rows: int) -> None:
            nonlocal pending, pending_rows, launched
            bound = pos + pending_rows
            live = expected_live(n)  # the recording's kernels depend on it only through the split choice
            shape = (n, rows, live >= split_min)
            rec = ahead_rec.take(bound, shape) or prepare(n, rows, bound, live)
            staging = ring[launched % len(ring)]
            rec.submit()
            self.device.start_read(staging)  # before any later submit (gpu.Device.start_read)
            self.last_dispatches, self.last_passes = rec.dispatches // n, rec.passes / n
            queued.append((staging, n, rows))
            pending += n
            pending_rows += n * rows
            launched += 1
            self.launched_steps += n

        try:
            while pos < context:
                if not queued:
                    if budget == 0:  # the caller reads past the reply's end: the GPU's steps go on
                        ops.buffers.reopen()
                        budget, gpu_stops, stops = NO_BUDGET, frozenset(), frozenset()
                    n, rows = next_submit()
                    launch(max(1, n if launched else min(n, FIRST_SUBMIT_STEPS)), rows)
                    if len(self.cached_tokens) == pos and known:
                        self.cached_tokens.append(last)  # the step computes its row
                while len(queued) < in_flight and (ahead := next_submit())[0] > 0:
                    launch(*ahead)
                if not known:  # a FirstToken: its steps are queued, now the host learns it
                    last = await first_pending.read(self.device)
                    known.append(last)
                    self.cached_tokens.append(last)  # the first step computes its row
                    if policy is not None:
                        policy.start(list(self.cached_tokens))
                    yield last
                staging, n, rows = queued.popleft()
                ahead = next_submit() if queued else (0, 0)
                if ahead[0] > 0:  # the refilling submit, recorded while the host waits (as in _decode_on_gpu)
                    bound, live = pos + pending_rows, expected_live(ahead[0])
                    ahead_rec.keep(bound, (*ahead, live >= split_min), prepare(*ahead, bound, live))
                raw = (await self.device.read_staging(staging, 4 * stride * n)).view(np.uint32)
                if ahead[0] > 0 and not read_ends_reply(raw, n, stride, budget, stops):
                    # the refill before the host's work on these steps (as in _decode_on_gpu); decided on the
                    # state before them, as recorded, which only overestimates the position
                    while len(queued) < in_flight and (more := next_submit())[0] > 0:
                        launch(*more)
                for j in range(n):
                    pending -= 1
                    pending_rows -= rows
                    row = raw[stride * j : stride * (j + 1)].tolist()
                    n_emitted, tokens, draft_len = row[0], row[1 : 1 + row[0]], row[k + 2]
                    if n_emitted == 0:  # queued past the reply's end: it left at once
                        self.idle_steps += 1
                        continue
                    pos += n_emitted
                    last = tokens[-1]
                    if budget != NO_BUDGET:
                        budget -= min(n_emitted, budget)
                    if not gpu_stops.isdisjoint(tokens):
                        budget = 0
                    verified = rows > 1
                    if verified:
                        recent_drafts.append(draft_len)
                        recent_emitted.append(n_emitted)
                        self.draft_proposed += draft_len
                        self.draft_length_counts[min(draft_len, k)] += 1
                        self.verify_steps += 1
                        if policy is not None:
                            policy.verify_step(n_emitted, draft_len)
                    else:
                        self.plain_steps += 1
                    for i, token in enumerate(tokens):
                        emitted += 1
                        if i < n_emitted - 1:
                            self.draft_accepted += 1
                            self.cached_tokens.append(token)  # an accepted draft: its row was computed
                        elif pending and budget:
                            self.cached_tokens.append(token)  # the input of a submitted step that runs
                        if policy is not None:
                            policy.push(token, verified)
                        yield token
        finally:
            for staging, _, _ in queued:  # stopped early: steps still queued are never read
                self.device.cancel_read(staging)
