"""RoPE + KV cache + attention kernels against numpy references (runs on lavapipe or any adapter)."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web import gpu  # noqa: E402
from bitnet_web.kernels.attention import MAX_SPLITS, Attention, AttentionScratch, tile_rows  # noqa: E402
from bitnet_web.kernels.common import StepParams  # noqa: E402
from bitnet_web.kernels.kv_cache import KVCache, KVCacheFullError  # noqa: E402
from bitnet_web.kernels.rope import RopeKV, RopeTable  # noqa: E402

pytestmark = pytest.mark.gpu


# --- numpy references ---------------------------------------------------------------------------------


def ref_rope(x: np.ndarray, positions: np.ndarray, rope_dim: int, theta: float, style: str) -> np.ndarray:
    """x [T, H, D] float -> rotated copy, float64 angles (the test's own formula, not the module's)."""
    x = x.astype(np.float64)
    half = rope_dim // 2
    inv_freq = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rope_dim)
    angle = positions.astype(np.float64)[:, None, None] * inv_freq[None, None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    if style == "neox":
        a, b = x[..., :half], x[..., half:rope_dim]
        out[..., :half] = a * cos - b * sin
        out[..., half:rope_dim] = b * cos + a * sin
    else:
        a, b = x[..., 0:rope_dim:2], x[..., 1:rope_dim:2]
        out[..., 0:rope_dim:2] = a * cos - b * sin
        out[..., 1:rope_dim:2] = b * cos + a * sin
    return out


def ref_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, pos: int) -> np.ndarray:
    """q [T, Hq, D], k/v [>= pos+T, Hkv, D] -> [T, Hq, D]; token t sees rows 0..pos+t."""
    n_tokens, n_heads, head_dim = q.shape
    group = n_heads // k.shape[1]
    out = np.zeros(q.shape, dtype=np.float64)
    for t in range(n_tokens):
        rows = pos + t + 1
        for h in range(n_heads):
            kh, vh = k[:rows, h // group].astype(np.float64), v[:rows, h // group].astype(np.float64)
            scores = kh @ q[t, h].astype(np.float64) / np.sqrt(head_dim)
            p = np.exp(scores - scores.max())
            out[t, h] = p @ vh / p.sum()
    return out


# --- helpers ------------------------------------------------------------------------------------------


def read_f32(device, buffer, count: int, offset: int = 0) -> np.ndarray:
    return device.read_sync(buffer, offset * 4, count * 4).view(np.float32)


def f32_buffer(device, array: np.ndarray | None, n_floats: int, label: str):
    buffer = device.buffer(n_floats * 4, gpu.STORAGE_USAGE, label)
    if array is not None:
        device.upload(buffer, 0, np.ascontiguousarray(array, dtype=np.float32))
    return buffer


class Layer:
    """One layer's buffers and ops, as model.py will wire them."""

    def __init__(
        self,
        device,
        kernels,
        *,
        n_heads,
        n_kv_heads,
        head_dim,
        max_tokens,
        max_context,
        rope_dim=None,
        theta=10000.0,
        style="neox",
        initial_capacity=256,
        n_layers=1,
        fused=False,
    ):
        self.device = device
        self.params = StepParams(device)
        self.cache = KVCache(device, n_layers, n_kv_heads, head_dim, max_context, initial_capacity)
        self.table = RopeTable(device, rope_dim or head_dim, theta, max_context)
        width = (n_heads + 2 * n_kv_heads) * head_dim
        self.qkv = f32_buffer(device, None, max_tokens * width, "qkv")
        self.q = f32_buffer(device, None, max_tokens * n_heads * head_dim, "q")
        self.out = f32_buffer(device, None, max_tokens * n_heads * head_dim, "attn out")
        self.rope = RopeKV(
            kernels,
            self.params,
            self.cache,
            0,
            self.table,
            self.qkv,
            self.q,
            n_heads=n_heads,
            style=style,
            max_tokens=max_tokens,
        )
        self.fused = fused
        self.attention = Attention(
            kernels,
            self.params,
            self.cache,
            0,
            self.q,
            self.out,
            n_heads=n_heads,
            max_tokens=max_tokens,
            rope=self.rope if fused else None,
        )

    def step(self, qkv: np.ndarray, pos: int, *, run_attention=True, pass_pos=True) -> None:
        """One model step: RoPE + KV append + attention (with `fused`, all recorded by Attention)."""
        n_tokens = qkv.shape[0]
        self.cache.ensure_capacity(pos + n_tokens)
        self.params.write(n_tokens, pos, self.cache.capacity)
        self.device.upload(self.qkv, 0, qkv.astype(np.float32))
        recorder = self.device.begin()
        if not self.fused:
            self.rope.record(recorder, n_tokens)
        if run_attention:
            self.attention.record(recorder, n_tokens, pos if pass_pos else None)
        recorder.submit()


