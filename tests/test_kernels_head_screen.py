"""The screened greedy head (kernels/head_screen.py) against the F16 head + Argmax it replaces.

What must hold: the token is exactly the argmax of the F16 head's own logits (the rows it rescores
are computed by that head's arithmetic, so even exact ties resolve to the smaller index); the int8
copy made on the GPU is numpy's quantization, the final norm's two int8 digits are its output to
within half a step of the second digit, and the screen's bounds hold the real logit of every row;
rows past the vocabulary never win; several shards and several steps in one submit (the keys are
cleared between steps) give the same answers.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import open_device_or_skip, upload

from bitnet_web.kernels.common import KernelCache, StepParams
from bitnet_web.kernels.embedding import Argmax, EmbeddingShapeError, F16Matrix, Int8Matrix, LMHead
from bitnet_web.kernels.head_screen import (
    DIGIT_STATS,
    KEY_SLOTS,
    SAMPLED_KEY_SLOTS,
    SCREEN_ROWS,
    TAU_RANK,
    ScreenedArgmax,
    ScreenedSampling,
    ScreenedVerifyArgmax,
    ScreenedVerifyLogits,
    float_slack,
)
from bitnet_web.kernels.norm import RMSNorm
from bitnet_web.kernels.sampling import SORT_WIDTH, GPUSampler
from bitnet_web.text.sampler import SamplerSettings

pytestmark = pytest.mark.gpu


class Heads:
    """An F16 head with both greedy choosers over the same normed row and logits: a row x_in goes
    through the final norm (`weight` times x_in / rms(x_in), and the screen's digits), then both."""

    def __init__(self, device, table: np.ndarray, vocab: int | None = None, weight: np.ndarray | None = None):
        self.device, v, d = device, table.shape[0], table.shape[1]
        self.vocab = vocab or v
        kernels = KernelCache(device)
        self.matrix = F16Matrix.upload(device, table, "head")
        step = StepParams(device)
        step.write(1, 0, 0)
        self.x_in = upload(device, np.zeros((1, d), np.float32), "x in")
        self.x = device.buffer(4 * d, label="x")
        self.digits = device.buffer(2 * d, label="digits")
        self.stats = device.buffer(4 * DIGIT_STATS, label="digit stats")
        self.weight = np.ones(d, np.float32) if weight is None else weight.astype(np.float32)
        norm_weight = upload(device, self.weight, "norm weight")
        self.norm = RMSNorm(kernels, self.x_in, norm_weight, self.x, step, d, 1e-6, digits=(self.digits, self.stats))
        self.logits = device.buffer(4 * v, label="logits")
        self.ids = device.buffer(16, label="ids")
        self.head = LMHead(kernels, self.matrix, self.x, self.logits, step)
        self.argmax = Argmax(kernels, self.logits, self.ids, self.vocab)
        self.screened = ScreenedArgmax(
            kernels, self.head, self.matrix, self.x, self.digits, self.stats, self.ids, self.vocab, slot=1
        )
        rec = device.begin()
        self.screened.prepare(rec)
        rec.submit()

    def choose(self, x: np.ndarray) -> tuple[int, int, np.ndarray]:
        """(F16 head + Argmax's token, the screened token, the F16 logits) for one row x_in."""
        self.device.upload(self.x_in, 0, np.ascontiguousarray(x, dtype=np.float32))
        rec = self.device.begin()
        self.norm.record(rec, 1, last_only=True, digits=True)
        self.screened.record(rec)
        self.head.record(rec, 1)
        self.argmax.record(rec)
        rec.submit()
        ids = self.device.read_sync(self.ids, 0, 8).view(np.uint32)
        logits = self.device.read_sync(self.logits, 0, self.logits.nbytes).view(np.float32)
        return int(ids[0]), int(ids[1]), logits

    def read(self, buffer, dtype) -> np.ndarray:
        return self.device.read_sync(buffer, 0, buffer.nbytes).view(dtype)


def test_the_screened_token_is_the_f16_heads_argmax(device):
    rng = np.random.default_rng(1)
    v, d = 3000, 256
    table = (rng.standard_normal((v, d)) * rng.uniform(0.02, 0.2, (v, 1))).astype(np.float16)
    table[17] = table[2900]  # an exact tie: the smaller index must win, as Argmax says
    table[5] = 0  # a zero row (scale 0)
    heads = Heads(device, table, weight=rng.uniform(0.05, 3.0, d))
    for trial in range(12):
        x = rng.standard_normal(d).astype(np.float32) * (0.1 if trial % 3 else 3.0)
        if trial % 4 == 1:  # outliers: the first digit's step is coarse, the second carries the rest
            x[rng.integers(0, d, 3)] *= 60
        if trial == 4:  # the tied rows on top
            x = table[17].astype(np.float32) * 5 / heads.weight
        exact_token, screened_token, logits = heads.choose(x)
        assert exact_token == int(np.argmax(logits[:v]))
        assert screened_token == exact_token, trial
        if trial == 4:
            assert screened_token == 17


def test_the_screen_without_subgroups(device):
    """An adapter without subgroups: the screen, the rescoring and the F16 head all take their
    workgroup-memory reductions, and the tokens still agree (the rescored rows are the head's bits)."""
    rng = np.random.default_rng(7)
    v, d = 1500, 512
    table = (rng.standard_normal((v, d)) * 0.05).astype(np.float16)
    table[3] = table[1400]
    features = device.features
    device.features = features - {"subgroups"}
    try:
        heads = Heads(device, table)
    finally:
        device.features = features
    assert all("SUBGROUPS" not in pipeline.label for pipeline, _, _ in heads.screened.screen_ops)
    for trial in range(6):
        x = table[3].astype(np.float32) * 3 if trial == 0 else rng.standard_normal(d).astype(np.float32)
        exact_token, screened_token, logits = heads.choose(x)
        assert screened_token == exact_token == int(np.argmax(logits)), trial
        if trial == 0:
            assert screened_token == 3


def test_near_ties_and_a_flat_row_resolve_as_the_f16_head(device):
    """Rows a hair apart (below the int8 rounding) and an x that makes every logit equal: the screen
    keeps them all and the F16 arithmetic decides."""
    rng = np.random.default_rng(2)
    v, d = 700, 128
    base = rng.standard_normal(d).astype(np.float16)
    table = np.repeat(base[None], v, axis=0)
    for i in range(v):  # one ulp up or down in one column per row
        col = i % d
        table[i, col] = np.nextafter(table[i, col], np.float16(np.inf if i % 2 else -np.inf))
    heads = Heads(device, table)
    for x in (base.astype(np.float32), rng.standard_normal(d).astype(np.float32), np.zeros(d, np.float32)):
        exact_token, screened_token, logits = heads.choose(x)
        assert screened_token == exact_token == int(np.argmax(logits))


def test_rows_past_the_vocabulary_never_win(device):
    rng = np.random.default_rng(3)
    table = rng.standard_normal((600, 128)).astype(np.float16)
    table[550] = 4.0  # the largest logit for x = 1, but past the 500-token vocabulary
    heads = Heads(device, table, vocab=500)
    exact_token, screened_token, logits = heads.choose(np.ones(128, np.float32))
    assert screened_token == exact_token == int(np.argmax(logits[:500]))


def test_the_int8_copy_is_numpys_and_the_bounds_hold_the_f16_logits(device):
    rng = np.random.default_rng(4)
    v, d = 400, 512
    table = (rng.standard_normal((v, d)) * rng.uniform(0.01, 3, (v, 1))).astype(np.float16)
    table[7] = 0
    heads = Heads(device, table, weight=rng.uniform(0.1, 2.0, d))
    values, scales = Int8Matrix.quantize(table)
    shard = heads.screened.buffers[-1]  # the one int8 shard
    got = device.read_sync(shard, 0, v * d).view(np.int8).reshape(v, d)
    got_scales = heads.read(heads.screened.scales, np.float32)
    norms = heads.read(heads.screened.norms, np.float32).reshape(v, 2)
    np.testing.assert_allclose(got_scales, scales, rtol=1e-6)
    # round(w / s) on the GPU and in numpy may differ only where w / s sits on a .5 tie
    assert np.abs(got.astype(int) - values.astype(int)).max() <= 1
    assert (got == values).mean() > 0.999
    w = table.astype(np.float64)
    approx_w = got.astype(np.float64) * got_scales[:, None]
    np.testing.assert_allclose(norms[:, 0], np.linalg.norm(w - approx_w, axis=1), rtol=1e-4, atol=1e-30)
    np.testing.assert_allclose(norms[:, 1], np.linalg.norm(w, axis=1), rtol=1e-4)
    assert (norms[7] == 0).all() and got_scales[7] == 0
    for trial in range(6):
        x = rng.standard_normal(d).astype(np.float32) * 10.0 ** rng.uniform(-3, 3)
        if trial % 2:
            x[rng.integers(0, d, 4)] *= 100  # a few outliers, as real hidden states have
        _, _, logits = heads.choose(x)
        y = heads.read(heads.x, np.float32).astype(np.float64)
        q1, q2 = heads.read(heads.digits, np.int8).reshape(2, d).astype(np.float64)
        s1, s2, big, rest = heads.read(heads.stats, np.float32).astype(np.float64)
        # the digits: y to within half a second-digit step, both in -127..127, and their stated norms
        assert abs(s2 - np.float32(s1) / np.float32(254)) <= np.spacing(
            np.float32(s2)
        )  # a GPU may divide by multiplying
        assert np.abs(y - (s1 * q1 + s2 * q2)).max() <= s2 * 0.5001
        np.testing.assert_allclose(big, np.linalg.norm(s1 * q1 + s2 * q2), rtol=1e-5)
        np.testing.assert_allclose(rest, np.linalg.norm(y - s1 * q1 - s2 * q2), rtol=1e-4, atol=1e-30)
        # every row's F16 logit within [lower, upper], the bound being the Cauchy-Schwarz one with its
        # rounding slack (lm_head_screen.wgsl): w . y - z = e_w . y~ + w . (y - y~)
        z = got_scales * (s1 * (got @ q1) + s2 * (got @ q2))
        upper = heads.read(heads.screened.upper, np.float32).astype(np.float64)
        e = upper - z
        assert (logits <= upper).all() and (logits >= z - e * 0.9999).all(), trial
        bound = 1.01 * (norms[:, 0] * big + norms[:, 1] * (rest + float_slack(d) * (big + rest)))
        np.testing.assert_allclose(e, bound, rtol=1e-4, atol=1e-6 * np.abs(z).max())


def test_the_digits_norm_writes_the_plain_norms_output(device):
    """The final norm with digits writes the same y, bit for bit, as the one without (the F16 head and
    the rescored rows read it)."""
    rng = np.random.default_rng(6)
    d = 640
    kernels = KernelCache(device)
    step = StepParams(device)
    step.write(3, 0, 0)
    x_in = upload(device, rng.standard_normal((3, d)).astype(np.float32) * 4, "x in")
    weight = upload(device, rng.uniform(0.5, 2, d).astype(np.float32), "weight")
    ys = [device.buffer(4 * d, label=f"y{i}") for i in range(2)]
    digits, stats = device.buffer(2 * d), device.buffer(4 * DIGIT_STATS)
    plain = RMSNorm(kernels, x_in, weight, ys[0], step, d, 1e-5)
    with_digits = RMSNorm(kernels, x_in, weight, ys[1], step, d, 1e-5, digits=(digits, stats))
    rec = device.begin()
    plain.record(rec, 3, last_only=True)
    with_digits.record(rec, 3, last_only=True, digits=True)
    rec.submit()
    a, b = (device.read_sync(y, 0, 4 * d).view(np.uint32) for y in ys)
    assert (a == b).all() and a.any()
    with pytest.raises(ValueError, match="digits"):
        plain.record(device.begin(), 1, last_only=True, digits=True)


def test_over_several_shards_and_steps_in_one_submit():
    device = open_device_or_skip(max_binding_size=64 * 1024)  # 128 columns -> 256 F16 rows per shard
    try:
        rng = np.random.default_rng(5)
        v, d = 1100, 128
        table = rng.standard_normal((v, d)).astype(np.float16)
        heads = Heads(device, table)
        assert len(heads.matrix.shards) == 5
        xs = rng.standard_normal((4, d)).astype(np.float32)
        # four steps in one submit, each writing its own x first: the keys must be clear for each
        picks = device.buffer(16, label="picks")
        rec = device.begin()
        for i in range(4):
            rec.copy(upload(device, xs[i : i + 1], f"x{i}"), 0, heads.x_in, 0, 4 * d)
            heads.norm.record(rec, 1, last_only=True, digits=True)
            heads.screened.record(rec)
            rec.copy(heads.ids, 4, picks, 4 * i, 4)
        rec.submit()
        got = device.read_sync(picks, 0, 16).view(np.uint32)
        expected = [int(np.argmax(table.astype(np.float64) @ x.astype(np.float64))) for x in xs]
        assert list(got) == expected
        keys = device.read_sync(heads.screened.keys, 0, 4 * KEY_SLOTS).view(np.uint32)
        assert not keys.any()  # cleared for the next step
    finally:
        device.destroy()


def test_a_step_before_the_int8_copy_is_made_is_refused(device):
    table = np.random.default_rng(8).standard_normal((100, 64)).astype(np.float16)
    kernels = KernelCache(device)
    matrix = F16Matrix.upload(device, table, "head")
    x, ids = device.buffer(4 * 64), device.buffer(16)
    head = LMHead(kernels, matrix, x, device.buffer(4 * 100), StepParams(device))
    screened = ScreenedArgmax(kernels, head, matrix, x, device.buffer(128), device.buffer(16), ids, 100)
    with pytest.raises(RuntimeError, match="prepare"):
        screened.record(device.begin())


def test_columns_not_a_multiple_of_16_are_refused(device):
    kernels = KernelCache(device)
    matrix = F16Matrix.upload(device, np.zeros((4, 24), np.float16), "head")
    x, out = device.buffer(4 * 24), device.buffer(16)
    head = LMHead(kernels, matrix, x, device.buffer(16), StepParams(device))
    with pytest.raises(EmbeddingShapeError, match="multiple of 16"):
        ScreenedArgmax(kernels, head, matrix, x, device.buffer(48), device.buffer(16), out, 4)


def order_key(values: np.ndarray) -> np.ndarray:
    """lm_head_screen.wgsl's order key: a u32 that orders as the float does."""
    bits = values.astype(np.float32).view(np.uint32)
    return np.where(bits >= 0x80000000, ~bits, bits ^ 0x80000000).astype(np.uint32)


def from_order_key(keys: np.ndarray) -> np.ndarray:
    keys = np.asarray(keys, np.uint32)
    return np.where(keys >= 0x80000000, keys ^ 0x80000000, ~keys).astype(np.uint32).view(np.float32)


def read_candidates(heads) -> tuple[np.ndarray, np.ndarray]:
    """The screen's candidate list: (rows, logits) in list order."""
    words = heads.read(heads.screened.candidates, np.uint32)
    pairs = words[2 : 2 + 2 * int(words[0])].reshape(-1, 2)
    return pairs[:, 1].astype(np.int64), pairs[:, 0].copy().view(np.float32)


def test_the_candidates_are_the_rows_the_tau_rank_th_key_keeps(device):
    """record_candidates: the list holds the F16 logit (bit for bit) of exactly the rows whose upper
    bound reaches the TAU_RANK-th largest key (its low 16 bits cleared), each once; that includes every
    row of the top TAU_RANK logits, and far fewer rows than the vocabulary."""
    rng = np.random.default_rng(10)
    v, d = 6000, 256
    table = (rng.standard_normal((v, d)) * rng.uniform(0.02, 0.2, (v, 1))).astype(np.float16)
    heads = Heads(device, table)
    kept_counts = []
    for trial in range(5):
        x = rng.standard_normal(d).astype(np.float32)
        exact = heads.choose(x)[2].copy()
        rec = device.begin()
        heads.screened.record_candidates(rec)  # the norm's digits are the choose() step's
        rec.submit()
        rows, logits = read_candidates(heads)
        assert len(set(rows.tolist())) == len(rows), trial
        assert (logits.view(np.uint32) == exact[rows].view(np.uint32)).all()
        words = heads.read(heads.screened.keys, np.uint32)  # still set: the sampler's draw clears them
        keys, tau_key = words[:SAMPLED_KEY_SLOTS], words[SAMPLED_KEY_SLOTS]
        assert np.count_nonzero(keys) == min(SAMPLED_KEY_SLOTS, -(-v // SCREEN_ROWS))  # a key per screen workgroup
        assert tau_key == np.sort(keys)[-TAU_RANK] & 0xFFFF0000
        tau = from_order_key(tau_key)
        upper = heads.read(heads.screened.upper, np.float32)
        assert set(rows.tolist()) == set(np.flatnonzero(~(upper < tau)).tolist()), trial
        order = np.lexsort((np.arange(v), -exact))  # by value, ties by index: the sampler's order
        assert set(order[:TAU_RANK].tolist()) <= set(rows.tolist()), trial
        kept_counts.append(len(rows))
        device.upload(heads.screened.keys, 0, np.zeros(SAMPLED_KEY_SLOTS, np.uint32))  # as a draw would
        device.upload(heads.screened.candidates, 0, np.zeros(2, np.uint32))
    assert max(kept_counts) < v // 4, kept_counts


def test_fewer_set_keys_than_the_rank_keep_every_row(device):
    """A vocabulary of fewer than TAU_RANK screening workgroups leaves tau unbounded: every row is a
    candidate."""
    rng = np.random.default_rng(12)
    v, d = 8 * (TAU_RANK // 2), 128
    heads = Heads(device, rng.standard_normal((v, d)).astype(np.float16))
    exact = heads.choose(rng.standard_normal(d).astype(np.float32))[2]
    rec = device.begin()
    heads.screened.record_candidates(rec)
    rec.submit()
    rows, logits = read_candidates(heads)
    assert sorted(rows.tolist()) == list(range(v))
    assert (logits.view(np.uint32) == exact[rows].view(np.uint32)).all()


def sampled_tokens_agree(device, table: np.ndarray, seed: int, steps: int = 12) -> list[int]:
    """GPUSampler over the F16 logits and ScreenedSampling (candidates, then one draw that clears the
    keys and the list) draw the same tokens from the same seeds, with and without a repetition
    penalty (on rows 0-19, which the callers make large, so the penalty moves them in and out of the
    top k); returns the screened steps' candidate counts."""
    rng = np.random.default_rng(seed)  # not the table's stream: x would repeat its rows
    v, d = table.shape
    heads = Heads(device, table)
    kernels = KernelCache(device)
    plain = GPUSampler(kernels, heads.logits, heads.ids, v, slot=2)
    screened_sampler = GPUSampler(kernels, heads.logits, heads.ids, v, slot=3)
    with pytest.raises(RuntimeError, match="candidates"):
        ScreenedSampling(heads.screened, screened_sampler)
    screened_sampler.draw_from_candidates(heads.screened.candidates, heads.screened.keys, SAMPLED_KEY_SLOTS)
    ScreenedSampling(heads.screened, screened_sampler)  # accepted now
    assert not ScreenedSampling.serves(SamplerSettings(repetition_penalty=0.9))
    counts, count = [], device.buffer(16, label="count")
    for settings in (
        SamplerSettings(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.3, repeat_last_n=16),
        SamplerSettings(temperature=1.5, top_k=64, top_p=1.0),
    ):
        assert ScreenedSampling.serves(settings)
        history = list(range(20))
        for sampler in (plain, screened_sampler):
            sampler.configure(settings, seed=77, first_draw=0, history=history)
        drawn = []
        for _ in range(steps):
            x = rng.standard_normal(d).astype(np.float32)
            device.upload(heads.x_in, 0, x)
            rec = device.begin()
            heads.norm.record(rec, 1, last_only=True, digits=True)
            heads.head.record(rec, 1)
            plain.record(rec)
            heads.screened.record_candidates(rec)  # ScreenedSampling.record, with the count kept between
            rec.copy(heads.screened.candidates, 0, count, 0, 4)
            screened_sampler.record_candidate_draw(rec)
            rec.submit()
            counts.append(int(heads.read(count, np.uint32)[0]))
            ids = heads.read(heads.ids, np.uint32)
            drawn.append((int(ids[2]), int(ids[3])))
            assert not heads.read(heads.screened.keys, np.uint32)[:SAMPLED_KEY_SLOTS].any()
            assert heads.read(heads.screened.candidates, np.uint32)[0] == 0
        assert all(a == b for a, b in drawn), drawn
        assert len({a for a, _ in drawn}) > 3  # real draws, not one token
    return counts


def test_sampled_steps_through_the_screen_draw_the_f16_heads_tokens(device):
    table = np.random.default_rng(11).standard_normal((3000, 128)) * 0.3
    table[:20] *= 2
    counts = sampled_tokens_agree(device, table.astype(np.float16), seed=111)
    assert max(counts) <= 1024 - 64  # one sorting chunk


def test_candidates_many_times_one_sort_are_drawn_from_alike(device):
    """Rows so alike that the screen keeps nearly all of them, several times what one sort holds: the
    draw's radix select still picks the best K, and draws the F16 head's tokens."""
    rng = np.random.default_rng(13)
    base = rng.standard_normal((1, 128))
    table = base + 0.01 * rng.standard_normal((5000, 128))
    table[:20] *= 1.02
    counts = sampled_tokens_agree(device, table.astype(np.float16), seed=113, steps=6)
    assert min(counts) > 4 * SORT_WIDTH, counts


@pytest.mark.parametrize("tied", [300, 1200])
def test_tied_candidates_past_the_rank_sort_are_drawn_alike(device, tied):
    """`tied` equal rows at the top (the K-th largest logit tied that often): more than the rank sort
    places (300: one bitonic sort), more than one sort holds (1,200: the best K over chunks of the
    list); ties go to the smaller row, the penalized rows among them, and the draws are still the F16
    head's."""
    rng = np.random.default_rng(14)
    table = 0.3 * rng.standard_normal((3000, 128))
    u = 3 * rng.standard_normal(128)
    table[:tied], table[tied : 2 * tied] = u, -u  # one group or the other holds the top logits
    counts = sampled_tokens_agree(device, table.astype(np.float16), seed=114, steps=6)
    assert min(counts) >= tied, counts


def test_sampled_steps_over_several_shards_draw_the_f16_heads_tokens():
    """A head in five row shards: every shard's rescore lists its rows (ids past its start) in the
    one candidate list, and the draws are the F16 head's."""
    device = open_device_or_skip(max_binding_size=64 * 1024)  # 128 columns -> 256 F16 rows per shard
    try:
        table = np.random.default_rng(15).standard_normal((1100, 128)) * 0.3
        table[:20] *= 2
        counts = sampled_tokens_agree(device, table.astype(np.float16), seed=115, steps=6)
        assert min(counts) >= TAU_RANK, counts
    finally:
        device.destroy()


def test_a_vocabulary_smaller_than_the_top_k_is_drawn_alike(device):
    """20 rows, top-k 40 and 64: fewer candidates than the draw keeps, and no place past them counts."""
    table = np.random.default_rng(16).standard_normal((20, 128)) * 0.3
    counts = sampled_tokens_agree(device, table.astype(np.float16), seed=116, steps=6)
    assert max(counts) == 20, counts


class VerifyRows:
    """A verify step's `rows` token rows through the final norm (with every row's digits), then both the
    F16 head over all rows and ScreenedVerifyArgmax; StepParams says how many rows are live."""

    def __init__(self, device, table: np.ndarray, rows: int, vocab: int | None = None):
        self.device, v, d = device, table.shape[0], table.shape[1]
        self.rows, self.vocab = rows, vocab or v
        kernels = KernelCache(device)
        self.matrix = F16Matrix.upload(device, table, "head")
        self.step = StepParams(device)
        self.x_in = device.buffer(4 * rows * d, label="x in")
        self.x = device.buffer(4 * rows * d, label="x")
        digits, stats = device.buffer(2 * rows * d, label="digits"), device.buffer(4 * DIGIT_STATS * rows)
        self.digits, self.stats = digits, stats
        norm_weight = upload(device, np.ones(d, np.float32), "norm weight")
        self.norm = RMSNorm(kernels, self.x_in, norm_weight, self.x, self.step, d, 1e-6, digits=(digits, stats))
        self.logits = device.buffer(4 * rows * v, label="logits")
        self.head = LMHead(kernels, self.matrix, self.x, self.logits, self.step)
        self.ids = device.buffer(4 * rows, label="ids")
        screen = ScreenedArgmax(kernels, self.head, self.matrix, self.x, digits, stats, device.buffer(16), self.vocab)
        rec = device.begin()
        screen.prepare(rec)
        rec.submit()
        self.screen = screen
        self.verify = ScreenedVerifyArgmax(screen, digits, stats, self.step, self.ids, rows)

    def record(self, rec, xs: np.ndarray) -> None:
        """One verify step over xs (live rows first; fewer than `rows` leave the rest unread)."""
        n, d = xs.shape
        padded = np.zeros((self.rows, d), np.float32)
        padded[:n] = xs
        rec.copy(upload(self.device, padded, "x rows"), 0, self.x_in, 0, padded.nbytes)
        self.norm.record(rec, self.rows, digits=True)
        self.verify.record(rec)
        self.head.record(rec, self.rows, bounded=True)

    def choose(self, xs: np.ndarray) -> tuple[list[int], np.ndarray]:
        """(the screened tokens of every row, the F16 head's logits of the live rows)."""
        self.step.write(len(xs), 0, 0)
        rec = self.device.begin()
        self.record(rec, xs)
        rec.submit()
        ids = self.device.read_sync(self.ids, 0, 4 * self.rows).view(np.uint32)
        logits = self.device.read_sync(self.logits, 0, self.logits.nbytes).view(np.float32)
        return [int(i) for i in ids], logits.reshape(self.rows, -1)[: len(xs)]


def test_verify_rows_through_the_screen_are_the_f16_heads_argmaxes(device):
    """Each live row's token is the argmax of the F16 head's logits of that row (the same bits the
    verify step's head computes: exact ties to the smaller index), rows past the step's count get 0,
    and every row's keys are clear afterwards (the next step's bounds start from nothing)."""
    rng = np.random.default_rng(11)
    v, d, rows = 2500, 256, 5
    table = (rng.standard_normal((v, d)) * rng.uniform(0.02, 0.2, (v, 1))).astype(np.float16)
    table[40] = table[2100]  # an exact tie
    table[9] = 0
    table[2450] = 4.0  # the largest logit for many rows, but past the 2400-token vocabulary
    verify = VerifyRows(device, table, rows, vocab=2400)
    for n in (5, 3, 1, 5):
        xs = rng.standard_normal((n, d)).astype(np.float32) * rng.uniform(0.1, 3.0, (n, 1))
        xs[0, rng.integers(0, d, 3)] *= 60  # outliers: the second digit carries the rest
        if n == 3:
            xs[1] = table[2100].astype(np.float32) * 5  # the tied rows on top
        tokens, logits = verify.choose(xs)
        assert tokens[:n] == [int(np.argmax(row[:2400])) for row in logits], n
        assert tokens[n:] == [0] * (rows - n)
        if n == 3:
            assert tokens[1] == 40
        keys = device.read_sync(verify.verify.keys, 0, verify.verify.keys.nbytes).view(np.uint32)
        assert not keys.any()


def test_verify_rows_over_several_shards_and_steps_in_one_submit():
    device = open_device_or_skip(max_binding_size=64 * 1024)  # 128 columns -> 256 F16 rows per shard
    try:
        rng = np.random.default_rng(12)
        v, d, rows = 1100, 128, 4
        table = rng.standard_normal((v, d)).astype(np.float16)
        verify = VerifyRows(device, table, rows)
        assert len(verify.matrix.shards) == 5 and len(verify.verify.screen_ops) == 5
        verify.step.write(rows, 0, 0)
        out = device.buffer(4 * rows * v, label="screened logits")  # the sampled form, over the same shards
        sampled = ScreenedVerifyLogits(verify.screen, out, verify.digits, verify.stats, verify.step, rows)
        steps = [rng.standard_normal((rows, d)).astype(np.float32) for _ in range(3)]
        picks = device.buffer(4 * rows * len(steps), label="picks")
        rec = device.begin()
        for i, xs in enumerate(steps):
            verify.record(rec, xs)
            sampled.record(rec)
            rec.copy(verify.ids, 0, picks, 4 * rows * i, 4 * rows)
        rec.submit()
        got = device.read_sync(picks, 0, picks.nbytes).view(np.uint32).reshape(len(steps), rows)
        wide = table.astype(np.float64)
        for i, xs in enumerate(steps):
            normed = xs / np.sqrt(np.mean(xs.astype(np.float64) ** 2, axis=1, keepdims=True) + 1e-6)
            assert list(got[i]) == [int(np.argmax(wide @ x)) for x in normed], i
        # the last step's sampled rows: the F16 head's logits wherever the top TAU_RANK reach, -inf elsewhere
        f16 = device.read_sync(verify.logits, 0, verify.logits.nbytes).view(np.float32).reshape(rows, v)
        screened = device.read_sync(out, 0, out.nbytes).view(np.float32).reshape(rows, v)
        for t in range(rows):
            kept = np.isfinite(screened[t])
            assert (screened[t][kept].view(np.uint32) == f16[t][kept].view(np.uint32)).all()
            assert (screened[t][~kept] == -np.inf).all() and kept[np.argsort(-f16[t])[:TAU_RANK]].all()
    finally:
        device.destroy()


def test_verify_rows_need_digit_buffers_for_every_row(device):
    table = np.random.default_rng(13).standard_normal((100, 64)).astype(np.float16)
    kernels = KernelCache(device)
    matrix = F16Matrix.upload(device, table, "head")
    x, step = device.buffer(4 * 64 * 3), StepParams(device)
    head = LMHead(kernels, matrix, x, device.buffer(4 * 100 * 3), step)
    digits, stats = device.buffer(128), device.buffer(16)  # one row's
    screen = ScreenedArgmax(kernels, head, matrix, x, digits, stats, device.buffer(16), 100)
    with pytest.raises(EmbeddingShapeError, match="3 rows"):
        ScreenedVerifyArgmax(screen, digits, stats, step, device.buffer(12), 3)


def test_sampled_verify_rows_get_the_f16_logits_wherever_the_top_k_can_reach(device):
    """ScreenedVerifyLogits: in each live row every row among the top TAU_RANK F16 logits is kept with its
    logit bit for bit (so a top-k <= 64 sampler after a penalty >= 1 sees the F16 row), the rest are
    -inf; rows past the step's count are left as they were; every row's keys are clear afterwards."""
    rng = np.random.default_rng(14)
    v, d, rows = 3000, 256, 4
    table = (rng.standard_normal((v, d)) * rng.uniform(0.02, 0.2, (v, 1))).astype(np.float16)
    verify = VerifyRows(device, table, rows)
    out = device.buffer(4 * rows * v, label="screened logits")
    logits_op = ScreenedVerifyLogits(verify.screen, out, verify.digits, verify.stats, verify.step, rows)
    for n in (4, 2):
        xs = rng.standard_normal((n, d)).astype(np.float32) * rng.uniform(0.1, 3.0, (n, 1))
        device.upload(out, 0, np.full(rows * v, 7.0, np.float32))  # rows past n keep this
        verify.step.write(n, 0, 0)
        rec = device.begin()
        verify.record(rec, xs)
        logits_op.record(rec)
        rec.submit()
        f16 = device.read_sync(verify.logits, 0, verify.logits.nbytes).view(np.float32).reshape(rows, v)
        got = device.read_sync(out, 0, out.nbytes).view(np.float32).reshape(rows, v)
        for t in range(n):
            kept = np.isfinite(got[t])
            assert (got[t][kept].view(np.uint32) == f16[t][kept].view(np.uint32)).all(), t
            assert (got[t][~kept] == -np.inf).all()
            top = np.argsort(-f16[t], kind="stable")[:TAU_RANK]
            assert kept[top].all(), t
            assert kept.sum() < v  # the screen left most rows out
        assert (got[n:] == 7.0).all()
        keys = device.read_sync(logits_op.keys, 0, logits_op.keys.nbytes).view(np.uint32).reshape(rows, -1)
        assert not keys[:, :SAMPLED_KEY_SLOTS].any()
