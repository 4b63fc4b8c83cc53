"""The screened greedy head (kernels/head_screen.py) against the F16 head + Argmax it replaces.

What must hold: the token is exactly the argmax of the F16 head's own logits (the rows it rescores
are computed by that head's arithmetic, so even exact ties resolve to the smaller index); the int8
copy made on the GPU is numpy's quantization, and its error norms bound the real error of every
row; rows past the vocabulary never win; several shards and several steps in one submit (the keys
are cleared between steps) give the same answers.
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import open_device_or_skip, upload

from bitnet_web.kernels.common import KernelCache, StepParams
from bitnet_web.kernels.embedding import Argmax, EmbeddingShapeError, F16Matrix, Int8Matrix, LMHead
from bitnet_web.kernels.head_screen import KEY_SLOTS, ScreenedArgmax, float_slack

pytestmark = pytest.mark.gpu


class Heads:
    """An F16 head with both greedy choosers over the same x buffer and logits."""

    def __init__(self, device, table: np.ndarray, vocab: int | None = None):
        self.device, v, d = device, table.shape[0], table.shape[1]
        self.vocab = vocab or v
        kernels = KernelCache(device)
        self.matrix = F16Matrix.upload(device, table, "head")
        step = StepParams(device)
        step.write(1, 0, 0)
        self.x = upload(device, np.zeros((1, d), np.float32), "x")
        self.logits = device.buffer(4 * v, label="logits")
        self.ids = device.buffer(16, label="ids")
        self.head = LMHead(kernels, self.matrix, self.x, self.logits, step)
        self.argmax = Argmax(kernels, self.logits, self.ids, self.vocab)
        self.screened = ScreenedArgmax(kernels, self.head, self.matrix, self.x, self.ids, self.vocab, slot=1)
        rec = device.begin()
        self.screened.prepare(rec)
        rec.submit()

    def choose(self, x: np.ndarray) -> tuple[int, int, np.ndarray]:
        """(F16 head + Argmax's token, the screened token, the F16 logits) for one row x."""
        self.device.upload(self.x, 0, np.ascontiguousarray(x, dtype=np.float32))
        rec = self.device.begin()
        self.screened.record(rec)
        self.head.record(rec, 1)
        self.argmax.record(rec)
        rec.submit()
        ids = self.device.read_sync(self.ids, 0, 8).view(np.uint32)
        logits = self.device.read_sync(self.logits, 0, self.logits.nbytes).view(np.float32)
        return int(ids[0]), int(ids[1]), logits


def test_the_screened_token_is_the_f16_heads_argmax(device):
    rng = np.random.default_rng(1)
    v, d = 3000, 256
    table = (rng.standard_normal((v, d)) * rng.uniform(0.02, 0.2, (v, 1))).astype(np.float16)
    table[17] = table[2900]  # an exact tie: the smaller index must win, as Argmax says
    table[5] = 0  # a zero row (scale 0)
    heads = Heads(device, table)
    for trial in range(12):
        x = rng.standard_normal(d).astype(np.float32) * (0.1 if trial % 3 else 3.0)
        if trial == 4:  # the tied rows on top
            x = table[17].astype(np.float32) * 5
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


def test_the_int8_copy_is_numpys_and_its_error_norms_bound_the_error(device):
    rng = np.random.default_rng(4)
    v, d = 400, 512
    table = (rng.standard_normal((v, d)) * rng.uniform(0.01, 3, (v, 1))).astype(np.float16)
    table[7] = 0
    heads = Heads(device, table)
    values, scales = Int8Matrix.quantize(table)
    shard = heads.screened.buffers[-1]  # the one int8 shard
    got = device.read_sync(shard, 0, v * d).view(np.int8).reshape(v, d)
    got_scales = device.read_sync(heads.screened.scales, 0, 4 * v).view(np.float32)
    errs = device.read_sync(heads.screened.errs, 0, 4 * v).view(np.float32)
    np.testing.assert_allclose(got_scales, scales, rtol=1e-6)
    # round(w / s) on the GPU and in numpy may differ only where w / s sits on a .5 tie
    assert np.abs(got.astype(int) - values.astype(int)).max() <= 1
    assert (got == values).mean() > 0.999
    w = table.astype(np.float64)
    residual = np.linalg.norm(w - got.astype(np.float64) * got_scales[:, None], axis=1)
    bound = residual + float_slack(d) * np.linalg.norm(w, axis=1)
    assert (errs >= bound).all() and (errs <= bound * 1.02 + 1e-30).all()
    assert errs[7] == 0 and got_scales[7] == 0
    # the bound holds for the logits of any x: |F16 logit - int8 logit| <= errs * ||x||
    for _ in range(5):
        x = rng.standard_normal(d).astype(np.float32)
        _, _, logits = heads.choose(x)
        approx = (got.astype(np.float64) * got_scales[:, None]) @ x.astype(np.float64)
        assert (np.abs(logits - approx) <= errs * np.linalg.norm(x.astype(np.float64))).all()


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
            rec.copy(upload(device, xs[i : i + 1], f"x{i}"), 0, heads.x, 0, 4 * d)
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
    screened = ScreenedArgmax(kernels, head, matrix, x, ids, 100)
    with pytest.raises(RuntimeError, match="prepare"):
        screened.record(device.begin())


def test_columns_not_a_multiple_of_16_are_refused(device):
    kernels = KernelCache(device)
    matrix = F16Matrix.upload(device, np.zeros((4, 24), np.float16), "head")
    x, out = device.buffer(4 * 24), device.buffer(16)
    head = LMHead(kernels, matrix, x, device.buffer(16), StepParams(device))
    with pytest.raises(EmbeddingShapeError, match="multiple of 16"):
        ScreenedArgmax(kernels, head, matrix, x, out, 4)