def split_qkv(qkv, n_heads, n_kv_heads, head_dim):
    n_tokens = qkv.shape[0]
    q = qkv[:, : n_heads * head_dim].reshape(n_tokens, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv_heads) * head_dim].reshape(n_tokens, n_kv_heads, head_dim)
    v = qkv[:, (n_heads + n_kv_heads) * head_dim :].reshape(n_tokens, n_kv_heads, head_dim)
    return q, k, v


# --- RoPE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("head_dim, rope_dim", [(64, 64), (128, 128), (64, 32)])
@pytest.mark.parametrize("pos", [0, 3995])
def test_rope_kv_matches_reference(device, kernels, style, head_dim, rope_dim, pos):
    n_heads, n_kv_heads, n_tokens, theta = 4, 2, 5, 500000.0
    rng = np.random.default_rng(head_dim + rope_dim + pos)
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=8,
        max_context=4000,
        rope_dim=rope_dim,
        theta=theta,
        style=style,
        initial_capacity=16,
    )
    qkv = rng.standard_normal((n_tokens, (n_heads + 2 * n_kv_heads) * head_dim)).astype(np.float32)
    layer.step(qkv, pos, run_attention=False)

    q, k, v = split_qkv(qkv, n_heads, n_kv_heads, head_dim)
    positions = np.arange(pos, pos + n_tokens)
    # f32 angles differ from float64 ones by ~position * 6e-8 rad.
    atol = 2e-6 + 1.5e-7 * (pos + n_tokens)
    got_q = read_f32(device, layer.q, q.size).reshape(q.shape)
    np.testing.assert_allclose(got_q, ref_rope(q, positions, rope_dim, theta, style), atol=atol, rtol=1e-5)
    row = head_dim * n_kv_heads
    got_k = read_f32(device, layer.cache.k[0], n_tokens * row, pos * row).reshape(k.shape)
    got_v = read_f32(device, layer.cache.v[0], n_tokens * row, pos * row).reshape(v.shape)
    np.testing.assert_allclose(got_k, ref_rope(k, positions, rope_dim, theta, style), atol=atol, rtol=1e-5)
    np.testing.assert_array_equal(got_v, v)
    if rope_dim < head_dim:  # the unrotated tail is copied bit for bit
        np.testing.assert_array_equal(got_q[..., rope_dim:], q[..., rope_dim:])


def test_rope_styles_differ(device, kernels):
    """Guards against both styles silently compiling to the same pairing."""
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((1, 3 * 64)).astype(np.float32)
    outs = []
    for style in ("neox", "interleaved"):
        layer = Layer(device, kernels, n_heads=1, n_kv_heads=1, head_dim=64, max_tokens=1, max_context=64, style=style)
        layer.step(qkv, 9, run_attention=False)
        outs.append(read_f32(device, layer.q, 64))
    assert np.abs(outs[0] - outs[1]).max() > 0.1


# --- attention --------------------------------------------------------------------------------------------

