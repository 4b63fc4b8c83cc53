"""K1 kernels (norms, ternary linear, embedding, LM head, argmax) against numpy references.

Run on whatever adapter wgpu finds (lavapipe in CI). Sizes stay small except one K=2560 case.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from gpu_helpers import upload
from kernel_reference import (  # noqa: E402
    pack_int8_words,
    ref_i2s_encode,
    ref_quantize_rows,
    ref_relu2,
    ref_rmsnorm,
    ref_silu,
    ref_ternary_linear,
    unpack_int8_words,
)

from bitnet_web import gpu  # noqa: E402
from bitnet_web.kernels.busy import GPUBusy  # noqa: E402
from bitnet_web.kernels.common import SMALL_T_MAX, KernelCache, StepParams, unroll_loops  # noqa: E402
from bitnet_web.kernels.embedding import (  # noqa: E402
    Argmax,
    EmbeddingLookup,
    EmbeddingShapeError,
    F16Matrix,
    LMHead,
)
from bitnet_web.kernels.head_screen import SAMPLED_KEY_SLOTS, ScreenedArgmax  # noqa: E402
from bitnet_web.kernels.linear import (  # noqa: E402
    NORM_GEMV_LARGE_ROWS,
    NORM_GEMV_ROWS,
    NORM_GEMV_SMALL_WEIGHTS,
    NormTernaryLinear,
    TernaryLinear,
    TernaryMatrix,
    TernaryShapeError,
    norm_gemv_group_threads,
    norm_gemv_row_groups,
    norm_gemv_rows,
    pack_ternary_rows,
)
from bitnet_web.kernels.norm import NormShapeError, RMSNorm, RMSNormQuant  # noqa: E402
from bitnet_web.kernels.sampling import GPUSampler  # noqa: E402
from bitnet_web.kernels.spec_sampling import SpecSampleAccept  # noqa: E402
from bitnet_web.kernels.speculative import GreedyAccept  # noqa: E402

pytestmark = pytest.mark.gpu
EPS = 1e-5


def read(device, buffer: gpu.Buffer, dtype, count: int) -> np.ndarray:
    return device.read_sync(buffer, 0, count * np.dtype(dtype).itemsize).view(dtype)


def run(device, *ops_and_args) -> None:
    recorder = device.begin()
    for op, args, kwargs in ops_and_args:
        op.record(recorder, *args, **kwargs)
    recorder.submit()


def step_params(device, n_tokens: int, pos: int = 0) -> StepParams:
    step = StepParams(device)
    step.write(n_tokens, pos, 0)
    return step


def random_activations(rng, t: int, width: int) -> np.ndarray:
    # Heavy-ish tails like real hidden states, never zeros.
    x = rng.standard_normal((t, width)).astype(np.float32)
    x[:, rng.integers(0, width, size=3)] *= 8.0
    return x


def assert_codes_match(q_gpu: np.ndarray, q_ref: np.ndarray, scaled_ref: np.ndarray) -> None:
    """Int8 codes equal the numpy formula exactly, except where y*s sits within float32 noise of a
    rounding tie (GPU and numpy sum in different orders); there they may differ by one step."""
    frac = np.abs(np.abs(scaled_ref) % 1.0 - 0.5)
    near_tie = frac < 1e-4 * np.maximum(1.0, np.abs(scaled_ref))
    diff = q_gpu.astype(np.int32) - q_ref.astype(np.int32)
    assert np.all(diff[~near_tie] == 0), f"{np.count_nonzero(diff[~near_tie])} codes differ away from ties"
    assert np.all(np.abs(diff[near_tie]) <= 1)
    assert near_tie.mean() < 0.01


# RMSNormQuant / RMSNorm ------------------------------------------------------------------------


@pytest.mark.parametrize("t,width", [(1, 128), (3, 640), (17, 384), (2, 2560), (2, 6912)])
def test_rmsnorm_quant_matches_numpy(device, kernels, t, width):
    rng = np.random.default_rng(width + t)
    max_tokens = t + 2  # buffers larger than the step: rows past n_tokens must stay untouched
    x = random_activations(rng, max_tokens, width)
    w = rng.uniform(0.5, 1.5, width).astype(np.float32)
    x_buf, w_buf = upload(device, x, "x"), upload(device, w, "norm w")
    sentinel = np.full(max_tokens * width // 4, 0xDEADBEEF, dtype=np.uint32)
    xq_buf = upload(device, sentinel, "xq")
    scale_buf = upload(device, np.full(max_tokens, -1.0, np.float32), "scale")
    op = RMSNormQuant(kernels, x_buf, w_buf, xq_buf, scale_buf, step_params(device, t), width, EPS)
    run(device, (op, (t,), {}))

    q_ref, inv_s_ref, scaled = ref_quantize_rows(ref_rmsnorm(x[:t], w, EPS))
    words = read(device, xq_buf, np.uint32, max_tokens * width // 4).reshape(max_tokens, -1)
    q_gpu = unpack_int8_words(words[:t], width)
    assert_codes_match(q_gpu, q_ref, scaled)
    scales = read(device, scale_buf, np.float32, max_tokens)
    np.testing.assert_allclose(scales[:t], inv_s_ref, rtol=1e-5)
    assert np.all(words[t:] == 0xDEADBEEF) and np.all(scales[t:] == -1.0)


def test_quantize_only_has_exact_codes(device, kernels):
    """Without a norm weight the op only quantizes: no reduction order can move y, so codes and
    packing (value 4i+e in byte e) must equal numpy bit for bit away from exact ties."""
    rng = np.random.default_rng(5)
    t, width = 3, 384
    x = random_activations(rng, t, width)
    x[0, :8] = [127.5, -3.0, 0.49, -0.51, 2.5, 1.5, -2.5, 0.0]  # ties and sign handling in the first words
    x_buf = upload(device, x, "x")
    xq_buf = device.buffer(t * width, label="xq")
    scale_buf = device.buffer(4 * t, label="scale")
    op = RMSNormQuant(kernels, x_buf, None, xq_buf, scale_buf, step_params(device, t), width, EPS)
    run(device, (op, (t,), {}))
    q_ref, inv_s_ref, scaled = ref_quantize_rows(x)
    words = read(device, xq_buf, np.uint32, t * width // 4).reshape(t, -1)
    assert_codes_match(unpack_int8_words(words, width), q_ref, scaled)
    np.testing.assert_array_equal(words[1:], pack_int8_words(q_ref[1:]))
    np.testing.assert_allclose(read(device, scale_buf, np.float32, t), inv_s_ref, rtol=1e-6)


@pytest.mark.parametrize("last_only", [False, True])
def test_rmsnorm_f32_matches_numpy(device, kernels, last_only):
    rng = np.random.default_rng(11)
    t, width = 5, 640
    x = random_activations(rng, t, width)
    w = rng.uniform(-2, 2, width).astype(np.float32)
    x_buf, w_buf = upload(device, x, "x"), upload(device, w, "w")
    y_buf = upload(device, np.full((t, width), 7.0, np.float32), "y")
    op = RMSNorm(kernels, x_buf, w_buf, y_buf, step_params(device, t), width, EPS)
    run(device, (op, (t,), {"last_only": last_only}))
    y = read(device, y_buf, np.float32, t * width).reshape(t, width)
    ref = ref_rmsnorm(x, w, EPS)
    if last_only:
        np.testing.assert_allclose(y[0], ref[t - 1], rtol=2e-5, atol=2e-5)
        assert np.all(y[1:] == 7.0)
    else:
        np.testing.assert_allclose(y, ref, rtol=2e-5, atol=2e-5)


def test_norm_rejects_bad_width(device, kernels):
    buf = device.buffer(4096, label="x")
    with pytest.raises(NormShapeError, match="multiple of 4"):
        RMSNorm(kernels, buf, buf, buf, StepParams(device), 30, EPS)
    with pytest.raises(NormShapeError, match="norm weight"):
        RMSNormQuant(kernels, buf, device.buffer(16, label="w"), buf, buf, StepParams(device), 256, EPS)


# Ternary weights ---------------------------------------------------------------------------------


def random_ternary(rng, n: int, k: int) -> np.ndarray:
    return rng.integers(-1, 2, size=(n, k)).astype(np.int8)


def test_pack_ternary_rows_matches_quants_decode():
    """Packed rows of fused tensors decode (with bitnet_web.formats.quants) to the original values, and the
    per-row scales are each tensor's trailer scale."""
    from bitnet_web.formats.quants import i2s_decode

    rng = np.random.default_rng(1)
    shapes, scales = [(96, 256), (32, 256), (32, 256)], [0.75, 1.5, 0.125]
    values = [random_ternary(rng, n, k) for n, k in shapes]
    raws = [ref_i2s_encode(v, s) for v, s in zip(values, scales, strict=True)]
    packed, row_scales = pack_ternary_rows([(raw, n, k) for raw, (n, k) in zip(raws, shapes, strict=True)])
    assert packed.dtype == np.uint8 and packed.size == 160 * 256 // 4
    trailer = np.zeros(32, np.uint8)
    trailer[:4] = np.frombuffer(np.float32(2.0).tobytes(), np.uint8)
    decoded, scale = i2s_decode(np.concatenate([packed, trailer]), (160, 256))
    assert scale == 2.0
    np.testing.assert_array_equal(decoded, np.concatenate(values))
    np.testing.assert_array_equal(row_scales, np.repeat(np.float32(scales), [96, 32, 32]))


