"""I2_S / TQ1_0 / TQ2_0 / absmean against independent references.

I2_S: a scalar loop written straight from ground-truth.md. TQ1_0/TQ2_0: the PyPI `gguf` package's
numpy port of ggml-quants.c. Absmean: transformers' WeightQuant formula in torch.
"""

import numpy as np
import pytest

from bitnet_web.formats.ggml import GGMLType, GGUFError, GGUFFormatError
from bitnet_web.formats.quants import (
    CODECS,
    i2s_arm_to_x86,
    i2s_check_layout,
    i2s_decode,
    i2s_decode_arm,
    i2s_encode,
    i2s_nbytes,
    random_i2s_bytes,
    ternarize,
    tq1_0_encode,
    tq2_0_decode,
    tq2_0_encode,
)

CODE_TO_VALUE = {0: -1, 1: 0, 2: 1}  # ground truth: 0 = -1, 1 = 0, 2 = +1


def reference_i2s_decode(raw: bytes, n: int) -> tuple[list[int], float]:
    """Ground truth, literally: byte b of a 32-byte block holds values b, 32+b, 64+b, 96+b at
    shifts 6, 4, 2, 0; the float32 scale sits at byte n/4."""
    out = [None] * n
    for block in range(n // 128):
        for b in range(32):
            byte = raw[block * 32 + b]
            for g, shift in enumerate((6, 4, 2, 0)):
                out[block * 128 + g * 32 + b] = CODE_TO_VALUE[(byte >> shift) & 3]
    scale = float(np.frombuffer(bytes(raw[n // 4 : n // 4 + 4]), dtype="<f4")[0])
    return out, scale


def random_ternary(rng, shape):
    return rng.integers(-1, 2, size=shape).astype(np.int8)


def test_i2s_nbytes_is_quarter_plus_32():
    assert i2s_nbytes(2560 * 6912) == 2560 * 6912 // 4 + 32
    assert i2s_nbytes(128) == 64


@pytest.mark.parametrize("shape", [(1, 128), (3, 256), (40, 384), (2, 3, 128)])
def test_i2s_decode_matches_ground_truth_loop(shape):
    rng = np.random.default_rng(1)
    n = int(np.prod(shape))
    raw = random_i2s_bytes(rng, n, 0.0123)
    values, scale = i2s_decode(raw, shape)
    ref_values, ref_scale = reference_i2s_decode(raw.tobytes(), n)
    assert values.shape == shape and values.dtype == np.int8
    assert values.reshape(-1).tolist() == ref_values
    assert scale == ref_scale == np.float32(0.0123)


def test_i2s_encode_layout_bytes():
    rng = np.random.default_rng(2)
    values = random_ternary(rng, (4, 256))
    raw = i2s_encode(values, 0.75)
    assert len(raw) == i2s_nbytes(values.size)
    ref_values, ref_scale = reference_i2s_decode(raw.tobytes(), values.size)
    assert ref_values == values.reshape(-1).tolist()
    assert ref_scale == 0.75
    assert not raw[values.size // 4 + 4 :].any(), "28 padding bytes after the scale must be zero"
    # Hand check of one byte: values b, 32+b, 64+b, 96+b = -1, 0, +1, -1 -> codes 0,1,2,0 -> 0b00_01_10_00
    v = np.zeros(128, dtype=np.int8)
    v[[5, 37, 69, 101]] = [-1, 0, 1, -1]
    assert i2s_encode(v, 1.0)[5] == 0b00011000


def test_i2s_roundtrip_random_shapes():
    rng = np.random.default_rng(3)
    for rows, cols in [(1, 128), (7, 384), (64, 1280)]:
        values = random_ternary(rng, (rows, cols))
        scale = float(rng.uniform(0.01, 3))
        out, s = i2s_decode(i2s_encode(values, scale), (rows, cols))
        np.testing.assert_array_equal(out, values)
        assert s == np.float32(scale)


def test_i2s_code3_rejected_with_offset():
    raw = i2s_encode(np.zeros(256, dtype=np.int8), 1.0)
    raw[40] |= 0b00001100  # second-lowest field of byte 40 -> code 3
    with pytest.raises(GGUFFormatError, match=r"code 3 at byte \+40"):
        i2s_decode(raw, (2, 128), where="tensor 'w'")
    with pytest.raises(GGUFError, match="code 3"):
        i2s_check_layout(raw, (2, 128))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0])
def test_i2s_bad_scale_rejected(bad):
    raw = i2s_encode(np.ones(128, dtype=np.int8), 1.0)
    raw[32:36] = np.array([bad], dtype="<f4").view(np.uint8)
    with pytest.raises(GGUFFormatError, match=r"scale at byte \+32"):
        i2s_decode(raw, (128,), where="tensor 'blk.0.attn_q.weight' at byte offset 4096")


def test_i2s_partial_block_and_short_buffer_rejected():
    with pytest.raises(GGUFFormatError, match="multiple of the I2_S block"):
        i2s_decode(np.zeros(64, dtype=np.uint8), (1, 64))
    with pytest.raises(GGUFFormatError, match="too short"):
        i2s_decode(np.zeros(33, dtype=np.uint8), (1, 128))


def test_i2s_check_layout_nonzero_padding():
    raw = i2s_encode(np.ones(128, dtype=np.int8), 1.0)
    assert i2s_check_layout(raw, (1, 128)) == 1.0
    raw[40] = 1
    with pytest.raises(GGUFFormatError, match="padding"):
        i2s_check_layout(raw, (1, 128))


def reference_arm_decode(raw: bytes, n: int) -> list[int]:
    """ARM NEON layout: blocks of 64 values in 16 bytes, byte b holds b, 16+b, 32+b, 48+b."""
    out = [None] * n
    for block in range(n // 64):
        for b in range(16):
            byte = raw[block * 16 + b]
            for g, shift in enumerate((6, 4, 2, 0)):
                out[block * 64 + g * 16 + b] = CODE_TO_VALUE[(byte >> shift) & 3]
    return out


def test_arm_layout_encode_decode_and_repack():
    rng = np.random.default_rng(4)
    values = random_ternary(rng, (6, 256))
    arm = i2s_encode(values, 0.5, layout="arm")
    assert reference_arm_decode(arm.tobytes(), values.size) == values.reshape(-1).tolist()
    out, scale = i2s_decode_arm(arm, values.shape)
    np.testing.assert_array_equal(out, values)
    out2, _ = i2s_decode(arm, values.shape, layout="arm")
    np.testing.assert_array_equal(out2, values)
    x86 = i2s_arm_to_x86(arm, values.size)
    np.testing.assert_array_equal(x86, i2s_encode(values, 0.5))


def test_arm_bytes_read_as_x86_are_a_fixed_column_permutation():
    """Why the layout cannot be detected statistically (module docstring): the misread matrix is
    W[:, P] for one permutation P, the same for every row and every tensor."""
    rng = np.random.default_rng(5)
    perm = None
    for shape in [(8, 256), (3, 512)]:
        values = random_ternary(rng, shape)
        misread, _ = i2s_decode(i2s_encode(values, 1.0, layout="arm"), shape)
        assert not np.array_equal(misread, values)
        # P[j] = the true column that lands in column j: probe with one-hot rows
        P = np.empty(shape[1], dtype=np.int64)
        for c in range(shape[1]):
            one_hot = np.zeros((1, shape[1]), dtype=np.int8)
            one_hot[0, c] = 1
            got, _ = i2s_decode(i2s_encode(one_hot, 1.0, layout="arm"), one_hot.shape)
            P[int(np.argmax(got[0]))] = c
        np.testing.assert_array_equal(misread, values[:, P])
        # the same permutation inside every 128-column group and for every shape
        for start in range(0, shape[1], 128):
            np.testing.assert_array_equal(P[start : start + 128] - start, P[:128])
        perm = P[:128] if perm is None else perm
        np.testing.assert_array_equal(P[:128], perm)
        # per-row statistics are identical, so no row-level test can tell the layouts apart
        np.testing.assert_array_equal(np.sort(misread, axis=1), np.sort(values, axis=1))


def test_random_i2s_bytes_uniform_codes():
    raw = random_i2s_bytes(np.random.default_rng(6), 128 * 1000, 0.5)
    values, scale = i2s_decode(raw, (1000, 128))
    counts = np.bincount(values.reshape(-1) + 1, minlength=3) / values.size
    assert np.all(np.abs(counts - 1 / 3) < 0.01)
    assert scale == 0.5


def test_ternarize_matches_transformers_weight_quant():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for shape in [(64, 128), (256, 384)]:
        w = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        values, scale = ternarize(w)
        tw = torch.from_numpy(w)
        inv = 1.0 / tw.abs().mean().clamp_(min=1e-5)
        ref = (tw * inv).round().clamp(-1, 1)
        np.testing.assert_array_equal(values, ref.numpy().astype(np.int8))
        assert scale == pytest.approx(float(tw.abs().mean()), rel=1e-6)
    values, scale = ternarize(np.zeros((4, 4), np.float32))
    assert scale == 1e-5 and not values.any()


# --- TQ1_0 / TQ2_0 against the gguf package (numpy port of ggml-quants.c) ---------------------


def _gguf_quants():
    gguf = pytest.importorskip("gguf")
    return gguf.quants, gguf.GGMLQuantizationType


@pytest.mark.parametrize("kind", ["TQ1_0", "TQ2_0", "Q8_0", "F16", "BF16", "F32"])
@pytest.mark.parametrize("data", ["ternary", "float"])
def test_codec_table_matches_gguf_package(kind, data):
    """Every codec gguf-py also knows: sizes, encode and decode byte for byte / value for value."""
    gq, qt = _gguf_quants()
    import gguf

    rng = np.random.default_rng(8)
    shape = (4, 512)
    if data == "ternary":
        w = random_ternary(rng, shape).astype(np.float32) * np.float32(0.037)
        w[0, :256] = 0  # an all-zero block (d = 0)
    else:
        w = rng.standard_normal(shape).astype(np.float32)
    codec = CODECS[GGMLType[kind]]
    assert tuple(codec.size[:2]) == gguf.GGML_QUANT_SIZES[getattr(qt, kind)]
    ours = codec.encode(w)
    ref = gq.quantize(w, getattr(qt, kind))
    np.testing.assert_array_equal(ours, ref.reshape(-1).view(np.uint8))
    np.testing.assert_array_equal(codec.decode(ours, shape), gq.dequantize(ref, getattr(qt, kind)))


def test_tq2_0_decode_hand_built_block():
    # one block: value j*128 + l*32 + m from (qs[j*32+m] >> 2l) & 3, minus 1, times d
    qs = np.zeros(64, dtype=np.uint8)
    qs[3] = 0b10_01_00_10  # values 3 (l=0): +1, 35 (l=1): -1, 67 (l=2): 0, 99 (l=3): +1
    qs[32] = 0b00_00_00_00  # value 128: -1, 160, 192, 224: -1
    raw = np.concatenate([qs, np.array([2.0], dtype="<f2").view(np.uint8)])
    out = tq2_0_decode(raw, (256,))
    assert out[3] == 2.0 and out[35] == -2.0 and out[67] == 0.0 and out[99] == 2.0
    assert out[128] == out[160] == out[192] == out[224] == -2.0


@pytest.mark.parametrize("kind,encode", [(GGMLType.TQ1_0, tq1_0_encode), (GGMLType.TQ2_0, tq2_0_encode)])
def test_tq_ternary_recovers_values_and_scale(kind, encode):
    rng = np.random.default_rng(9)
    values = random_ternary(rng, (3, 768))
    values[1, 256:512] = 0  # an all-zero block carries d = 0: ignored
    scale = 0.0421
    raw = encode(values.astype(np.float32) * np.float32(scale))
    out, s = CODECS[kind].ternary(raw, values.shape)
    np.testing.assert_array_equal(out, values)
    assert s == float(np.float16(scale))


def test_tq_ternary_rejects_differing_block_scales():
    rng = np.random.default_rng(10)
    w = random_ternary(rng, (2, 256)).astype(np.float32)
    w[1] *= 2.0  # second block twice the scale
    with pytest.raises(GGUFFormatError, match="block scales range"):
        CODECS[GGMLType.TQ2_0].ternary(tq2_0_encode(w), w.shape, where="tensor 'x'")


def test_tq2_0_code3_rejected_by_ternary():
    raw = tq2_0_encode(np.ones(256, np.float32))
    raw[0] |= 3
    with pytest.raises(GGUFFormatError, match="code 3"):
        CODECS[GGMLType.TQ2_0].ternary(raw, (256,))