GQA_SHAPES = [  # (n_heads, n_kv_heads, head_dim): query heads per KV head 1, 2, 4, 5
    (4, 4, 64),
    (4, 2, 128),
    (8, 2, 64),
    (10, 2, 64),
    (10, 2, 128),
]


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", GQA_SHAPES)
@pytest.mark.parametrize("n_tokens", [1, 5, 33])
@pytest.mark.parametrize("pos", [0, 7, 300])
def test_attention_matches_reference(device, kernels, n_heads, n_kv_heads, head_dim, n_tokens, pos):
    rng = np.random.default_rng(n_heads * 1000 + n_tokens * 10 + pos)
    rows = pos + n_tokens
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=33,
        max_context=512,
        initial_capacity=rows,
    )
    k = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32) * 2.0
    v = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    device.upload(layer.cache.k[0], 0, k)
    device.upload(layer.cache.v[0], 0, v)
    device.upload(layer.q, 0, q)
    layer.params.write(n_tokens, pos, layer.cache.capacity)
    recorder = device.begin()
    layer.attention.record(recorder, n_tokens, pos)
    recorder.submit()
    got = read_f32(device, layer.out, q.size).reshape(q.shape)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(4, 4, 64), (10, 2, 64), (8, 2, 128)])
@pytest.mark.parametrize("config", [(None, 4), (16, 2), (16, 8), (32, 2), "legacy"])
def test_prefill_attention_variants_match_reference(device, kernels, n_heads, n_kv_heads, head_dim, config):
    """Both prefill kernels (attention_prefill.wgsl with several query-row / rows-per-thread choices, and
    attention.wgsl's): 70 tokens at pos 45 span several token blocks and partial 32-key tiles."""
    n_tokens, pos = 70, 45
    rng = np.random.default_rng(n_heads + head_dim + len(str(config)))
    rows = pos + n_tokens
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=n_tokens,
        max_context=256,
        initial_capacity=rows,
    )
    options = (
        {"tiled_prefill": False}
        if config == "legacy"
        else {"prefill_query_rows": config[0], "prefill_rows_per_thread": config[1]}
    )
    attention = Attention(
        kernels, layer.params, layer.cache, 0, layer.q, layer.out, n_heads=n_heads, max_tokens=n_tokens, **options
    )
    if (
        config != "legacy"
        and config[0] == 32
        and head_dim == 128
        and device.limits.max_compute_workgroup_storage_size < 37888
    ):
        pytest.skip("32 query rows of head_dim 128 need 37888 bytes of workgroup memory")
    assert (attention.tiled is None) == (config == "legacy")
    k = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32) * 2.0
    v = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32)
    for buffer, array in ((layer.cache.k[0], k), (layer.cache.v[0], v), (layer.q, q)):
        device.upload(buffer, 0, array)
    device.upload(layer.out, 0, np.full(q.size, np.nan, dtype=np.float32))  # every row must be written
    layer.params.write(n_tokens, pos, layer.cache.capacity)
    recorder = device.begin()
    attention.record(recorder, n_tokens, pos)
    recorder.submit()
    got = read_f32(device, layer.out, q.size).reshape(q.shape)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)


def test_attention_sharp_scores_stay_finite(device, kernels):
    """Large logits: the online softmax must subtract the running max (a naive exp overflows)."""
    n_heads, n_kv_heads, head_dim, n_tokens, pos = 2, 1, 64, 3, 90
    rng = np.random.default_rng(5)
    rows = pos + n_tokens
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=4,
        max_context=128,
        initial_capacity=128,
    )
    k = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32) * 12.0
    v = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32)
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32) * 12.0
    for buffer, array in ((layer.cache.k[0], k), (layer.cache.v[0], v), (layer.q, q)):
        device.upload(buffer, 0, array)
    for t_count in (n_tokens, 1):  # prefill path, then the split decode path
        layer.params.write(t_count, pos, layer.cache.capacity)
        recorder = device.begin()
        layer.attention.record(recorder, t_count, pos)
        recorder.submit()
        got = read_f32(device, layer.out, t_count * n_heads * head_dim).reshape(t_count, n_heads, head_dim)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref_attention(q[:t_count], k, v, pos), atol=1e-4, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("pass_pos", [True, False])