def test_pack_ternary_rows_rejects_bad_tensors():
    raw = ref_i2s_encode(np.zeros((4, 128), np.int8), 1.0)
    with pytest.raises(TernaryShapeError, match="expected 160"):
        pack_ternary_rows([(raw[:-1], 4, 128)])
    with pytest.raises(TernaryShapeError, match="multiple of 128"):
        pack_ternary_rows([(raw, 8, 64)])
    with pytest.raises(TernaryShapeError, match="128 columns"):
        pack_ternary_rows([(raw, 4, 128), (ref_i2s_encode(np.zeros((2, 256), np.int8), 1.0), 2, 256)])


def upload_ternary(device, values_list, scales, label="w", pair_rows=False) -> TernaryMatrix:
    raws = [(ref_i2s_encode(v, s), v.shape[0], v.shape[1]) for v, s in zip(values_list, scales, strict=True)]
    return TernaryMatrix.from_i2s(device, raws, label, pair_rows=pair_rows)


def linear_case(device, kernels, rng, n_parts, k, t, epilogue, max_tokens=None, **op_kwargs):
    """Build a TernaryLinear on random weights/activations; returns (op, buffers, reference y)."""
    max_tokens = max_tokens or t
    values = [random_ternary(rng, n, k) for n in n_parts]
    scales = list(rng.uniform(0.2, 2.0, len(n_parts)))
    weights = upload_ternary(device, values, scales, pair_rows=epilogue.startswith("gate"))
    q = rng.integers(-128, 128, size=(max_tokens, k)).astype(np.int8)
    inv_s = rng.uniform(0.001, 0.05, max_tokens).astype(np.float32)
    xq_buf = upload(device, pack_int8_words(q), "xq")
    xs_buf = upload(device, inv_s, "xs")
    n = sum(n_parts)
    out_w = n // 2 if epilogue.startswith("gate") else n
    prior = rng.standard_normal((max_tokens, out_w)).astype(np.float32)
    out_buf = upload(device, prior, "out")
    step = step_params(device, t)
    op = TernaryLinear(kernels, weights, xq_buf, xs_buf, out_buf, step, epilogue, **op_kwargs)
    row_scales = np.repeat(np.float32(scales), n_parts)
    y = ref_ternary_linear(np.concatenate(values), row_scales, q[:t], inv_s[:t])
    expected = prior.astype(np.float64).copy()
    if epilogue == "store":
        expected[:t] = y
    elif epilogue == "residual":
        expected[:t] += y
    else:
        act = ref_relu2 if epilogue == "gate_relu2" else ref_silu
        expected[:t] = act(y[:, :out_w]) * y[:, out_w:]
    return op, out_buf, expected


def check_linear(device, op, out_buf, expected):
    check_linear_values(read(device, out_buf, np.float32, expected.size).reshape(expected.shape), expected)


def check_linear_values(got, expected):
    # The integer dot products are exact; only the f32 scaling (and exp in silu) rounds.
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


LINEAR_CASES = [
    # (row counts of the fused tensors, K, T)
    ([96], 128, 1),
    ([200], 384, 3),
    ([640, 160, 160], 640, 1),  # fused QKV with three scales
    ([640, 160, 160], 640, 17),
    ([96, 40], 384, 17),
    ([200, 72], 640, 40),  # two token tiles of the GEMM, a partial row tile
]


@pytest.mark.parametrize("parts,k,t", LINEAR_CASES)
@pytest.mark.parametrize("epilogue", ["store", "residual"])
def test_ternary_linear_matches_numpy(device, kernels, parts, k, t, epilogue):
    rng = np.random.default_rng(k * 100 + t + len(parts))
    op, out_buf, expected = linear_case(device, kernels, rng, parts, k, t, epilogue, max_tokens=t + 1)
    run(device, (op, (t,), {}))
    check_linear(device, op, out_buf, expected)


@pytest.mark.parametrize("epilogue", ["gate_relu2", "gate_silu"])
@pytest.mark.parametrize("f,k,t", [(100, 256, 1), (100, 256, 3), (64, 384, 17), (40, 256, 37)])
def test_gated_epilogues_match_numpy(device, kernels, epilogue, f, k, t):
    rng = np.random.default_rng(f + k + t)
    op, out_buf, expected = linear_case(device, kernels, rng, [f, f], k, t, epilogue)
    run(device, (op, (t,), {}))
    check_linear(device, op, out_buf, expected)


@pytest.mark.parametrize(
    "tile",
    [
        {"TX": 16, "TY": 8, "MR": 4, "MT": 4},
        {"TX": 8, "TY": 8, "MR": 2, "MT": 8},
        {"TX": 16, "TY": 4, "MR": 6, "MT": 2},
        {"TX": 8, "TY": 4, "MR": 4, "MT": 2, "KB": 3},
        {"TX": 16, "TY": 8, "MR": 2, "MT": 8},
    ],
)
@pytest.mark.parametrize("epilogue", ["residual", "gate_relu2"])
@pytest.mark.slow
def test_gemm_tiles_match_numpy(device, kernels, tile, epilogue):
    """Other GEMM tilings (the sweep's variants) compute the same function, tile edges included."""
    rng = np.random.default_rng(tile["TX"] + tile["MR"] + len(epilogue))
    op, out_buf, expected = linear_case(device, kernels, rng, [90, 90], 384, 21, epilogue, gemm_tile=tile)
    run(device, (op, (21,), {}))
    check_linear(device, op, out_buf, expected)


@pytest.mark.parametrize("epilogue", ["store", "gate_silu"])
@pytest.mark.parametrize("kb,k", [(2, 512), (2, 1536)])
def test_gemm_multi_block_stages_match_numpy(device, kernels, epilogue, kb, k):
    """KB 128-value blocks staged per barrier pair, over several stages (K / 128 / KB > 1)."""
    rng = np.random.default_rng(kb * k + len(epilogue))
    tile = {"TX": 8, "TY": 4, "MR": 4, "MT": 2, "KB": kb}
    op, out_buf, expected = linear_case(device, kernels, rng, [72, 72], k, 19, epilogue, gemm_tile=tile)
    run(device, (op, (19,), {}))
    check_linear(device, op, out_buf, expected)


@pytest.mark.parametrize("rows,wg", [(4, 32), (16, 64), (2, 128)])
def test_gemv_variants_match_numpy(device, kernels, rows, wg):
    """GEMV rows-per-workgroup x threads variants (K=640: 10 chunks; wg 32 leaves threads idle)."""
    rng = np.random.default_rng(rows * wg)
    op, out_buf, expected = linear_case(
        device, kernels, rng, [70, 70], 640, 1, "gate_silu", gemv_rows=rows, gemv_workgroup_size=wg
    )
    run(device, (op, (1,), {}))
    check_linear(device, op, out_buf, expected)


# 2..SMALL_T_MAX rows at once: ternary_gemv_rows (each weight read once for all rows) ---------------

