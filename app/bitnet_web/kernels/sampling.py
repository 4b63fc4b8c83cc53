"""Seeded top-k sampling on the GPU (shaders/sample_topk.wgsl): the next token id is written where
the next decode step reads it, so sampled decoding queues steps like greedy decoding does.

Levels: the logits are cut into N-wide spans whose best K pairs are kept; while more than N pairs
remain, N-wide groups of them are merged the same way; the last level sorts at most N pairs and
draws. For the Llama 3 vocabulary (128256): 126 spans -> 8064 pairs -> 8 groups -> 512 -> draw.
After an int8 screen (kernels/head_screen.py) one workgroup draws from the screen's candidate list
instead (`draw_from_candidates`): one dispatch, the same token.
"""

from __future__ import annotations

import numpy as np

from .. import gpu
from ..text.sampler import GPU_PENALTY_WINDOW_MAX, GPU_TOP_K_MAX, SamplerSettings
from .common import KernelCache, ceil_div, check_token_pick

SORT_WIDTH = 1024  # pairs sorted per workgroup (8 KB of workgroup memory)
SAMPLE_WORKGROUP = 256  # >= GPU_TOP_K_MAX: the draw gives each candidate one thread
# The _topk_sort snippet's constants, shared by sample_topk.wgsl and spec_sample.wgsl
SORT_SHAPE = dict(
    WG=SAMPLE_WORKGROUP,
    N=SORT_WIDTH,
    K=GPU_TOP_K_MAX,
    PER=SORT_WIDTH // SAMPLE_WORKGROUP,
    PAIRS=SORT_WIDTH // (2 * SAMPLE_WORKGROUP),
)


def candidate_draw_constants(key_slots: int) -> dict[str, int]:
    """The constants of a draw from a screen's candidate list (FINAL CANDIDATES of sample_topk.wgsl and
    spec_sample.wgsl, _candidate_sort.wgsl): the screen's key slots, the penalty ring's room, the sort."""
    return dict(KEY_SLOTS=key_slots, RING_MAX=GPU_PENALTY_WINDOW_MAX, **SORT_SHAPE)