def test_long_context_decode_split(device, kernels, pass_pos):
    """2B-4T shapes (20 query heads, 5 KV heads, head_dim 128) at position ~2000: more tiles than splits,
    so each split workgroup walks two tiles, then the combine merges 63 partials.

    Without `pos` the dispatch covers the whole capacity and the surplus workgroups must not matter.
    """
    n_heads, n_kv_heads, head_dim, pos = 20, 5, 128, 2011
    rng = np.random.default_rng(2011)
    rows = pos + 1
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=1,
        max_context=4096,
        initial_capacity=4096,
    )
    k = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32)
    # Make a few distant rows dominate some heads, so every tile's partial matters in the combine.
    q = rng.standard_normal((1, n_heads, head_dim)).astype(np.float32)
    for row in (3, 700, 1999):
        k[row, 1] = q[0, 5] * 0.4
    device.upload(layer.cache.k[0], 0, k)
    device.upload(layer.cache.v[0], 0, v)
    device.upload(layer.q, 0, q)
    layer.params.write(1, pos, layer.cache.capacity)
    recorder = device.begin()
    layer.attention.record(recorder, 1, pos if pass_pos else None)
    recorder.submit()
    got = read_f32(device, layer.out, q.size).reshape(q.shape)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)
    assert -(-rows // tile_rows(head_dim)) > MAX_SPLITS


@pytest.mark.slow
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("pass_pos", [True, False])
def test_long_context_decode_with_fused_rope(device, kernels, style, pass_pos):
    """The fused decode kernel at position ~2000 (split path): rotates q on load, appends the rotated
    k and plain v of row pos to the cache, and attends over the 2011 earlier rows plus that one."""
    n_heads, n_kv_heads, head_dim, pos, theta = 20, 5, 128, 2011, 500000.0
    rng = np.random.default_rng(11)
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=1,
        max_context=4096,
        theta=theta,
        style=style,
        initial_capacity=4096,
        fused=True,
    )
    k = rng.standard_normal((pos + 1, n_kv_heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((pos + 1, n_kv_heads, head_dim)).astype(np.float32)
    device.upload(layer.cache.k[0], 0, k[:pos])
    device.upload(layer.cache.v[0], 0, v[:pos])
    qkv = rng.standard_normal((1, (n_heads + 2 * n_kv_heads) * head_dim)).astype(np.float32)
    q_new, k_new, v_new = split_qkv(qkv, n_heads, n_kv_heads, head_dim)
    k[pos] = ref_rope(k_new, np.array([pos]), head_dim, theta, style)[0]
    v[pos] = v_new[0]
    layer.step(qkv, pos, pass_pos=pass_pos)
    q_rot = ref_rope(q_new, np.array([pos]), head_dim, theta, style)
    got = read_f32(device, layer.out, n_heads * head_dim).reshape(1, n_heads, head_dim)
    np.testing.assert_allclose(got, ref_attention(q_rot, k, v, pos), atol=5e-5, rtol=1e-3)
    row = n_kv_heads * head_dim
    got_k = read_f32(device, layer.cache.k[0], row, pos * row).reshape(n_kv_heads, head_dim)
    np.testing.assert_allclose(got_k, k[pos], atol=5e-4, rtol=1e-4)  # f32 table vs float64 angles
    np.testing.assert_array_equal(
        read_f32(device, layer.cache.v[0], row, pos * row).reshape(n_kv_heads, head_dim), v[pos]
    )


# --- the chain and the cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("style, rope_dim", [("neox", 64), ("interleaved", 64), ("neox", 32)])
def test_prefill_then_decode_with_cache_growth(device, kernels, style, rope_dim, fused):
    """RopeKV + Attention in one recorder (or RoPE fused into the decode kernel): a 13-token prefill,
    then decode steps that grow the cache from 16 rows through 32 to 64; the rows written before each
    growth must survive the copy, and the rebound ops must use the new buffers."""
    n_heads, n_kv_heads, head_dim, theta = 4, 2, 64, 10000.0
    rng = np.random.default_rng(7)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    layer = Layer(
        device,
        kernels,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        max_tokens=13,
        max_context=100,
        rope_dim=rope_dim,
        theta=theta,
        style=style,
        initial_capacity=16,
        fused=fused,
    )
    all_qkv = rng.standard_normal((40, width)).astype(np.float32)
    q, k, v = split_qkv(all_qkv, n_heads, n_kv_heads, head_dim)
    positions = np.arange(40)
    q_rot = ref_rope(q, positions, rope_dim, theta, style)
    k_rot = ref_rope(k, positions, rope_dim, theta, style)

    layer.step(all_qkv[:13], 0)
    got = read_f32(device, layer.out, 13 * n_heads * head_dim).reshape(13, n_heads, head_dim)
    np.testing.assert_allclose(got, ref_attention(q_rot[:13], k_rot, v, 0), atol=3e-5, rtol=1e-4)

    capacities = set()
    for p in range(13, 40):
        layer.step(all_qkv[p : p + 1], p, pass_pos=p % 2 == 0)
        capacities.add(layer.cache.capacity)
        got = read_f32(device, layer.out, n_heads * head_dim).reshape(1, n_heads, head_dim)
        np.testing.assert_allclose(
            got, ref_attention(q_rot[p : p + 1], k_rot, v, p), atol=3e-5, rtol=1e-4, err_msg=f"decode at position {p}"
        )
    assert capacities == {16, 32, 64}
    assert layer.attention.fused_rope == fused
    row = n_kv_heads * head_dim
    np.testing.assert_allclose(
        read_f32(device, layer.cache.k[0], 40 * row).reshape(40, n_kv_heads, head_dim), k_rot, atol=1e-5, rtol=1e-5
    )


def test_cache_growth_stops_at_context_length(device):
    cache = KVCache(device, n_layers=2, n_kv_heads=1, head_dim=32, max_context=40, initial_capacity=16)
    assert cache.ensure_capacity(33)
    assert cache.capacity == 40  # doubling capped at the context length
    assert not cache.ensure_capacity(40)
    with pytest.raises(KVCacheFullError, match="41 tokens exceed the model's context length of 40"):
        cache.ensure_capacity(41)


# --- bad shapes -------------------------------------------------------------------------------------------


def test_bad_shapes_are_refused(device, kernels):
    params = StepParams(device)
    cache = KVCache(device, 1, 2, 96, 64)
    buf = f32_buffer(device, None, 4 * 8 * 96 * 2, "buf")
    with pytest.raises(ValueError, match="head_dim 96 is not supported"):
        Attention(kernels, params, cache, 0, buf, buf, n_heads=4, max_tokens=4)
    cache = KVCache(device, 1, 2, 64, 64)
    with pytest.raises(ValueError, match="n_heads 5 is not a multiple of n_kv_heads 2"):
        Attention(kernels, params, cache, 0, buf, buf, n_heads=5, max_tokens=1)
    with pytest.raises(ValueError, match="layer 3 is outside"):
        Attention(kernels, params, cache, 3, buf, buf, n_heads=4, max_tokens=1)
    small = f32_buffer(device, None, 16, "small q")
    with pytest.raises(ValueError, match="'small q' has 64 bytes"):
        Attention(kernels, params, cache, 0, small, buf, n_heads=4, max_tokens=1)
    table = RopeTable(device, 64, 10000.0, 64)
    with pytest.raises(ValueError, match="rope style must be one of"):
        RopeKV(kernels, params, cache, 0, table, buf, buf, n_heads=4, style="gptj", max_tokens=1)
    with pytest.raises(ValueError, match="rope table covers 32 positions"):
        RopeKV(
            kernels,
            params,
            cache,
            0,
            RopeTable(device, 64, 10000.0, 32),
            buf,
            buf,
            n_heads=4,
            style="neox",
            max_tokens=1,
        )
    with pytest.raises(ValueError, match="rope_dim 128 exceeds head_dim 64"):
        RopeKV(
            kernels,
            params,
            cache,
            0,
            RopeTable(device, 128, 10000.0, 64),
            buf,
            buf,
            n_heads=4,
            style="neox",
            max_tokens=1,
        )
    with pytest.raises(ValueError, match="made for other shapes"):
        Attention(
            kernels, params, cache, 0, buf, buf, n_heads=4, max_tokens=1, scratch=AttentionScratch(device, 8, 64, 64)
        )