ROWS_CASES = [
    # (row counts of the fused tensors, K, T, epilogue, kwargs): every epilogue, T = 1..9, partial
    # workgroups (rows not a multiple of the workgroup's), idle threads (K/64 < threads) and two chunks
    # per thread (K = 1280 with 16 threads)
    ([100], 384, 1, "store", {}),
    ([70, 70], 640, 2, "gate_silu", {}),
    ([640, 160, 160], 640, 3, "store", {}),
    ([200], 1280, 4, "residual", {"gemv_workgroup_size": 16}),
    ([36, 36], 6912, 5, "gate_relu2", {}),
    ([100], 2560, 6, "residual", {"rows_gemv_rows": 4}),
    ([52, 52], 384, 7, "gate_relu2", {"rows_gemv_rows": 16, "gemv_workgroup_size": 32}),
    ([90], 256, 8, "store", {}),
    ([66, 66], 256, 9, "gate_silu", {}),
]


@pytest.mark.parametrize("parts,k,t,epilogue,kwargs", ROWS_CASES)
def test_rows_gemv_matches_numpy(device, kernels, parts, k, t, epilogue, kwargs):
    rng = np.random.default_rng(1500 + k + t)
    op, out_buf, expected = linear_case(device, kernels, rng, parts, k, t, epilogue, max_tokens=t + 1, **kwargs)
    recorder = device.begin()
    op.record_rows(recorder, t)
    recorder.submit()
    check_linear(device, op, out_buf, expected)  # row t (past the step) keeps its prior values


@pytest.mark.parametrize("variant", ["no-subgroups", "no-dot4"])
def test_rows_gemv_fallbacks(device, variant):
    kernels = KernelCache(device)
    with without_subgroups(device, variant == "no-subgroups"):
        rng = np.random.default_rng(1515)
        op, out_buf, expected = linear_case(
            device, kernels, rng, [40, 40], 640, 5, "gate_silu", use_dot4=variant != "no-dot4"
        )
        recorder = device.begin()
        op.record_rows(recorder, 5)
        recorder.submit()
    check_linear(device, op, out_buf, expected)


def test_rows_gemv_rejects_row_counts(device, kernels):
    rng = np.random.default_rng(1516)
    op, _, _ = linear_case(device, kernels, rng, [64], 256, 3, "store")
    for bad in (0, 4, SMALL_T_MAX + 1):  # the buffers hold 3 rows
        with pytest.raises(TernaryShapeError, match="record_rows takes 1..3 rows"):
            op.record_rows(device.begin(), bad)


def test_unroll_loops_expands_nested_blocks():
    source = "a\n//#for r in ROWS\nx{{r}}\n//#for m in 2\ny{{r}}{{m}}\n//#endfor\n//#endfor\nb\n"
    assert unroll_loops(source, {"ROWS": 2}) == "a\nx0\ny00\ny01\nx1\ny10\ny11\nb\n"
    assert unroll_loops("//#for i in 0\nz\n//#endfor\n", {}) == ""
    with pytest.raises(ValueError, match="not an integer"):
        unroll_loops("//#for i in MISSING\n//#endfor\n", {})
    with pytest.raises(ValueError, match="without //#endfor"):
        unroll_loops("//#for i in 2\nz\n", {})


@pytest.mark.parametrize("t", [1, 5])
def test_ternary_linear_k2560(device, kernels, t):
    rng = np.random.default_rng(2560 + t)
    op, out_buf, expected = linear_case(device, kernels, rng, [200], 2560, t, "residual")
    run(device, (op, (t,), {}))
    check_linear(device, op, out_buf, expected)


def test_gemv_handles_each_token_row(device, kernels):
    """The decode GEMV indexes token rows by workgroup_id.y: run it for 3 rows at once."""
    rng = np.random.default_rng(7)
    op, out_buf, expected = linear_case(device, kernels, rng, [72, 72], 256, 3, "gate_silu")
    recorder = device.begin()
    op.record_gemv(recorder, 3)
    recorder.submit()
    check_linear(device, op, out_buf, expected)


@pytest.mark.parametrize("variant", ["no-subgroups", "no-dot4"])
@pytest.mark.parametrize("t", [1, 3])
def test_fallback_paths_match_numpy(device, variant, t):
    """Adapters without subgroups or without packed dot products get the same results."""
    kernels = KernelCache(device)
    features = device.features
    try:
        if variant == "no-subgroups":
            device.features = features - {"subgroups"}
        else:  # a browser whose wgslLanguageFeatures lack packed_4x8_integer_dot_product
            device.wgsl_language_features = frozenset({"readonly_and_readwrite_storage_textures"})
        rng = np.random.default_rng(3 + t)
        op, out_buf, expected = linear_case(device, kernels, rng, [50, 50], 384, t, "gate_relu2")
    finally:
        device.features = features
        vars(device).pop("wgsl_language_features", None)
    assert ("DOT4" in op.gemv.label) == (variant != "no-dot4")
    assert ("SUBGROUPS" in op.gemv.label) == (variant != "no-subgroups")
    run(device, (op, (t,), {}))
    check_linear(device, op, out_buf, expected)


def test_bitlinear_chain_matches_reference(device, kernels):
    """RMSNormQuant feeding TernaryLinear reproduces the ground-truth BitLinear of a normed input."""
    rng = np.random.default_rng(9)
    t, k, n = 3, 640, 136
    x = random_activations(rng, t, k)
    w = rng.uniform(0.5, 1.5, k).astype(np.float32)
    values = random_ternary(rng, n, k)
    weights = upload_ternary(device, [values], [0.7])
    x_buf, w_buf = upload(device, x, "x"), upload(device, w, "w")
    xq_buf, xs_buf = device.buffer(t * k, label="xq"), device.buffer(4 * t, label="xs")
    y_buf = device.buffer(4 * t * n, label="y")
    step = step_params(device, t)
    norm = RMSNormQuant(kernels, x_buf, w_buf, xq_buf, xs_buf, step, k, EPS)
    linear = TernaryLinear(kernels, weights, xq_buf, xs_buf, y_buf, step, "store")
    run(device, (norm, (t,), {}), (linear, (t,), {}))
    q, inv_s, _ = ref_quantize_rows(ref_rmsnorm(x, w, EPS))
    expected = ref_ternary_linear(values, np.full(n, 0.7), q, inv_s)
    got = read(device, y_buf, np.float32, t * n).reshape(t, n)
    # one int8 step of difference at a rounding tie moves y by at most 0.7 * inv_s
    np.testing.assert_allclose(got, expected, atol=0.7 * inv_s.max() * 1.01 + 1e-5 * np.abs(expected).max())


def test_ternary_linear_rejects_bad_use(device, kernels):
    rng = np.random.default_rng(0)
    weights = upload_ternary(device, [random_ternary(rng, 8, 128)], [1.0])
    buf = device.buffer(4096, label="buf")
    with pytest.raises(TernaryShapeError, match="pair_rows"):
        TernaryLinear(kernels, weights, buf, buf, buf, StepParams(device), "gate_relu2")
    with pytest.raises(TernaryShapeError, match="unknown epilogue"):
        TernaryLinear(kernels, weights, buf, buf, buf, StepParams(device), "gelu")
    with pytest.raises(TernaryShapeError, match="too small"):
        TernaryLinear(kernels, weights, device.buffer(64, label="small"), buf, buf, StepParams(device))
    with pytest.raises(TernaryShapeError, match="equal shape"):
        upload_ternary(device, [random_ternary(rng, 8, 128), random_ternary(rng, 4, 128)], [1.0, 1.0], pair_rows=True)


# Embedding, LM head, argmax (sharded) --------------------------------------------------------------


@pytest.fixture(scope="module")
def small_binding_device():
    """A device that pretends to bind at most 40000 bytes, so a 1000 x 64 F16 table needs 4 shards."""
    try:
        dev = gpu.open_device(max_binding_size=40000)
    except gpu.GPUUnavailableError as exc:  # pragma: no cover
        pytest.skip(f"no WebGPU adapter: {exc}")
    yield dev
    dev.destroy()


def random_table(rng, v: int, d: int) -> np.ndarray:
    return (rng.standard_normal((v, d)) * 0.5).astype(np.float16)


