"""The GPU decode loop: tokens chosen on the GPU (greedy argmax or seeded sampling), steps queued ahead.

Apart from the math (forward.py), as gpt-fast keeps generate.py apart from model.py. `GPUDecodeLoop`
is a base class of `BitNetModel`; it uses the model's `_record_step`, `token_ids`, `argmax`,
`gpu_sampler`, `cached_tokens`, `device` and `_buffers`, and owns the staging ring it reads
token ids from.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import numpy as np

from .. import gpu
from ..kernels.embedding import Argmax
from ..kernels.sampling import GPUSampler
from ..text.sampler import SamplerSettings


class GPUDecodeLoop:
    """Decoding with the next token id kept on the GPU: only 4 bytes per token come back."""

    _staging: list[gpu.Buffer] | None = None  # ring of 16-byte host-readable slots for the chosen ids
    encode_seconds = 0.0  # time spent recording decode steps (Python's share of a token)

    def _record_gpu_step(self, staging: gpu.Buffer, chooser: Argmax | GPUSampler, pos: int) -> gpu.Recorder:
        """A decode step at `pos` that reads its input id from token_ids[0], writes the next id
        chosen on the GPU back there (the next step's input) and copies it to `staging` for the host."""
        rec = self._record_step(1, all_logits=False, pos=pos)
        chooser.record(rec)
        rec.copy(self.token_ids, 0, staging, 0, 4)
        return rec

    GREEDY_DEPTH = 2  # decode steps queued on the GPU at once

    def decode_greedy(self, first_token: int) -> AsyncIterator[int]:
        """Feed `first_token`, then yield greedy (argmax) tokens one by one, forever (the caller stops)."""
        return self._decode_on_gpu(first_token, self.argmax)

    def decode_sampled(
        self, first_token: int, settings: SamplerSettings, seed: int, first_draw: int, history: list[int] = ()
    ) -> AsyncIterator[int]:
        """Like decode_greedy, but each token is drawn on the GPU under `settings` (top_k at most
        GPU_TOP_K_MAX, repetition penalty over the tail of `history`, the tokens so far including
        `first_token`) with draws first_draw, first_draw + 1, ... of the stream `seed`
        (sampler.uniform): the same tokens the CPU Sampler would draw from the same logits."""
        self.gpu_sampler.configure(settings, seed, first_draw, history)
        return self._decode_on_gpu(first_token, self.gpu_sampler)

    async def _decode_on_gpu(self, first_token: int, chooser: Argmax | GPUSampler) -> AsyncIterator[int]:
        """The next token id never leaves the GPU: each step's choice is the next step's input, so
        GREEDY_DEPTH steps are queued at once and the GPU never waits for Python; only 4 bytes per
        token come back, read from a ring of staging buffers. Invariant: `cached_tokens` holds the
        inputs of the submitted steps that the host knows (step 0's is `first_token`, step j's is
        step j-1's output once read); so stopping at any yield leaves the cache consistent (steps
        already queued past a stop token just compute KV rows past `n_cached`, which later steps
        overwrite).
        """
        depth = self.GREEDY_DEPTH
        if self._staging is None or len(self._staging) != depth + 1:
            for buffer in self._staging or ():
                self._buffers.remove(buffer)
                self.device.release(buffer)
            self._staging = [self.device.staging(16, f"next token {i}") for i in range(depth + 1)]
            self._buffers.extend(self._staging)
        ring = len(self._staging)
        context = self.config.context_length
        start = self.n_cached  # step j runs at position start + j
        self.device.upload(self.token_ids, 0, np.asarray([first_token], dtype=np.uint32))
        submitted = 0  # steps submitted; step j writes its output token to staging[j % ring]

        def launch() -> None:
            nonlocal submitted
            encode_start = time.perf_counter()
            rec = self._record_gpu_step(self._staging[submitted % ring], chooser, start + submitted)
            rec.finish()
            self.encode_seconds += time.perf_counter() - encode_start
            rec.submit()
            self.last_dispatches, self.last_passes = rec.dispatches, rec.passes
            submitted += 1

        launch()
        self.cached_tokens.append(first_token)
        while submitted < depth and start + submitted < context:
            launch()  # its input is the previous step's output, still on the GPU
        read = 0
        while True:
            raw = await self.device.read_staging(self._staging[read % ring], 4)
            token = int(raw.view(np.uint32)[0])
            read += 1
            if submitted > read:
                self.cached_tokens.append(token)  # it is already the input of a queued step
            yield token
            if start + submitted >= context:
                if submitted == read:  # the context is full: nothing queued consumes `token`
                    return
            elif submitted == read:  # nothing queued (GREEDY_DEPTH 1): `token` is the next step's input
                self.cached_tokens.append(token)
                launch()
            else:
                launch()