class GPUSampler:
    """out_ids[slot] = a token drawn from logits[row] under `settings` (set with `configure`)."""

    PARAMS_NBYTES = 32
    RING_AT = 4  # state words before the ring: counter, status, ring length, ring head
    STATE_NBYTES = 4 * (RING_AT + GPU_PENALTY_WINDOW_MAX)

    def __init__(
        self,
        kernels: KernelCache,
        logits: gpu.Buffer,
        out_ids: gpu.Buffer,
        vocab_size: int,
        slot: int = 0,
        row: int = 0,
        label: str = "sampler",
    ):
        check_token_pick(label, logits, out_ids, vocab_size, row, slot)
        device = kernels.device
        self.device = device
        shape = SORT_SHAPE
        self.buffers: list[gpu.Buffer] = []
        self.dispatches: list[tuple[gpu.Pipeline, object, int]] = []

        def lists(n_pairs: int, level: int) -> gpu.Buffer:
            buffer = device.buffer(8 * n_pairs, label=f"{label} candidates {level}")  # (n,) vec2<u32>
            self.buffers.append(buffer)
            return buffer

        groups = ceil_div(vocab_size, SORT_WIDTH)
        first = kernels.pipeline("sample_topk", V=vocab_size, ROW=row, **shape)
        pairs = groups * GPU_TOP_K_MAX
        current = lists(pairs, 0)
        self.dispatches.append((first, device.bind_group(first, [logits, current], f"{label} spans"), groups))
        while pairs > SORT_WIDTH:
            groups = ceil_div(pairs, SORT_WIDTH)
            merge = kernels.pipeline("sample_topk", defines=("MERGE", "LISTS"), N_IN=pairs, **shape)
            merged = lists(groups * GPU_TOP_K_MAX, len(self.buffers))
            self.dispatches.append((merge, device.bind_group(merge, [current, merged], f"{label} merge"), groups))
            current, pairs = merged, groups * GPU_TOP_K_MAX
        self.params = device.buffer(self.PARAMS_NBYTES, gpu.UNIFORM_USAGE, f"{label} params")
        self.state = device.buffer(self.STATE_NBYTES, label=f"{label} state")  # see sample_topk.wgsl
        self.buffers += [self.params, self.state]
        penalty = kernels.pipeline("sample_topk", defines=("PENALTY",), V=vocab_size, ROW=row, **shape)
        self.penalty = (penalty, device.bind_group(penalty, [logits, self.params, self.state], f"{label} penalty"), 1)
        self.penalty_active = False
        final = kernels.pipeline("sample_topk", defines=("FINAL", "LISTS"), N_IN=pairs, SLOT=slot, **shape)
        bind = device.bind_group(final, [current, self.params, self.state, out_ids], f"{label} draw")
        self.dispatches.append((final, bind, 1))
        self._draw_args = (kernels, out_ids, slot, label)
        self.candidate_draw: tuple[gpu.Pipeline, gpu.BindGroup, int] | None = None
        self.cleared_keys: gpu.Buffer | None = None

    def draw_from_candidates(self, candidates: gpu.Buffer, keys: gpu.Buffer, key_slots: int) -> None:
        """Build the one-dispatch draw of a screened sampled step (`record_candidate_draw`): from the
        candidate list `candidates` (kernels/head_screen.py `record_candidates`) under this sampler's
        settings and state; it empties the list and zeroes `keys` (the screen's lower-bound keys,
        which must be clear for the next step's screen)."""
        kernels, out_ids, slot, label = self._draw_args
        final = kernels.pipeline(
            "sample_topk", defines=("FINAL", "CANDIDATES"), SLOT=slot, **candidate_draw_constants(key_slots)
        )
        bind = kernels.device.bind_group(
            final, [candidates, self.params, self.state, out_ids, keys], f"{label} draw from candidates"
        )
        self.candidate_draw = (final, bind, 1)
        self.cleared_keys = keys

    def configure(self, settings: SamplerSettings, seed: int, first_draw: int, history: list[int] = ()) -> int:
        """Settings for the next steps, and the stream position: the next step uses draw `first_draw`
        of stream `seed` (sampler.uniform), then the count goes up by one per step on the GPU.
        `history`: the tokens so far (the repetition penalty's window starts with its tail: its
        last w tokens are state words RING_AT .. RING_AT + w - 1; returns w, 0 without a penalty).
        Temperature 0 (greedy with a penalty) is drawn as top-k 1."""
        greedy = settings.temperature == 0
        window = settings.repeat_last_n if settings.repetition_penalty != 1.0 else 0
        if not (greedy or 0 < settings.top_k <= GPU_TOP_K_MAX) or not 0 <= window <= GPU_PENALTY_WINDOW_MAX:
            raise ValueError(
                f"the GPU sampler needs top_k in 1..{GPU_TOP_K_MAX} (or temperature 0) and a "
                f"repetition-penalty window in 0..{GPU_PENALTY_WINDOW_MAX}, got top_k={settings.top_k}, "
                f"repeat_last_n={settings.repeat_last_n}"
            )
        params = np.zeros(8, dtype=np.uint32)
        params[0] = 1 if greedy else settings.top_k
        floats = [1.0, 0.0, 1.0] if greedy else [settings.top_p, settings.min_p, 1.0 / settings.temperature]
        params[1:4] = np.array(floats, dtype=np.float32).view(np.uint32)
        params[4], params[5] = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
        params[6] = np.array([settings.repetition_penalty], dtype=np.float32).view(np.uint32)[0]
        params[7] = window
        recent = list(history)[-window:] if window else []
        state = np.zeros(self.RING_AT + GPU_PENALTY_WINDOW_MAX, dtype=np.uint32)
        state[0], state[2], state[3] = first_draw, len(recent), len(recent) % window if window else 0
        state[self.RING_AT : self.RING_AT + len(recent)] = recent
        self.device.upload(self.params, 0, params)
        self.device.upload(self.state, 0, state)
        self.penalty_active = window > 0
        return len(recent)

    def record(self, recorder: gpu.Recorder, n_tokens: int = 1) -> None:
        if self.penalty_active:
            recorder.dispatch(*self.penalty)
        for pipeline, bind, groups in self.dispatches:
            recorder.dispatch(pipeline, bind, groups)

    def record_candidate_draw(self, recorder: gpu.Recorder) -> None:
        if self.candidate_draw is None:
            raise RuntimeError("draw_from_candidates() must build the candidate draw first")
        recorder.dispatch(*self.candidate_draw)

    def release(self, device: gpu.Device) -> None:
        for buffer in self.buffers:
            device.release(buffer)
        self.buffers.clear()
