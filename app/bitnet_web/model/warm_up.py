"""Raising the GPU's clocks before a reply: the chat page runs this while the person types.

A GPU left idle for a few seconds lowers its clocks, and the next reply runs its first hundreds of
milliseconds at a fraction of the speed: on the H200, 5 s after a reply the SM clock is 345 MHz
against 1,980, and the same 128-token 2B-4T reply takes 384-400 ms against 161 (191-248 against 63
with drafts); pauses of up to 1.5 s cost nothing (docs/performance.md, session 22). About 300 ms of
work just before the reply bring the clocks back, and they stay up for over a second after it.

The work is the model's LM head, the largest matrix a step reads, computed from a zero row into
logits of its own (reads at full bandwidth), each pass followed by a dispatch of pure arithmetic
(kernels/busy.py): a small model's head takes microseconds, too little for the GPU to raise its clocks
again (the bundled 27M model's replies stayed at 345 MHz after a pause, session 23). No state a reply
uses is touched. It runs in submits of
a few milliseconds, two in flight, each awaited through a 4-byte staging buffer of its own, so a
reply that starts meanwhile waits for at most two of them (`should_stop` ends the loop between
submits).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from .. import gpu
from ..kernels.busy import GPUBusy
from ..kernels.common import KernelCache, StepParams
from ..kernels.embedding import F16Matrix, Int8Matrix, LMHead

SUBMIT_S = 0.004  # submits grow until one cycle takes this: what a reply starting meanwhile may wait
MAX_HEADS_PER_SUBMIT = 512  # a small model's head takes microseconds: many per submit


@dataclass
class WarmUpStats:
    seconds: float = 0.0  # wall time of the loop
    submits: int = 0
    heads: int = 0  # LM-head passes computed, each followed by a GPUBusy dispatch
    stopped: bool = False  # ended by `should_stop` before `seconds`

    def as_dict(self) -> dict:
        return asdict(self)


class GPUWarmUp:
    """LM-head passes over `matrix` into scratch buffers and arithmetic, for about a given time (see the
    module doc)."""

    def __init__(self, kernels: KernelCache, matrix: F16Matrix | Int8Matrix, step: StepParams):
        device = kernels.device
        self.device = device
        self.x = device.buffer(4 * matrix.n_cols, gpu.STORAGE_USAGE, "warm-up row")  # [n_cols] f32 zeros
        self.logits = device.buffer(4 * matrix.n_rows, gpu.STORAGE_USAGE, "warm-up logits")  # [n_rows] f32
        self.stagings = [device.staging(4, f"warm-up staging {i}") for i in range(2)]
        # the model's own head kernel (the same pipeline, from the kernel cache), bound to the scratch
        self.head = LMHead(kernels, matrix, self.x, self.logits, step, "warm-up head")
        self.busy = GPUBusy(kernels, "warm-up busy")
        self.buffers = [self.x, self.logits, *self.stagings, self.busy.sink]

    async def run_async(self, seconds: float, should_stop: Callable[[], bool] = lambda: False) -> WarmUpStats:
        """Keep the GPU busy for about `seconds`, or until `should_stop()` says a reply is starting.

        Two submits are in flight, so the GPU runs one while the host waits for the other's read (a
        browser resolves a read a few milliseconds after its submit: one at a time, the GPU would idle
        most of the time and its clocks would stay down). A submit grows until its cycle takes SUBMIT_S."""
        stats = WarmUpStats()
        start = last = time.perf_counter()
        per_submit = 1
        pending: list[gpu.Buffer] = []
        while True:
            if should_stop():
                stats.stopped = True
                break
            if time.perf_counter() - start >= seconds:
                break
            staging = self.stagings[stats.submits % 2]
            rec = self.device.begin()
            for _ in range(per_submit):
                self.head.record(rec, 1)
                self.busy.record(rec)
            rec.copy(self.logits, 0, staging, 0, 4)
            rec.submit()
            self.device.start_read(staging)
            pending.append(staging)
            stats.submits += 1
            stats.heads += per_submit
            if len(pending) == 2:
                await self.device.read_staging(pending.pop(0), 4)
                await asyncio.sleep(0)  # a reply asked for meanwhile starts here (a native read never yields)
                now = time.perf_counter()
                if now - last < SUBMIT_S and per_submit < MAX_HEADS_PER_SUBMIT:
                    per_submit *= 2
                last = now
        for staging in pending:
            await self.device.read_staging(staging, 4)
        stats.seconds = time.perf_counter() - start
        return stats