def norm_head_case(device, rng, t: int, d: int, v: int) -> tuple:
    """The final norm -> LM head -> argmax chain's data: x (t, d), norm weight w, table (v, d), and
    buffers (x, w, xq, x scales, y, logits, ids)."""
    x = random_activations(rng, t, d)
    w = rng.uniform(0.5, 1.5, d).astype(np.float32)
    table = random_table(rng, v, d)
    buffers = (
        upload(device, x, "x"),
        upload(device, w, "w"),
        device.buffer(t * d, label="xq"),
        device.buffer(4 * t, label="xs"),
        device.buffer(4 * t * d, label="y"),
        device.buffer(4 * t * v, label="logits"),
        device.buffer(16, label="ids"),
    )
    return x, w, table, buffers


@contextlib.contextmanager
def without_subgroups(device, active: bool = True):
    """Build kernels inside as for an adapter without subgroups (the workgroup-memory fallbacks)."""
    features = device.features
    if active:
        device.features = features - {"subgroups"}
    try:
        yield
    finally:
        device.features = features


def test_embedding_lookup_uses_every_shard(small_binding_device):
    device = small_binding_device
    kernels = KernelCache(device)
    rng = np.random.default_rng(21)
    v, d = 1000, 64
    table = random_table(rng, v, d)
    matrix = F16Matrix.upload(device, table, "embd")
    assert len(matrix.shards) == 4 and matrix.shards[-1][1] == v
    ids = np.array([0, 311, 312, 999, 624, 625, 5, 998], dtype=np.uint32)  # both sides of each boundary
    starts = [s for s, _, _ in matrix.shards]
    assert {int(np.searchsorted(starts, i, side="right")) - 1 for i in ids} == {0, 1, 2, 3}
    ids_buf = upload(device, ids, "ids")
    x_buf = upload(device, np.full((len(ids), d), 9.0, np.float32), "x")
    op = EmbeddingLookup(kernels, matrix, ids_buf, x_buf, step_params(device, len(ids)))
    run(device, (op, (len(ids),), {}))
    got = read(device, x_buf, np.float32, len(ids) * d).reshape(len(ids), d)
    np.testing.assert_array_equal(got, table[ids].astype(np.float32))


def test_embedding_zeroes_out_of_range_ids(device, kernels):
    rng = np.random.default_rng(22)
    table = random_table(rng, 50, 16)
    matrix = F16Matrix.upload(device, table, "embd")
    ids_buf = upload(device, np.array([3, 50, 7], np.uint32), "ids")
    x_buf = upload(device, np.full((3, 16), 9.0, np.float32), "x")
    run(device, (EmbeddingLookup(kernels, matrix, ids_buf, x_buf), (3,), {}))
    got = read(device, x_buf, np.float32, 48).reshape(3, 16)
    np.testing.assert_array_equal(got[[0, 2]], table[[3, 7]].astype(np.float32))
    assert np.all(got[1] == 0.0)


@pytest.mark.parametrize("n_rows,small_t_rows", [(1, 4), (2, 8), (6, 4), (9, 2)])
def test_lm_head_uses_every_shard(small_binding_device, n_rows, small_t_rows):
    """Decode and small-T (verify steps: all rows in one pass, `small_t_rows` matrix rows per workgroup)."""
    device = small_binding_device
    kernels = KernelCache(device)
    rng = np.random.default_rng(30 + n_rows)
    v, d = 1000, 64
    table = random_table(rng, v, d)
    matrix = F16Matrix.upload(device, table, "head")
    assert len(matrix.shards) == 4
    x = random_activations(rng, n_rows, d)
    x_buf = upload(device, x, "x")
    logits_buf = upload(device, np.full((n_rows, v), np.nan, np.float32), "logits")
    op = LMHead(kernels, matrix, x_buf, logits_buf, step_params(device, n_rows), small_t_rows=small_t_rows)
    run(device, (op, (n_rows,), {}))
    got = read(device, logits_buf, np.float32, n_rows * v).reshape(n_rows, v)
    expected = x.astype(np.float64) @ table.astype(np.float64).T
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_lm_head_d2560_matches_numpy(device, kernels):
    rng = np.random.default_rng(31)
    v, d = 300, 2560
    table = random_table(rng, v, d)
    matrix = F16Matrix.upload(device, table, "head")
    x = random_activations(rng, 1, d)
    x_buf = upload(device, x, "x")
    logits_buf = device.buffer(4 * v, label="logits")
    run(device, (LMHead(kernels, matrix, x_buf, logits_buf, step_params(device, 5)), (1,), {}))
    got = read(device, logits_buf, np.float32, v)
    expected = x[0].astype(np.float64) @ table.astype(np.float64).T
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_f16_matrix_rejects_bad_shapes(device):
    with pytest.raises(EmbeddingShapeError, match="multiple of 8"):
        F16Matrix.upload(device, np.zeros((4, 12), np.float16), "m")
    with pytest.raises(EmbeddingShapeError, match="2-D"):
        F16Matrix.upload(device, np.zeros(16, np.float16), "m")


@pytest.mark.parametrize("v,row,slot", [(1000, 0, 0), (128256, 1, 2), (7, 0, 1)])
def test_argmax_matches_numpy(device, kernels, v, row, slot):
    rng = np.random.default_rng(v + row)
    logits = rng.standard_normal((row + 1, v)).astype(np.float32)
    winner = int(rng.integers(0, v))
    logits[row, winner] = 50.0
    if v > 10:
        logits[row, winner + 1 if winner + 1 < v else winner - 1] = np.nan  # NaN never wins
        logits[row, min(winner + 5, v - 1)] = 50.0  # a tie later in the row: the first index wins
    logits_buf = upload(device, logits, "logits")
    ids_buf = upload(device, np.full(4, 77, np.uint32), "ids")
    run(device, (Argmax(kernels, logits_buf, ids_buf, v, slot=slot, row=row), (), {}))
    ids = read(device, ids_buf, np.uint32, 4)
    assert ids[slot] == int(np.nanargmax(logits[row]))
    assert all(ids[i] == 77 for i in range(4) if i != slot)


def test_argmax_ties_and_nans_across_workgroups(device, kernels):
    """The first pass splits the row over workgroups: a tie between two workgroups goes to the
    smaller index, and a workgroup whose logits are all NaN takes no part."""
    v = 128256
    span = 256 * 4  # ARGMAX_WORKGROUP * ARGMAX_PER_THREAD
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(v).astype(np.float32)
    logits[:span] = np.nan  # workgroup 0: nothing but NaN
    logits[[7 * span + 3, 2 * span + 900, 90 * span]] = 9.0  # the winner is 2 * span + 900
    logits_buf = upload(device, logits, "logits")
    ids_buf = upload(device, np.full(4, 77, np.uint32), "ids")
    run(device, (Argmax(kernels, logits_buf, ids_buf, v), (), {}))
    assert read(device, ids_buf, np.uint32, 1)[0] == 2 * span + 900 == int(np.nanargmax(logits))


@pytest.mark.parametrize("rows,wg", [(2, 320), (8, 64), (16, 160)])
def test_lm_head_variants_match_numpy(device, kernels, rows, wg):
    rng = np.random.default_rng(rows + wg)
    v, d = 333, 2560
    table = random_table(rng, v, d)
    matrix = F16Matrix.upload(device, table, "head")
    x = random_activations(rng, 1, d)
    logits_buf = device.buffer(4 * v, label="logits")
    op = LMHead(
        kernels,
        matrix,
        upload(device, x, "x"),
        logits_buf,
        step_params(device, 1),
        rows_per_workgroup=rows,
        workgroup_size=wg,
    )
    run(device, (op, (1,), {}))
    expected = x[0].astype(np.float64) @ table.astype(np.float64).T
    np.testing.assert_allclose(
        read(device, logits_buf, np.float32, v), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max()
    )


