"""The GPU sampler (shaders/sample_topk.wgsl) against the CPU sampler's `choose` with the same draw.

Both sides use the counter-based stream sampler.uniform(seed, n), so for every draw the GPU must pick
exactly the token `choose(logits, settings, uniform(seed, n))` picks, except where float rounding
can matter: a draw or a top-p / min-p cut within 1e-5 of a boundary (the reference is then computed
with the draw and the cuts nudged both ways, and any of those answers is accepted).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import upload

from bitnet_web import gpu
from bitnet_web.kernels.embedding import Argmax
from bitnet_web.kernels.sampling import GPUSampler
from bitnet_web.text.sampler import (
    GPU_PENALTY_WINDOW_MAX,
    GPU_TOP_K_MAX,
    Sampler,
    SamplerSettings,
    choose,
    uniform,
)

pytestmark = pytest.mark.gpu


def draw_on_gpu(device, sampler: GPUSampler, ids_buf: gpu.Buffer, slot: int = 0) -> int:
    recorder = device.begin()
    sampler.record(recorder)
    recorder.submit()
    return int(device.read_sync(ids_buf, 0, 16).view(np.uint32)[slot])


def acceptable(logits: np.ndarray, settings: SamplerSettings, u: float) -> set[int]:
    """Tokens the draw `u` may give, allowing for rounding at boundaries (see the module doc)."""
    clean = np.where(np.isnan(logits), -np.inf, logits).astype(np.float32)
    answers = {choose(clean, settings, u)}
    for du in (-1e-5, 1e-5):
        answers.add(choose(clean, settings, min(max(u + du, 0.0), 1 - 2**-24)))
    for dp in (-1e-5, 1e-5):
        nudged = dict(top_p=min(max(settings.top_p + dp, 1e-6), 1.0), min_p=min(max(settings.min_p + dp, 0.0), 1.0))
        answers.add(choose(clean, SamplerSettings(**{**settings.__dict__, **nudged}), u))
    return answers


SETTINGS = [
    SamplerSettings(temperature=0.8, top_k=40, top_p=0.95),  # llama.cpp's defaults
    SamplerSettings(temperature=1.0, top_k=64, top_p=1.0),
    SamplerSettings(temperature=1.5, top_k=7, top_p=0.5, min_p=0.05),
    SamplerSettings(temperature=0.3, top_k=1),
    SamplerSettings(temperature=2.0, top_k=64, top_p=0.9, min_p=0.2),
]


@pytest.mark.parametrize("vocab", [300, 5000, 70_000, 128_256])
@pytest.mark.slow
def test_gpu_draws_equal_the_cpu_choice(device, kernels, vocab):
    """Levels: 300 -> one span; 5000 -> 5 spans -> draw; 70000 and 128256 -> spans -> merge -> draw."""
    rng = np.random.default_rng(vocab)
    sampler_out = upload(device, np.full(4, 77, np.uint32), "ids")
    logits_buf = device.buffer(4 * vocab, label="logits")
    op = GPUSampler(kernels, logits_buf, sampler_out, vocab)
    assert len(op.dispatches) == {300: 2, 5000: 2, 70_000: 3, 128_256: 3}[vocab]  # spans, merges, draw
    seed = int(rng.integers(0, 2**63))
    checked = 0
    for case in range(12):
        settings = SETTINGS[case % len(SETTINGS)]
        logits = (rng.standard_normal(vocab) * rng.uniform(0.5, 4.0)).astype(np.float32)
        if case % 3 == 1:  # a peaked row, as a trained model gives
            logits[rng.integers(0, vocab, 5)] += 12.0
        if case % 4 == 2:  # ties at the top-k boundary and NaNs that must never be drawn
            logits[rng.integers(0, vocab, 30)] = np.sort(logits)[-settings.top_k]
            logits[rng.integers(0, vocab, 3)] = np.nan
        device.upload(logits_buf, 0, logits)
        op.configure(settings, seed, first_draw=case * 3)
        for draw in range(case * 3, case * 3 + 3):
            token = draw_on_gpu(device, op, sampler_out)
            assert token in acceptable(logits, settings, uniform(seed, draw)), (case, draw, settings)
            checked += 1
    counter = device.read_sync(op.state, 0, 8).view(np.uint32)
    assert counter[0] == 11 * 3 + 3 and counter[1] == 0  # the GPU counts its draws
    assert checked == 36
    op.release(device)


@pytest.mark.parametrize("seed", [0, 12345, 2**40 + 7, 2**64 - 1])
def test_gpu_stream_is_the_cpu_stream(device, kernels, seed):
    """64 equal logits and temperature 1: the draw picks floor(u * 64), so the GPU's hash is seen
    bit for bit in its top 6 bits, for seeds on both sides of 2^32."""
    vocab = 64
    ids = upload(device, np.zeros(4, np.uint32), "ids")
    op = GPUSampler(kernels, upload(device, np.zeros(vocab, np.float32), "logits"), ids, vocab)
    op.configure(SamplerSettings(temperature=1.0, top_k=64, top_p=1.0), seed, first_draw=1000)
    got = [draw_on_gpu(device, op, ids) for _ in range(40)]
    assert got == [int(uniform(seed, n) * 64) for n in range(1000, 1040)]
    assert len(set(got)) > 20  # a constant stream would also fail this


def test_gpu_sampler_writes_its_slot_and_row(device, kernels):
    vocab, row, slot = 3000, 2, 3
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((row + 1, vocab)).astype(np.float32)
    logits[row, 1234] = 40.0  # all the mass: any draw gives it
    logits[0, 99] = 80.0  # another row's winner must not be seen
    ids = upload(device, np.full(4, 77, np.uint32), "ids")
    op = GPUSampler(kernels, upload(device, logits, "logits"), ids, vocab, slot=slot, row=row)
    op.configure(SamplerSettings(temperature=1.0, top_k=10, top_p=0.9), 5, first_draw=0)
    assert draw_on_gpu(device, op, ids, slot) == 1234
    assert device.read_sync(ids, 0, 16).view(np.uint32).tolist() == [77, 77, 77, 1234]


def test_all_nan_logits_write_token_zero_and_flag_it(device, kernels):
    vocab = 2000
    ids = upload(device, np.full(4, 77, np.uint32), "ids")
    op = GPUSampler(kernels, upload(device, np.full(vocab, np.nan, np.float32), "logits"), ids, vocab)
    op.configure(SamplerSettings(temperature=1.0, top_k=40), 1, first_draw=0)
    assert draw_on_gpu(device, op, ids) == 0
    assert device.read_sync(op.state, 0, 8).view(np.uint32).tolist() == [1, 1]


@pytest.mark.parametrize("op", [GPUSampler, Argmax])
def test_a_row_or_slot_past_its_buffer_is_refused(device, kernels, op):
    logits = upload(device, np.zeros((2, 100), np.float32), "logits")
    ids = upload(device, np.zeros(4, np.uint32), "ids")
    with pytest.raises(ValueError, match="must hold row 2 of 100 f32"):
        op(kernels, logits, ids, 100, row=2)
    with pytest.raises(ValueError, match=r"out_ids \(16 bytes\) slot 4"):
        op(kernels, logits, ids, 100, slot=4)


def test_settings_the_gpu_cannot_take_are_refused(device, kernels):
    ids = upload(device, np.zeros(4, np.uint32), "ids")
    op = GPUSampler(kernels, upload(device, np.zeros(100, np.float32), "logits"), ids, 100)
    for bad in (
        SamplerSettings(top_k=0),
        SamplerSettings(top_k=GPU_TOP_K_MAX + 1),
        SamplerSettings(repetition_penalty=1.2, repeat_last_n=-1),
        SamplerSettings(repetition_penalty=1.2, repeat_last_n=GPU_PENALTY_WINDOW_MAX + 1),
    ):
        assert not Sampler(bad).gpu_supported()
        with pytest.raises(ValueError, match="GPU sampler"):
            op.configure(bad, 1, 0)


@pytest.mark.parametrize(
    "settings",
    [
        SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.5, repeat_last_n=16),
        SamplerSettings(temperature=0.0, repetition_penalty=3.0, repeat_last_n=64),  # greedy: top-k 1 on the GPU
        SamplerSettings(temperature=1.2, top_k=8, repetition_penalty=0.7, repeat_last_n=5),  # < 1 favours repeats
    ],
)
def test_repetition_penalty_follows_the_cpu_sampler(device, kernels, settings):
    """The penalty pass sees the tail of the history given at configure time, then every token the
    GPU drew (its ring): each draw must be what the CPU Sampler's penalty + choose give."""
    vocab = 3000
    rng = np.random.default_rng(int(settings.repeat_last_n))
    logits = (rng.standard_normal(vocab) - 8).astype(np.float32)
    # a few strong tokens, so the penalty changes which ones win; half of them negative (a penalty
    # multiplies those, divides positive ones)
    logits[:6] = 1.0 + 0.3 * rng.standard_normal(6)
    logits[6:12] = -0.3 + 0.3 * rng.standard_normal(6)
    history = rng.integers(0, 12, 40).tolist() + [7]
    ids = upload(device, np.zeros(4, np.uint32), "ids")
    logits_buf = device.buffer(4 * vocab, label="logits")
    op = GPUSampler(kernels, logits_buf, ids, vocab)
    assert Sampler(settings).gpu_supported()
    seed = 77
    op.configure(settings, seed, first_draw=0, history=history)
    cpu = Sampler(settings)
    changed = 0
    for draw in range(12):
        device.upload(logits_buf, 0, logits)  # the penalty pass works in place: fresh logits each step
        token = draw_on_gpu(device, op, ids)
        penalized = cpu._penalize(logits, history)
        changed += int(not np.array_equal(np.argsort(-penalized)[:12], np.argsort(-logits)[:12]))
        if settings.temperature == 0:
            assert token == int(np.argmax(penalized))
        else:
            assert token in acceptable(penalized, settings, uniform(seed, draw)), draw
        history.append(token)
    assert changed > 0  # the penalty reordered the strong tokens in this test
