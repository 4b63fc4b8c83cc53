"""The optional int8 LM head (Int8Matrix + lm_head.wgsl INT8) against numpy.

The int8 copy is an approximation of the F16 head by design; what must be exact is the kernel
given the int8 values and scales (f32 accumulation tolerance), the quantizer (each element within
half a step of its row), and sharding (every shard's rows land in their own logit columns).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import open_device_or_skip, upload

from bitnet_web.kernels.common import KernelCache, StepParams  # noqa: E402
from bitnet_web.kernels.embedding import EmbeddingShapeError, Int8Matrix, LMHead  # noqa: E402

pytestmark = pytest.mark.gpu


def head_logits(device, matrix, x: np.ndarray) -> np.ndarray:
    n_tokens, v = x.shape[0], matrix.n_rows
    step = StepParams(device)
    step.write(n_tokens, 0, 0)
    logits_buf = device.buffer(4 * v * n_tokens, label="logits")
    op = LMHead(KernelCache(device), matrix, upload(device, x, "x"), logits_buf, step)
    recorder = device.begin()
    op.record(recorder, n_tokens)
    recorder.submit()
    return device.read_sync(logits_buf, 0, 4 * v * n_tokens).view(np.float32).reshape(n_tokens, v)


def test_quantizer_is_within_half_a_step_per_row():
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((50, 64)) * rng.uniform(0.01, 5, (50, 1))).astype(np.float16)
    table[3] = 0  # an all-zero row keeps scale 0 and values 0 (no division by zero)
    values, scales = Int8Matrix.quantize(table)
    assert values.dtype == np.int8 and scales.dtype == np.float32
    err = np.abs(values.astype(np.float64) * scales[:, None] - table.astype(np.float64))
    assert (err <= scales[:, None] * 0.5 * (1 + 1e-5) + 1e-12).all()
    assert np.abs(values).max(axis=1)[np.arange(50) != 3].min() == 127  # each row uses its full range
    assert scales[3] == 0 and not values[3].any()


@pytest.mark.parametrize("v,d,n_tokens", [(333, 2560, 1), (1000, 128, 1), (300, 256, 3), (300, 256, 9), (200, 128, 11)])
def test_int8_head_matches_numpy(device, v, d, n_tokens):
    rng = np.random.default_rng(v + d)
    table = (rng.standard_normal((v, d)) * 0.5).astype(np.float16)
    matrix = Int8Matrix.upload(device, table, "head")
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    values, scales = Int8Matrix.quantize(table)
    expected = x.astype(np.float64) @ (values.astype(np.float64) * scales[:, None]).T
    got = head_logits(device, matrix, x)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # and it is the F16 head up to the int8 rounding: same top token on these random rows
    exact = x.astype(np.float64) @ table.astype(np.float64).T
    assert np.abs(got - exact).max() < 0.02 * np.abs(exact).max()


def test_int8_head_over_several_shards():
    device = open_device_or_skip(max_binding_size=64 * 1024)  # 128 columns -> 512 rows per shard
    try:
        rng = np.random.default_rng(9)
        v, d = 1800, 128
        table = rng.standard_normal((v, d)).astype(np.float16)
        matrix = Int8Matrix.upload(device, table, "head")
        assert len(matrix.shards) == 4
        x = rng.standard_normal((1, d)).astype(np.float32)
        values, scales = Int8Matrix.quantize(table)
        expected = x.astype(np.float64) @ (values.astype(np.float64) * scales[:, None]).T
        np.testing.assert_allclose(
            head_logits(device, matrix, x), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
        )
    finally:
        device.destroy()


def test_columns_not_a_multiple_of_16_are_refused(device):
    with pytest.raises(EmbeddingShapeError, match="multiple of 16"):
        Int8Matrix.upload(device, np.zeros((4, 24), np.float16), "head")


@pytest.mark.slow
def test_engine_with_int8_head_stays_close_to_the_f16_head():
    """On the bundled (trained) model: logits within 2% of their range of the F16 head's, the same
    next token wherever the F16 head's top-2 gap is clear, and fewer bytes read per token."""
    from pathlib import Path

    from bitnet_web.engine import Engine

    model = Path(__file__).resolve().parents[1] / "static" / "models" / "bitnet-pystdlib-27m-i2_s.gguf"
    ids = None
    results = {}
    for int8 in (False, True):
        engine = Engine(int8_head=int8)
        try:
            engine.load(model)
            ids = ids or engine.encode_prompt("def read_config(path):\n    with open(path) as f:\n")
            results[int8] = (engine.logits(ids), engine.model.weight_bytes_per_token)
        finally:
            engine.close()
    f16, int8 = results[False][0].astype(np.float64), results[True][0].astype(np.float64)
    spread = float(np.ptp(f16))
    assert np.abs(int8 - f16).max() < 0.02 * spread
    top2 = np.sort(f16, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.02 * spread
    assert clear.sum() >= len(ids) // 2
    assert (int8.argmax(1)[clear] == f16.argmax(1)[clear]).all()
    assert results[True][1] < results[False][1]