def test_lm_head_takes_more_rows_per_workgroup_where_a_dispatch_would_be_too_large(device, monkeypatch):
    """A vocabulary over 3 x the device's workgroups per dimension: the head raises its rows per
    workgroup (one-row and small-T), stays within the limit, and its logits still match numpy."""
    import dataclasses

    monkeypatch.setattr(device, "limits", dataclasses.replace(device.limits, max_compute_workgroups_per_dimension=50))
    kernels = KernelCache(device)
    rng = np.random.default_rng(77)
    v, d, t = 333, 64, 3
    table = random_table(rng, v, d)
    x = random_activations(rng, t, d)
    logits_buf = device.buffer(4 * t * v, label="logits")
    op = LMHead(
        kernels, F16Matrix.upload(device, table, "head"), upload(device, x, "x"), logits_buf, step_params(device, t)
    )
    assert all(groups <= 50 for _, _, groups in op.single + op.small_t(t))
    expected = x.astype(np.float64) @ table.astype(np.float64).T
    for n in (1, t):
        run(device, (op, (n,), {}))
        got = read(device, logits_buf, np.float32, n * v).reshape(n, v)
        np.testing.assert_allclose(got, expected[:n], rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_greedy_step_stays_on_gpu(device, kernels):
    """Argmax writes the id where EmbeddingLookup reads it: head -> argmax -> embed in one submit."""
    rng = np.random.default_rng(40)
    v, d = 200, 32
    table = random_table(rng, v, d)
    matrix = F16Matrix.upload(device, table, "embd")
    x = random_activations(rng, 1, d)
    x_buf = upload(device, x, "x")
    logits_buf = device.buffer(4 * v, label="logits")
    ids_buf = upload(device, np.zeros(1, np.uint32), "ids")
    out_buf = device.buffer(4 * d, label="next x")
    step = step_params(device, 1)
    run(
        device,
        (LMHead(kernels, matrix, x_buf, logits_buf, step), (1,), {}),
        (Argmax(kernels, logits_buf, ids_buf, v), (), {}),
        (EmbeddingLookup(kernels, matrix, ids_buf, out_buf), (1,), {}),
    )
    best = int(np.argmax(x[0].astype(np.float64) @ table.astype(np.float64).T))
    np.testing.assert_array_equal(read(device, out_buf, np.float32, d), table[best].astype(np.float32))


def test_reductions_without_subgroups(device):
    """The workgroup-memory fallbacks (adapters without subgroups) of the norm, LM head and argmax."""
    kernels = KernelCache(device)
    t, d, v = 3, 640, 120
    x, w, table, (x_buf, w_buf, xq_buf, xs_buf, y_buf, logits_buf, ids_buf) = norm_head_case(
        device, np.random.default_rng(50), t, d, v
    )
    step = step_params(device, t)
    with without_subgroups(device):
        matrix = F16Matrix.upload(device, table, "head")
        ops = [
            (RMSNormQuant(kernels, x_buf, w_buf, xq_buf, xs_buf, step, d, EPS), (t,), {}),
            (RMSNorm(kernels, x_buf, w_buf, y_buf, step, d, EPS), (t,), {}),
            (LMHead(kernels, matrix, y_buf, logits_buf, step), (t,), {}),
            (Argmax(kernels, logits_buf, ids_buf, v, row=2), (), {}),
        ]
    assert all("SUBGROUPS" not in op.pipeline.label for op, _, _ in ops[:1])
    run(device, *ops)
    normed = ref_rmsnorm(x, w, EPS)
    q_ref, inv_s_ref, scaled = ref_quantize_rows(normed)
    words = read(device, xq_buf, np.uint32, t * d // 4).reshape(t, -1)
    assert_codes_match(unpack_int8_words(words, d), q_ref, scaled)
    np.testing.assert_allclose(read(device, y_buf, np.float32, t * d).reshape(t, d), normed, rtol=2e-5, atol=2e-5)
    logits = read(device, logits_buf, np.float32, t * v).reshape(t, v)
    expected = normed @ table.astype(np.float64).T
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert read(device, ids_buf, np.uint32, 1)[0] == int(np.argmax(logits[2]))


# Tint (Chromium) validation of every shader variant ---------------------------------------------


class ShaderCollector(gpu.Device):
    """A stand-in device that records each pipeline's WGSL instead of compiling it, as a browser
    device with the given features would be asked to."""

    backend = "browser"

    def __init__(self, features: frozenset[str]):
        self.features = features
        self.limits = gpu.GPULimits(1 << 30, 1 << 30, 32768, 256, 65535, 256)
        self.sources: dict[str, str] = {}

    def buffer(self, nbytes, usage=gpu.STORAGE_USAGE, label=""):
        return gpu.Buffer(None, nbytes, label, usage)

    def upload(self, buffer, offset, data):
        pass

    def pipeline(self, wgsl, label, entry_point="main"):
        self.sources[label] = wgsl
        return gpu.Pipeline(None, label)

    def bind_group(self, pipeline, buffers, label=""):
        return gpu.BindGroup(None, label, tuple(buffers))


def k1_shader_variants() -> dict[str, str]:
    """The WGSL of the K1 op variants that differ in text: subgroups on/off, each epilogue, dot4
    on/off (one epilogue suffices), norm weight or not, K = 2560 and 6912. Deduplicated by text."""
    by_source: dict[str, str] = {}
    for features in (frozenset({"subgroups"}), frozenset()):
        dev = ShaderCollector(features)
        kernels = KernelCache(dev)
        step = StepParams(dev)
        big = dev.buffer(1 << 24, label="big")
        rng = np.random.default_rng(0)
        for k, parts, epilogues in (
            (2560, [128, 128], ("store", "residual", "gate_relu2", "gate_silu")),
            (6912, [64, 64], ("residual",)),
        ):
            codes = [(np.zeros(n * k // 4, np.uint8), 1.0, (n, k)) for n in parts]
            plain = TernaryMatrix.upload(dev, codes[:1], "w")
            paired = TernaryMatrix.upload(dev, codes, "gu", pair_rows=True)
            for epilogue in epilogues:
                for dot4 in (True, False) if epilogue == "gate_silu" else (True,):
                    matrix = paired if epilogue.startswith("gate") else plain
                    TernaryLinear(kernels, matrix, big, big, big, step, epilogue, use_dot4=dot4)
                    NormTernaryLinear(kernels, big, big, EPS, matrix, big, big, big, step, epilogue, use_dot4=dot4)
            NormTernaryLinear(kernels, big, None, EPS, plain, big, big, big, step, "residual")
            # the split small-T path's QUANT_ONLY kernel (built at load where a matrix is large)
            NormTernaryLinear(kernels, big, big, EPS, plain, big, big, big, step, "store")._split_kernels()
            NormTernaryLinear(kernels, big, big, EPS, paired, big, big, big, step, "gate_relu2", row_groups=2)
        for weight in (big, None):
            RMSNormQuant(kernels, big, weight, big, big, step, 2560, EPS)
        RMSNorm(kernels, big, big, big, step, 2560, EPS, digits=(big, big))
        table = F16Matrix.upload(dev, random_table(rng, 64, 2560), "t")
        EmbeddingLookup(kernels, table, big, big)
        LMHead(kernels, table, big, big, step).small_t(9)
        # a row of 80 chunks is not a whole number per thread: the head's bounds-checked variant
        table640 = F16Matrix.upload(dev, random_table(rng, 64, 640), "t640")
        LMHead(kernels, table640, big, big, step).small_t(3)
        for head_table in (table, table640):  # the screened head: quantize, screen, rescores, combine
            head = LMHead(kernels, head_table, big, big, step)
            screen = ScreenedArgmax(kernels, head, head_table, big, big, big, big, 64)
        # speculative steps: verify rows' sampling and acceptance, draft-off steps through the screen
        SpecSampleAccept(kernels, big, big, big, big, 128256, 5).use_screen(screen)
        GreedyAccept(kernels, big, big, big, big, 128256, 5).use_screen(screen)
        GPUSampler(kernels, big, big, 128256).draw_from_candidates(big, big, SAMPLED_KEY_SLOTS)  # every sampler pass
        Argmax(kernels, big, big, 128256)
        GPUBusy(kernels)
        for label, src in dev.sources.items():
            by_source.setdefault(src, f"{sorted(features)} {label}")
    return {label: src for src, label in by_source.items()}


def test_every_variant_is_collected():
    sources = k1_shader_variants()
    assert any("enable subgroups;" in s for s in sources.values())
    assert any("dot4I8Packed" in s for s in sources.values())
    assert any("fn dot4(a: u32, b: u32) -> i32 {\n    let p = bitcast" in s for s in sources.values())
    assert len(sources) >= 30
    assert any("ternary_gemv_norm" in label and "SUBGROUPS" not in label for label in sources)
    assert any("ternary_gemv_norm" in label and "QUANT_ONLY" in label for label in sources)
    heads = [label for label in sources if "lm_head" in label]
    assert any("WHOLE" in label for label in heads) and any("WHOLE" not in label for label in heads)
    assert any("lm_head_screen" in label and "QUANTIZE" not in label for label in sources)
    assert any("RESCORE" in label for label in sources) and any("SCREENED" in label for label in sources)
    assert any("RESCORE" in label and "TOPK" in label for label in sources)
    assert any("sample_topk" in label and "CANDIDATES" in label for label in sources)
    assert any("lm_head_screen_tau" in label for label in sources)
    assert any("spec_sample" in label and "CANDIDATES" in label for label in sources)
    assert any("rmsnorm" in label and "DIGITS" in label for label in sources)


def run_in_chromium(js: str, argument):
    """Evaluate `js` (an async arrow function) with `argument` in a page of headless Chromium with
    WebGPU on SwiftShader, served from 127.0.0.1 (WebGPU needs a secure context)."""
    import functools
    import http.server
    import shutil
    import tempfile
    import threading

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    sync_api = pytest.importorskip("playwright.sync_api")
    if chromium is None:
        pytest.skip("no chromium executable")
    with tempfile.TemporaryDirectory() as root:
        Path(root, "index.html").write_text("<!doctype html><title>k1</title>")
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=root)
        handler.log_message = lambda *args: None
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with sync_api.sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_WEBGPU_ARGS)
                page = browser.new_page()
                page.goto(f"http://127.0.0.1:{server.server_address[1]}/index.html")
                result = page.evaluate(js, argument)
                browser.close()
        finally:
            server.shutdown()
    if result is None:
        pytest.skip("Chromium has no WebGPU adapter here")
    return result


@pytest.mark.browser
@pytest.mark.slow
def test_wgsl_compiles_in_chromium_tint():
    """Every K1 shader variant compiles and builds a pipeline in Chromium's WebGPU (Tint + SwiftShader)."""
    import json

    result = run_in_chromium(COMPILE_ALL_JS, list(k1_shader_variants().items()))
    assert "subgroups" in result["features"]
    failures = {label: msgs for label, msgs in result["results"] if msgs}
    assert not failures, json.dumps(failures, indent=1)[:4000]


CHROMIUM_WEBGPU_ARGS = [
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]

COMPILE_ALL_JS = """async (shaders) => {
  if (!navigator.gpu) return null;
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) return null;
  const wanted = ['subgroups'].filter(f => adapter.features.has(f));
  const device = await adapter.requestDevice({requiredFeatures: wanted});
  const results = [];
  for (const [label, code] of shaders) {
    device.pushErrorScope('validation');
    const module = device.createShaderModule({code, label});
    const info = await module.getCompilationInfo();
    const msgs = info.messages.filter(m => m.type === 'error').map(m => `${m.lineNum}:${m.linePos} ${m.message}`);
    try { await device.createComputePipelineAsync({layout: 'auto', compute: {module, entryPoint: 'main'}}); }
    catch (e) { msgs.push(String(e)); }
    const err = await device.popErrorScope();
    if (err) msgs.push(err.message);
    results.push([label, msgs]);
  }
  return {features: [...adapter.features], results};
}"""


# Running the kernels in Chromium (SwiftShader: another compiler, another subgroup size) ------------


class ReplayDevice(ShaderCollector):
    """Records buffers, uploads, pipelines, bind groups and dispatches as a plan that
    REPLAY_JS executes in the browser; the read-back comes from the replay's result."""

    def __init__(self):
        super().__init__(frozenset({"subgroups"}))
        self.plan = {"buffers": [], "pipelines": [], "bind_groups": [], "ops": []}

    def buffer(self, nbytes, usage=gpu.STORAGE_USAGE, label=""):
        size = (nbytes + 3) & ~3
        self.plan["buffers"].append([len(self.plan["buffers"]), size, usage])
        return gpu.Buffer(len(self.plan["buffers"]) - 1, size, label, usage)

    def upload(self, buffer, offset, data):
        import base64

        raw = np.ascontiguousarray(data).tobytes()
        self.plan["ops"].append(["upload", buffer.handle, offset, base64.b64encode(raw).decode()])

    def pipeline(self, wgsl, label, entry_point="main"):
        self.plan["pipelines"].append([len(self.plan["pipelines"]), wgsl, label])
        return gpu.Pipeline(len(self.plan["pipelines"]) - 1, label)

    def bind_group(self, pipeline, buffers, label=""):
        self.plan["bind_groups"].append([len(self.plan["bind_groups"]), pipeline.handle, [b.handle for b in buffers]])
        return gpu.BindGroup(len(self.plan["bind_groups"]) - 1, label, tuple(buffers))

    def begin(self):
        plan = self.plan

        class Recorder(gpu.Recorder):
            def dispatch(self, pipeline, bind_group, x, y=1, z=1):
                plan["ops"].append(["dispatch", pipeline.handle, bind_group.handle, x, y, z])

            def submit(self):
                plan["ops"].append(["submit"])

        return Recorder()


@pytest.mark.browser
@pytest.mark.slow
def test_kernels_match_numpy_in_chromium():
    """The subgroup paths (reduction slots, subgroupAdd/Max/Min) on SwiftShader's subgroups give the
    same results as numpy: GEMV and GEMM with each epilogue, norms, LM head over shards, argmax."""
    import base64

    device = ReplayDevice()
    kernels = KernelCache(device)
    rng = np.random.default_rng(60)
    checks = []  # (name, buffer, expected, kind)
    for parts, k, t, epilogue in [
        ([96, 40], 384, 1, "store"),
        ([200], 2560, 1, "residual"),
        ([72, 72], 256, 1, "gate_relu2"),
        ([64, 64], 384, 17, "gate_silu"),
        ([640, 160, 160], 640, 3, "residual"),
    ]:
        op, out_buf, expected = linear_case(device, kernels, rng, parts, k, t, epilogue)
        run(device, (op, (t,), {}))
        checks.append((f"linear {parts} K={k} T={t} {epilogue}", out_buf, expected, "linear"))
    for parts, k, epilogue in [([100, 100], 2560, "gate_relu2"), ([72], 6912, "residual")]:
        op, out_buf, expected, tie = norm_linear_case(device, kernels, rng, parts, k, 2, epilogue)
        recorder = device.begin()
        op.record_fused(recorder, 2)
        recorder.submit()
        checks.append((f"norm linear {parts} K={k} {epilogue}", out_buf, (expected, tie), "norm_linear"))
    t, d, v = 3, 640, 120
    x, w, table, (x_buf, w_buf, xq_buf, xs_buf, y_buf, logits_buf, ids_buf) = norm_head_case(device, rng, t, d, v)
    last_buf = device.buffer(4 * d, label="last")
    step = step_params(device, t)
    device.limits = gpu.GPULimits(50000, 50000, 32768, 256, 65535, 256)  # 120 x 640 F16 -> 4 shards
    matrix = F16Matrix.upload(device, table, "head")
    assert len(matrix.shards) == 4
    run(
        device,
        (RMSNormQuant(kernels, x_buf, w_buf, xq_buf, xs_buf, step, d, EPS), (t,), {}),
        (RMSNorm(kernels, x_buf, w_buf, y_buf, step, d, EPS), (t,), {}),
        (RMSNorm(kernels, x_buf, w_buf, last_buf, step, d, EPS), (t,), {"last_only": True}),
        (LMHead(kernels, matrix, y_buf, logits_buf, step), (t,), {}),
        (Argmax(kernels, logits_buf, ids_buf, v, row=1, slot=2), (), {}),
    )
    normed = ref_rmsnorm(x, w, EPS)
    checks += [
        ("rmsnorm", y_buf, normed, "close"),
        ("rmsnorm last", last_buf, normed[-1], "close"),
        ("lm_head", logits_buf, normed @ table.astype(np.float64).T, "close"),
        ("xq", xq_buf, ref_quantize_rows(normed), "codes"),
        ("argmax", ids_buf, None, "argmax"),
    ]
    device.plan["read"] = sorted({c[1].handle for c in checks})
    result = run_in_chromium(REPLAY_JS, device.plan)
    assert not result["errors"], result["errors"]
    got = {int(i): np.frombuffer(base64.b64decode(b), np.uint8) for i, b in result["buffers"].items()}
    for name, buf, expected, kind in checks:
        data = got[buf.handle]
        if kind == "linear":
            check_linear_values(data.view(np.float32)[: expected.size].reshape(expected.shape), expected)
        elif kind == "norm_linear":
            expected, tie = expected
            values = data.view(np.float32)[: expected.size].reshape(expected.shape)
            check_norm_linear(values, expected, tie, name)
        elif kind == "close":
            values = data.view(np.float32)[: expected.size].reshape(expected.shape)
            np.testing.assert_allclose(values, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(), err_msg=name)
        elif kind == "codes":
            q_ref, _, scaled = expected
            assert_codes_match(unpack_int8_words(data.view(np.uint32)[: t * d // 4], d), q_ref, scaled)
        else:
            logits = got[logits_buf.handle].view(np.float32)[: t * v].reshape(t, v)
            assert data.view(np.uint32)[2] == int(np.argmax(logits[1]))


REPLAY_JS = """async (plan) => {
  if (!navigator.gpu) return null;
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) return null;
  const device = await adapter.requestDevice({requiredFeatures: ['subgroups']});
  const errors = [];
  device.pushErrorScope('validation');
  const bufs = {}, pipes = {}, groups = {};
  for (const [id, size, usage] of plan.buffers) bufs[id] = device.createBuffer({size, usage});
  for (const [id, code, label] of plan.pipelines) {
    const module = device.createShaderModule({code, label});
    pipes[id] = device.createComputePipeline({layout: 'auto', compute: {module, entryPoint: 'main'}, label});
  }
  for (const [id, pid, bids] of plan.bind_groups)
    groups[id] = device.createBindGroup({layout: pipes[pid].getBindGroupLayout(0),
      entries: bids.map((b, i) => ({binding: i, resource: {buffer: bufs[b]}}))});
  let encoder = null, pass = null;
  for (const op of plan.ops) {
    if (op[0] === 'upload') {
      const bytes = Uint8Array.from(atob(op[3]), c => c.charCodeAt(0));
      device.queue.writeBuffer(bufs[op[1]], op[2], bytes);
    } else if (op[0] === 'dispatch') {
      if (!encoder) { encoder = device.createCommandEncoder(); pass = encoder.beginComputePass(); }
      pass.setPipeline(pipes[op[1]]); pass.setBindGroup(0, groups[op[2]]);
      pass.dispatchWorkgroups(op[3], op[4], op[5]);
    } else if (op[0] === 'submit' && encoder) {
      pass.end(); device.queue.submit([encoder.finish()]); encoder = null;
    }
  }
  const out = {};
  for (const id of plan.read) {
    const src = bufs[id];
    const staging = device.createBuffer({size: src.size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST});
    const enc = device.createCommandEncoder();
    enc.copyBufferToBuffer(src, 0, staging, 0, src.size);
    device.queue.submit([enc.finish()]);
    await staging.mapAsync(GPUMapMode.READ);
    const bytes = new Uint8Array(staging.getMappedRange().slice(0));
    staging.unmap();
    let s = ''; for (let i = 0; i < bytes.length; i += 8192) s += String.fromCharCode(...bytes.subarray(i, i + 8192));
    out[id] = btoa(s);
  }
  const err = await device.popErrorScope();
  if (err) errors.push(err.message);
  return {buffers: out, errors};
}"""


# Norm folded into the decode GEMV ------------------------------------------------------------------


def norm_linear_case(device, kernels, rng, parts, k, t, epilogue, with_weight=True, **kwargs):
    """`mean_width=` in kwargs: inputs zero-padded past that width, as model/layout.py pads them."""
    values = [random_ternary(rng, n, k) for n in parts]
    scales = list(rng.uniform(0.2, 2.0, len(parts)))
    weights = upload_ternary(device, values, scales, pair_rows=epilogue.startswith("gate"))
    x = random_activations(rng, t, k)
    true_width = kwargs.get("mean_width", k)
    x[:, true_width:] = 0.0
    w = rng.uniform(0.5, 1.5, k).astype(np.float32) if with_weight else None
    x_buf = upload(device, x, "x")
    w_buf = upload(device, w, "norm w") if with_weight else None
    xq_buf, xs_buf = device.buffer(t * k, label="xq"), device.buffer(4 * t, label="xs")
    n = sum(parts)
    out_w = n // 2 if epilogue.startswith("gate") else n
    prior = rng.standard_normal((t, out_w)).astype(np.float32)
    out_buf = upload(device, prior, "out")
    op = NormTernaryLinear(
        kernels, x_buf, w_buf, EPS, weights, xq_buf, xs_buf, out_buf, step_params(device, t), epilogue, **kwargs
    )
    h = np.zeros((t, k))
    h[:, :true_width] = ref_rmsnorm(x[:, :true_width], w[:true_width], EPS) if with_weight else x[:, :true_width]
    q, inv_s, scaled = ref_quantize_rows(h)
    y = ref_ternary_linear(np.concatenate(values), np.repeat(np.float32(scales), parts), q, inv_s)
    expected = prior.astype(np.float64)
    if epilogue == "store":
        expected = y
    elif epilogue == "residual":
        expected = expected + y
    else:
        act = ref_relu2 if epilogue == "gate_relu2" else ref_silu
        expected = act(y[:, :out_w]) * y[:, out_w:]
    # One int8 step at a rounding tie moves y[n] by scale[n] * inv_s (times |u| or 2|g| for gates):
    # allowed only in token rows whose reference has a value within float32 noise of a .5 tie.
    step = max(scales) * inv_s.max() * (1 + (np.abs(y).max() * 2 if epilogue.startswith("gate") else 0))
    frac = np.abs(np.abs(scaled) % 1.0 - 0.5)
    near_tie = (frac < 1e-4 * np.maximum(1.0, np.abs(scaled))).any(axis=1, keepdims=True)
    tie = np.where(near_tie, step, 0.0)
    return op, out_buf, expected, tie


def check_norm_linear(got: np.ndarray, expected: np.ndarray, tie: np.ndarray, name: str = "") -> None:
    """Within float32 rounding (rtol 1e-5) everywhere, plus one int8 step in rows with a near-tie."""
    bound = tie + 1e-5 * np.abs(expected).max() + 1e-5 * np.abs(expected)
    bad = np.abs(got - expected) > bound
    assert not bad.any(), (
        f"{name}: {np.count_nonzero(bad)} of {bad.size} values off, e.g. got "
        f"{got[bad][:4]} expected {expected[bad][:4]}"
    )


@pytest.mark.parametrize(
    "parts,k,epilogue,with_weight",
    [
        ([96], 128, "store", True),
        ([200], 640, "residual", True),
        ([640, 160, 160], 2560, "store", True),
        ([100, 100], 384, "gate_relu2", True),
        ([64, 64], 6912, "gate_silu", True),
        ([72], 384, "residual", False),
    ],
)
@pytest.mark.parametrize("rows,row_groups", [(16, 1), (8, 1), (32, 1), (16, 2), (8, 4)])
@pytest.mark.slow
def test_norm_linear_decode_matches_numpy(device, kernels, parts, k, epilogue, with_weight, rows, row_groups):
    """`rows` weight rows per row group, for one token row (a decode step) and for three."""
    for t in (1, 3):
        rng = np.random.default_rng(k + sum(parts) + rows + t)
        op, out_buf, expected, tie = norm_linear_case(
            device, kernels, rng, parts, k, t, epilogue, with_weight, rows=rows, row_groups=row_groups, verify_rows=rows
        )
        recorder = device.begin()
        op.record_fused(recorder, t)
        recorder.submit()
        got = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
        check_norm_linear(got, expected, tie, f"{t} row(s)")


@pytest.mark.parametrize("t", [1, 5])
def test_norm_linear_record_matches_numpy(device, kernels, t):
    """record() runs the fused kernel for one token and norm + GEMM for several."""
    rng = np.random.default_rng(70 + t)
    op, out_buf, expected, tie = norm_linear_case(device, kernels, rng, [80, 80], 384, t, "gate_silu")
    run(device, (op, (t,), {}))
    got = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
    check_norm_linear(got, expected, tie)


@pytest.mark.parametrize("variant", ["no-subgroups", "no-dot4"])
def test_norm_linear_fallbacks(device, variant):
    kernels = KernelCache(device)
    with without_subgroups(device, variant == "no-subgroups"):
        rng = np.random.default_rng(80)
        op, out_buf, expected, tie = norm_linear_case(
            device, kernels, rng, [40, 40], 2560, 2, "gate_relu2", use_dot4=variant != "no-dot4", row_groups=2
        )
    recorder = device.begin()
    op.record_fused(recorder, 2)
    recorder.submit()
    got = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
    check_norm_linear(got, expected, tie)


# Several rows at once (speculative verify steps: every small-T path of NormTernaryLinear) ---------------


@pytest.mark.parametrize(
    "parts,k,epilogue,t,mean_width",
    [
        ([200], 640, "residual", 9, 600),
        ([64, 64], 6912, "gate_silu", 5, 6900),
        ([96, 96], 384, "gate_relu2", 2, None),
    ],
)
def test_norm_linear_verify_rows_match_numpy(device, kernels, parts, k, epilogue, t, mean_width):
    """2..SMALL_T_MAX rows, inputs zero-padded past the true width as model/layout.py pads them."""
    rng = np.random.default_rng(90 + k + t)
    kwargs = {"mean_width": mean_width} if mean_width else {}
    op, out_buf, expected, tie = norm_linear_case(device, kernels, rng, parts, k, t, epilogue, **kwargs)
    assert 2 <= t <= op.small_max <= SMALL_T_MAX  # what record() sends to a small-T path on a GPU
    prior = read(device, out_buf, np.float32, expected.size)
    for record in (op.record_fused, op.record_split, op.record_rows):
        device.upload(out_buf, 0, prior)  # the residual epilogue adds to it
        recorder = device.begin()
        record(recorder, t)
        recorder.submit()
        got = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
        check_norm_linear(got, expected, tie, record.__name__)


@pytest.mark.parametrize("epilogue", ["residual", "gate_relu2"])
def test_norm_linear_verify_rows_past_n_tokens_are_skipped(device, kernels, epilogue):
    """A verify step dispatches k + 1 rows and its draft kernel sets StepParams.n_tokens to the rows its
    draft fills (0 past the reply's end): the fused and split paths compute rows below n_tokens as before
    and leave the others alone."""
    rng = np.random.default_rng(95)
    t = 6
    op, out_buf, expected, tie = norm_linear_case(device, kernels, rng, [96, 96], 384, t, epilogue)
    prior = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
    for record in (op.record_fused, op.record_split):
        for n_tokens in (0, 1, 4, t):
            device.upload(out_buf, 0, prior)
            op.step.write(n_tokens, 0, 0)
            recorder = device.begin()
            record(recorder, t)
            recorder.submit()
            got = read(device, out_buf, np.float32, expected.size).reshape(expected.shape)
            name = f"{record.__name__}, n_tokens {n_tokens}"
            if n_tokens:
                check_norm_linear(got[:n_tokens], expected[:n_tokens], tie[:n_tokens], name)
            assert np.array_equal(got[n_tokens:], prior[n_tokens:]), name


@pytest.mark.parametrize(
    "parts,k,epilogue,with_weight,row_groups,mean_width",
    [
        ([96, 96], 384, "gate_relu2", True, 4, None),
        ([200], 2560, "residual", True, 2, 2500),
        ([64, 64], 6912, "gate_silu", True, 2, None),
        ([72], 384, "store", False, 1, None),
    ],
)
def test_norm_linear_split_rows_equal_fused_rows_bit_for_bit(
    device, kernels, parts, k, epilogue, with_weight, row_groups, mean_width
):
    """The split small-T path (the fused kernel's norm and quantization alone, then the decode GEMV)
    must give every row exactly the fused kernel's floats: a verify row equals its decode step only so
    (RMSNormQuant's norm, the same math in another order, fails this)."""
    t = 5
    rng = np.random.default_rng(k + row_groups)
    kwargs = {"mean_width": mean_width} if mean_width else {}
    op, out_buf, expected, _ = norm_linear_case(
        device, kernels, rng, parts, k, t, epilogue, with_weight, row_groups=row_groups, **kwargs
    )
    prior = read(device, out_buf, np.float32, expected.size)
    results = []
    for record in (op.record_fused, op.record_split):
        device.upload(out_buf, 0, prior)
        op.step.write(t, 0, 0)
        recorder = device.begin()
        record(recorder, t)
        recorder.submit()
        results.append(read(device, out_buf, np.float32, expected.size))
    assert np.array_equal(results[0], results[1]), np.flatnonzero(results[0] != results[1])[:8]


def test_auto_small_t_path_follows_the_backend(device, kernels, monkeypatch):
    """ "auto" takes the split path (two dispatches: the norm, then the GEMV) once the rows a verify step
    is expected to keep reach SPLIT_MIN_LIVE_ROWS of the device's backend: from 4 rows natively, from 7
    in a browser, whose every dispatch costs the page more; below that the fused kernel (one)."""
    from types import SimpleNamespace  # noqa: PLC0415

    from bitnet_web.kernels import linear as linear_module  # noqa: PLC0415

    monkeypatch.setattr(linear_module, "SPLIT_MIN_WEIGHTS", 0)  # this small matrix splits as 2B-4T's do
    op, *_ = norm_linear_case(device, kernels, np.random.default_rng(12), [96, 96], 384, 9, "gate_relu2")
    op.fuse_decode = True  # as on a GPU (lavapipe is a CPU adapter)
    op.step.write(9, 0, 0)
    assert op.split_min_live == linear_module.split_min_live_rows(device) == 3.8
    for backend, split_from in (("wgpu-native", 4), ("browser", 7)):
        op.split_min_live = linear_module.split_min_live_rows(SimpleNamespace(backend=backend))
        chosen = []
        for live in range(1, 10):
            recorder = device.begin()
            op.record(recorder, 9, live_rows=live)
            recorder.submit()
            chosen.append(recorder.dispatches)
        assert chosen == [1] * (split_from - 1) + [2] * (10 - split_from), backend


def test_row_groups_follow_the_row_length():
    """One thread per 16-byte chunk of a weight row, in whole subgroups of 32: rows of up to 2048
    values (the bundled model's 512 and 1536) take 32 threads in 4 row groups, longer ones (2B-4T's
    2560 and 6912) at least 64 in 2 (4 for matrices of 8192 rows or more), as measured."""
    assert [norm_gemv_group_threads(k) for k in (128, 512, 1536, 2048)] == [32] * 4
    assert [norm_gemv_group_threads(k) for k in (2112, 2560, 4096, 6912)] == [64, 64, 64, 128]
    assert norm_gemv_row_groups(1536, 32) == norm_gemv_row_groups(100, 32) == 4
    assert (norm_gemv_row_groups(3840), norm_gemv_row_groups(13824), norm_gemv_row_groups(2560, 128)) == (2, 4, 2)


def test_fused_gemv_rows_follow_the_matrix_size():
    """Small matrices take fewer weight rows per group (more workgroups): the 2B-4T qkv (3840 x 2560)
    and wo take 8, gate_up (13824 x 2560) and down (2560 x 6912) 16, for decode and verify rows alike, as
    measured (docs/performance.md, sessions 13 and 27); the boundary is inclusive."""
    assert norm_gemv_rows(3840, 2560) == norm_gemv_rows(2560, 2560) == NORM_GEMV_ROWS
    assert norm_gemv_rows(13824, 2560) == norm_gemv_rows(2560, 6912) == NORM_GEMV_LARGE_ROWS
    assert norm_gemv_rows(NORM_GEMV_SMALL_WEIGHTS // 1000, 1000) == NORM_GEMV_ROWS
    assert norm_gemv_rows(NORM_GEMV_SMALL_WEIGHTS // 1000 + 1, 1000) == NORM_GEMV_LARGE_ROWS
