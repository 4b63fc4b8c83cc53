"""The GPU decode loop: tokens chosen on the GPU (greedy argmax or seeded sampling), steps queued ahead,
several to a submit.

Apart from the math (forward.py), as gpt-fast keeps generate.py apart from model.py. `GPUDecodeLoop`
is a base class of `BitNetModel`; it uses the model's `_record_step`, `token_ids`, `argmax`,
`gpu_sampler`, `cached_tokens`, `device`, `kv_cache`, `step_rows` and `_buffers`, and owns the
staging ring it reads token ids from.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator

import numpy as np

from .. import gpu
from ..kernels.common import StepParams
from ..kernels.embedding import Argmax
from ..kernels.sampling import GPUSampler
from ..text.sampler import SamplerSettings

MAX_STEPS_PER_SUBMIT = 16  # decode steps one submit may hold (rows of the model's step_rows)


class GPUDecodeLoop:
    """Decoding with the next token id kept on the GPU: only 4 bytes per token come back."""

    _staging: list[gpu.Buffer] | None = None  # ring of host-readable buffers for the chosen ids
    encode_seconds = 0.0  # time spent recording decode steps (Python's share of a token)

    # Decode steps recorded into one submit, and such submits queued on the GPU at once (see
    # _decode_on_gpu): None takes the device's `decode_batching`; tests and benchmarks set it.
    DECODE_BATCHING: tuple[int, int] | None = None

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

    def _record_gpu_steps(self, chooser: Argmax | GPUSampler, pos: int, k: int, staging: gpu.Buffer) -> gpu.Recorder:
        """`k` decode steps at positions pos.. in one recorder. Step j copies its StepParams from row j
        of step_rows (uploaded here, before the submit: queue order keeps earlier submits' rows), reads
        its input id from token_ids[0], writes the id chosen on the GPU back there (step j+1's input)
        and copies it to bytes 4j.. of `staging` for the host."""
        self.kv_cache.ensure_capacity(pos + k)  # before recording: growing submits a copy of its own
        rows = self._step_rows_host[:k]
        for j in range(k):
            StepParams.pack(rows[j], 1, pos + j, self.kv_cache.capacity)
        self.device.upload(self.step_rows, 0, rows)
        rec = self.device.begin()
        for j in range(k):
            self._record_step(1, all_logits=False, rec=rec, pos=pos + j, step_row=j)
            chooser.record(rec)
            rec.copy(self.token_ids, 0, staging, 4 * j, 4)
        return rec

    def decode_greedy(self, first_token: int, limit: int | None = None) -> AsyncIterator[int]:
        """Feed `first_token`, then yield greedy (argmax) tokens one by one until the context is full
        (the caller stops earlier). `limit`: how many tokens the caller will take at most, so no step
        is queued past it (more are still produced, one submit at a time, if asked for)."""
        return self._decode_on_gpu(first_token, self.argmax, limit)

    def decode_sampled(
        self,
        first_token: int,
        settings: SamplerSettings,
        seed: int,
        first_draw: int,
        history: list[int] = (),
        limit: int | None = None,
    ) -> AsyncIterator[int]:
        """Like decode_greedy, but each token is drawn on the GPU under `settings` (top_k at most
        GPU_TOP_K_MAX, repetition penalty over the tail of `history`, the tokens so far including
        `first_token`) with draws first_draw, first_draw + 1, ... of the stream `seed`
        (sampler.uniform): the same tokens the CPU Sampler would draw from the same logits."""
        self.gpu_sampler.configure(settings, seed, first_draw, history)
        return self._decode_on_gpu(first_token, self.gpu_sampler, limit)

    async def _decode_on_gpu(
        self, first_token: int, chooser: Argmax | GPUSampler, limit: int | None = None
    ) -> AsyncIterator[int]:
        """The next token id never leaves the GPU: each step's choice is the next step's input. Steps
        go to the GPU `steps` to a submit, `in_flight` submits queued at once (decode_batching), and
        the host reads each submit's ids with one readback: in a browser every await of a readback
        costs far more than a step's GPU work (docs/performance.md), so the host must not wait once
        per token. The ids are yielded one by one and the queue is refilled after a submit's ids are
        all yielded, so a stop wastes at most the steps already queued.

        Invariant: `cached_tokens` holds the inputs of the submitted steps that the host knows (step
        0's is `first_token`, step j's is step j-1's output once read); so stopping at any yield
        leaves the cache consistent (steps already queued past a stop token just compute KV rows
        past `n_cached`, which later steps overwrite).
        """
        steps, in_flight = self.decode_batching()
        ring = self._staging_ring(in_flight + 1, 4 * steps)
        context = self.config.context_length
        start = self.n_cached  # step j runs at position start + j
        self.device.upload(self.token_ids, 0, np.asarray([first_token], dtype=np.uint32))
        queued: deque[tuple[gpu.Buffer, int]] = deque()  # submitted, not read: (staging, steps)
        submitted = launched = 0

        def room() -> int:  # steps the next submit should hold (<= 0: none is needed now)
            n = min(steps, context - start - submitted)
            return n if limit is None else min(n, limit - submitted)

        def launch(k: int) -> None:
            nonlocal submitted, launched
            encode_start = time.perf_counter()
            staging = ring[launched % len(ring)]
            rec = self._record_gpu_steps(chooser, start + submitted, k, staging)
            rec.finish()
            self.encode_seconds += time.perf_counter() - encode_start
            rec.submit()
            self.last_dispatches, self.last_passes = rec.dispatches // k, rec.passes // k
            queued.append((staging, k))
            submitted += k
            launched += 1

        launch(max(1, room()))
        self.cached_tokens.append(first_token)
        while len(queued) < in_flight and room() > 0:
            launch(room())  # their inputs are earlier steps' outputs, still on the GPU
        read = 0
        while True:
            staging, k = queued.popleft()
            raw = await self.device.read_staging(staging, 4 * k)
            for token in raw.view(np.uint32)[:k].tolist():
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
