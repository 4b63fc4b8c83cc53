"""RoPE + KV cache + attention kernels against numpy references (runs on lavapipe or any adapter).

The cache stores f16 by default (float32 with dtype="f32"): the references attend over K/V rounded
the same way, so every path is held to float32 accumulation error; what the rounding itself costs
is measured on whole models in tests/test_kv_cache_accuracy.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web import gpu  # noqa: E402
from bitnet_web.kernels import attention as attention_module  # noqa: E402
from bitnet_web.kernels.attention import (  # noqa: E402
    DIRECT_MAX_TILES,
    LANES_CPU,
    LANES_GPU,
    MAX_SPLITS,
    SPLIT_CAP,
    SUPPORTED_HEAD_DIMS,
    WORKGROUP,
    Attention,
    AttentionScratch,
    lane_shape,
    max_query_heads_per_kv,
    split_count,
    tile_rows,
)
from bitnet_web.kernels.common import StepParams  # noqa: E402
from bitnet_web.kernels.kv_cache import KV_DTYPES, KVCache, KVCacheFullError, kv_bytes_per_token  # noqa: E402
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


def as_stored(x: np.ndarray, dtype: str) -> np.ndarray:
    """x as the cache holds it (rounded to f16 for dtype 'f16'), in float32."""
    return x.astype(KV_DTYPES[dtype]).astype(np.float32)


def read_f32(device, buffer, count: int, offset: int = 0) -> np.ndarray:
    return device.read_sync(buffer, offset * 4, count * 4).view(np.float32)


def f32_buffer(device, array: np.ndarray | None, n_floats: int, label: str):
    buffer = device.buffer(n_floats * 4, gpu.STORAGE_USAGE, label)
    if array is not None:
        device.upload(buffer, 0, np.ascontiguousarray(array, dtype=np.float32))
    return buffer


def split_qkv(qkv, n_heads, n_kv_heads, head_dim):
    n_tokens = qkv.shape[0]
    q = qkv[:, : n_heads * head_dim].reshape(n_tokens, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv_heads) * head_dim].reshape(n_tokens, n_kv_heads, head_dim)
    v = qkv[:, (n_heads + n_kv_heads) * head_dim :].reshape(n_tokens, n_kv_heads, head_dim)
    return q, k, v


class Layer:
    """One layer's buffers and ops, as model/forward.py wires them."""

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
        fused=False,
        dtype="f16",
        lanes=None,
    ):
        self.device = device
        self.n_heads = n_heads
        self.params = StepParams(device)
        self.cache = KVCache(device, 1, n_kv_heads, head_dim, max_context, initial_capacity, dtype=dtype)
        self.table = RopeTable(device, rope_dim or head_dim, theta, max_context)
        width = (n_heads + 2 * n_kv_heads) * head_dim
        self.qkv = f32_buffer(device, None, max_tokens * width, "qkv")
        self.q = f32_buffer(device, None, max_tokens * n_heads * head_dim, "q")
        self.out = f32_buffer(device, None, max_tokens * n_heads * head_dim, "attn out")
        self.rope = RopeKV(
            kernels, self.params, self.cache, 0, self.table, self.qkv, self.q, n_heads=n_heads, style=style,
            max_tokens=max_tokens,
        )  # fmt: skip
        self.fused = fused
        self.attention = self.make_attention(kernels, max_tokens, rope=self.rope if fused else None, lanes=lanes)

    def make_attention(self, kernels, max_tokens, **options) -> Attention:
        return Attention(
            kernels, self.params, self.cache, 0, self.q, self.out, n_heads=self.n_heads, max_tokens=max_tokens,
            **options,
        )  # fmt: skip

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

    def attend(self, q, k, v, pos: int, *, attention=None, pass_pos=True) -> np.ndarray:
        """Attention alone over cache rows k/v (uploaded in the cache's type) for queries q at `pos`;
        `out` is NaN-filled first, so every row must be written. Returns [T, n_heads, head_dim]."""
        self.cache.write_rows(0, 0, k, v)
        self.device.upload(self.q, 0, np.ascontiguousarray(q, dtype=np.float32))
        self.device.upload(self.out, 0, np.full(q.size, np.nan, dtype=np.float32))
        self.params.write(q.shape[0], pos, self.cache.capacity)
        recorder = self.device.begin()
        (attention or self.attention).record(recorder, q.shape[0], pos if pass_pos else None)
        recorder.submit()
        return read_f32(self.device, self.out, q.size).reshape(q.shape)

    def output(self, n_tokens: int) -> np.ndarray:
        return read_f32(self.device, self.out, n_tokens * self.n_heads * self.cache.head_dim).reshape(
            n_tokens, self.n_heads, self.cache.head_dim
        )

    def cache_rows(self, kind: str, first: int, n: int) -> np.ndarray:
        """Rows first..first+n-1 of the K ('k') or V ('v') cache as float32 [n, n_kv_heads, head_dim]."""
        cache = self.cache
        buffer = (cache.k if kind == "k" else cache.v)[0]
        raw = self.device.read_sync(buffer, first * cache.row_bytes, n * cache.row_bytes)
        return raw.view(cache.np_dtype).astype(np.float32).reshape(n, cache.n_kv_heads, cache.head_dim)


def random_qkv(rng, n_tokens, rows, n_heads, n_kv_heads, head_dim, dtype, k_scale=2.0, q_scale=1.0):
    """Queries [T, Hq, D] and cache rows K, V [rows, Hkv, D] (K, V as the cache stores them)."""
    k = as_stored(rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32) * k_scale, dtype)
    v = as_stored(rng.standard_normal((rows, n_kv_heads, head_dim)).astype(np.float32), dtype)
    q = rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32) * q_scale
    return q, k, v


# --- RoPE -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("head_dim, rope_dim", [(64, 64), (128, 128), (64, 32), (64, 20)])
@pytest.mark.parametrize("pos", [0, 3995])
def test_rope_kv_matches_reference(device, kernels, style, head_dim, rope_dim, pos, dtype):
    n_heads, n_kv_heads, n_tokens, theta = 4, 2, 5, 500000.0
    rng = np.random.default_rng(head_dim + rope_dim + pos)
    layer = Layer(
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=8, max_context=4000,
        rope_dim=rope_dim, theta=theta, style=style, initial_capacity=16, dtype=dtype,
    )  # fmt: skip
    qkv = rng.standard_normal((n_tokens, (n_heads + 2 * n_kv_heads) * head_dim)).astype(np.float32)
    layer.step(qkv, pos, run_attention=False)

    q, k, v = split_qkv(qkv, n_heads, n_kv_heads, head_dim)
    positions = np.arange(pos, pos + n_tokens)
    # f32 angles differ from float64 ones by ~position * 6e-8 rad; f16 rounds to 2^-11 relative.
    atol = 2e-6 + 1.5e-7 * (pos + n_tokens)
    k_rtol = 1e-5 if dtype == "f32" else 2.0**-10
    got_q = read_f32(device, layer.q, q.size).reshape(q.shape)
    np.testing.assert_allclose(got_q, ref_rope(q, positions, rope_dim, theta, style), atol=atol, rtol=1e-5)
    got_k = layer.cache_rows("k", pos, n_tokens)
    np.testing.assert_allclose(got_k, ref_rope(k, positions, rope_dim, theta, style), atol=atol, rtol=k_rtol)
    np.testing.assert_array_equal(layer.cache_rows("v", pos, n_tokens), as_stored(v, dtype))
    if rope_dim < head_dim:  # the unrotated tail is copied bit for bit
        np.testing.assert_array_equal(got_q[..., rope_dim:], q[..., rope_dim:])
        np.testing.assert_array_equal(got_k[..., rope_dim:], as_stored(k[..., rope_dim:], dtype))


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
    (4, 2, 256),  # the widest supported head: 8-row tiles, 20 KB of workgroup memory
]
# Every path over the f16 cache (decode split / direct, prefill split for few tokens, tiled prefill),
# and the float32 cache on a few of them.
ATTENTION_CASES = [
    (*shape, n_tokens, pos, "f16") for shape in GQA_SHAPES for n_tokens in (1, 5, 33) for pos in (0, 7, 300)
] + [(4, 2, 128, n_tokens, pos, "f32") for n_tokens, pos in ((1, 300), (5, 7), (33, 300))]


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, n_tokens, pos, dtype", ATTENTION_CASES)
def test_attention_matches_reference(device, kernels, n_heads, n_kv_heads, head_dim, n_tokens, pos, dtype):
    rng = np.random.default_rng(n_heads * 1000 + n_tokens * 10 + pos)
    rows = pos + n_tokens
    layer = Layer(
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=33, max_context=512,
        initial_capacity=rows, dtype=dtype,
    )  # fmt: skip
    q, k, v = random_qkv(rng, n_tokens, rows, n_heads, n_kv_heads, head_dim, dtype)
    got = layer.attend(q, k, v, pos)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("cpu, subgroup_min_size", [(False, None), (True, None), (False, 16), (False, 4), (True, 64)])
def test_lane_shape_fits(head_dim, group, cpu, subgroup_min_size):
    """The lane walk's constants: lanes a power of two within the head, the subgroup's known minimum and
    the adapter's cap; each lane a whole number of vec4; every group's merge partials within the K and V
    tiles' memory, and as many groups as fit."""
    if group > max_query_heads_per_kv(head_dim):
        pytest.skip("more query heads per KV head than one workgroup serves")
    shape = lane_shape(head_dim, group, cpu, subgroup_min_size=subgroup_min_size)
    lanes, c4 = shape["LANES"], head_dim // 4
    cap = min(LANES_CPU if cpu else LANES_GPU, subgroup_min_size or c4)
    assert lanes == min(cap, c4) and lanes & (lanes - 1) == 0
    assert shape["LANE_VECS"] * lanes == c4 and 1 << shape["LANE_LEVELS"] == lanes
    groups = shape["LANE_GROUPS"]
    assert groups & (groups - 1) == 0 and groups * lanes <= WORKGROUP
    tiles = tile_rows(head_dim) * (2 * c4 + 1)  # the merge's partials in the K and V tiles' memory
    assert groups * group * c4 <= tiles
    assert groups == WORKGROUP // lanes or 2 * groups * group * c4 > tiles


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(4, 4, 64), (10, 2, 128), (8, 2, 64), (4, 2, 256)])
@pytest.mark.parametrize(
    "walk",
    [
        "tiles",
        "lanes",
        "lanes, 1 row a step",
        "lanes, 3 rows a step",
        "lanes, at most 8 splits",
        "lanes, subgroups of 4",
    ],
)
@pytest.mark.parametrize("pos", [0, 45, 300, 1000])
def test_decode_walks_match_reference(device, kernels, monkeypatch, n_heads, n_kv_heads, head_dim, walk, pos):
    """Both walks of a one-token workgroup: the tile walk (five barriers a tile) and, where the device
    has subgroups, the lane-group walk, with steps that end inside a split's rows (1 and 3 rows per lane
    group and step), direct (pos 0, 45) and split (300: one tile a split, 1000: one or two; or
    at most 8 splits of several tiles each, which the combine must deal as the walk does)."""
    if walk != "tiles" and "subgroups" not in device.features:
        pytest.skip("the lane walk needs subgroups")
    if walk.endswith("a step"):
        monkeypatch.setattr(attention_module, "LANE_ROWS", int(walk.split()[1]))
    if walk.endswith("of 4"):  # a browser's adapter.info.subgroupMinSize (SwiftShader's): 4 lanes a row
        monkeypatch.setattr(device, "subgroup_min_size", 4, raising=False)
    rng = np.random.default_rng(pos + head_dim + n_heads)
    rows = pos + 1
    layer = Layer(
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=1, max_context=1024,
        initial_capacity=rows,
    )  # fmt: skip
    splits = 8 if walk.endswith("8 splits") else None
    scratch = AttentionScratch(device, n_heads, head_dim, 1024, max_splits=splits)
    attention = layer.make_attention(kernels, 1, lanes=walk != "tiles", scratch=scratch)
    assert attention.lanes == (walk != "tiles")
    if walk.endswith("of 4"):
        assert attention.split_pipeline.label.count("LANES=4 ") == 1
    for buffer in (attention.scratch.acc, attention.scratch.stats):  # a partial read but never written shows
        device.upload(buffer, 0, np.full(buffer.nbytes // 4, np.nan, dtype=np.float32))
    q, k, v = random_qkv(rng, 1, rows, n_heads, n_kv_heads, head_dim, "f16")
    got = layer.attend(q, k, v, pos, attention=attention)
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
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=n_tokens,
        max_context=256, initial_capacity=rows,
    )  # fmt: skip
    options = (
        {"tiled_prefill": False}
        if config == "legacy"
        else {"prefill_query_rows": config[0], "prefill_rows_per_thread": config[1]}
    )
    attention = layer.make_attention(kernels, n_tokens, **options)
    if (
        config != "legacy"
        and config[0] == 32
        and head_dim == 128
        and device.limits.max_compute_workgroup_storage_size < 37888
    ):
        pytest.skip("32 query rows of head_dim 128 need 37888 bytes of workgroup memory")
    assert (attention.tiled is None) == (config == "legacy")
    q, k, v = random_qkv(rng, n_tokens, rows, n_heads, n_kv_heads, head_dim, "f16")
    got = layer.attend(q, k, v, pos, attention=attention)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n_tokens", [3, 1])  # prefill path, split decode path
def test_attention_sharp_scores_stay_finite(device, kernels, n_tokens):
    """Large logits: the online softmax must subtract the running max (a naive exp overflows)."""
    n_heads, n_kv_heads, head_dim, pos = 2, 1, 64, 90
    rng = np.random.default_rng(5)
    rows = pos + n_tokens
    layer = Layer(
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=4, max_context=128,
        initial_capacity=128,
    )  # fmt: skip
    q, k, v = random_qkv(rng, n_tokens, rows, n_heads, n_kv_heads, head_dim, "f16", k_scale=12.0, q_scale=12.0)
    got = layer.attend(q, k, v, pos)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=1e-4, rtol=1e-3)


def long_context_layer(device, kernels, dtype="f16", **options) -> Layer:
    """2B-4T attention shapes (20 query heads, 5 KV heads, head_dim 128), one decoded token, context 4096."""
    return Layer(
        device, kernels, n_heads=20, n_kv_heads=5, head_dim=128, max_tokens=1, max_context=4096,
        initial_capacity=4096, dtype=dtype, **options,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "pass_pos, dtype, max_splits", [(True, "f16", 64), (False, "f16", 64), (True, "f32", 64), (True, "f16", 256)]
)
def test_long_context_decode_split(device, kernels, pass_pos, dtype, max_splits):
    """At position ~2000: more tiles than splits (with 64), so each split workgroup walks two tiles, then
    the combine merges 63 partials (with 256: 126 partials of one tile, several per combine invocation).

    Without `pos` the dispatch covers the whole capacity and the surplus workgroups must not matter.
    """
    pos = 2011
    rng = np.random.default_rng(2011)
    layer = long_context_layer(device, kernels, dtype)
    scratch = AttentionScratch(device, 20, 128, 4096, max_splits=max_splits)
    attention = layer.make_attention(kernels, 1, scratch=scratch)
    q, k, v = random_qkv(rng, 1, pos + 1, 20, 5, 128, dtype, k_scale=1.0)
    # Make a few distant rows dominate some heads, so every tile's partial matters in the combine.
    for row in (3, 700, 1999):
        k[row, 1] = as_stored(q[0, 5] * 0.4, dtype)
    got = layer.attend(q, k, v, pos, attention=attention, pass_pos=pass_pos)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)
    assert -(-(pos + 1) // tile_rows(128)) > MAX_SPLITS


@pytest.mark.parametrize("pass_pos", [True, False])
def test_long_context_decode_past_the_split_cap(device, kernels, monkeypatch, pass_pos):
    """A token's decode takes at most SPLIT_CAP workgroups per KV head, a cap that need not be a power
    of two (here 2012 rows in 126 tiles: 6 splits of 21 tiles); the kernel, the combine and the host's
    dispatch agree on it (with `pos` the dispatch covers just the capped splits)."""
    monkeypatch.setattr(attention_module, "SPLIT_CAP", 6)
    pos = 2011
    rng = np.random.default_rng(2012)
    layer = long_context_layer(device, kernels, "f16")
    attention = layer.make_attention(kernels, 1, scratch=AttentionScratch(device, 20, 128, 4096))
    q, k, v = random_qkv(rng, 1, pos + 1, 20, 5, 128, "f16", k_scale=1.0)
    for row in (3, 700, 1999):
        k[row, 1] = as_stored(q[0, 5] * 0.4, "f16")
    got = layer.attend(q, k, v, pos, attention=attention, pass_pos=pass_pos)
    np.testing.assert_allclose(got, ref_attention(q, k, v, pos), atol=2e-5, rtol=1e-4)


def test_split_count_follows_the_tiles_up_to_the_cap():
    """The host's copy of _split_plan.wgsl's rule: one workgroup up to DIRECT_MAX_TILES tiles, then one
    per tile up to SPLIT_CAP (and the scratch's partial slots)."""
    tile = tile_rows(128)
    direct = DIRECT_MAX_TILES * tile
    assert split_count(direct, tile, 64) == 1 and split_count(direct + 1, tile, 64) == DIRECT_MAX_TILES + 1
    assert split_count(SPLIT_CAP * tile, tile, 64) == SPLIT_CAP == split_count(4096, tile, 64)
    assert split_count((SPLIT_CAP - 1) * tile, tile, 64) == SPLIT_CAP - 1
    assert split_count(4096, tile, 16) == 16  # a smaller scratch caps it
    counts = [split_count(kv_len, tile, 64) for kv_len in range(1, 4097)]
    assert counts == sorted(counts)  # never falls as rows grow: a step's last row needs the most splits


@pytest.mark.slow
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("pass_pos", [True, False])
def test_long_context_decode_with_fused_rope(device, kernels, style, pass_pos):
    """The fused decode kernel at position ~2000 (split path): rotates q on load, appends the rotated
    k and plain v of row pos to the cache, and attends over the 2011 earlier rows plus that one."""
    n_heads, n_kv_heads, head_dim, pos, theta = 20, 5, 128, 2011, 500000.0
    rng = np.random.default_rng(11)
    layer = long_context_layer(device, kernels, theta=theta, style=style, fused=True)
    _, k, v = random_qkv(rng, 0, pos + 1, n_heads, n_kv_heads, head_dim, "f16", k_scale=1.0)
    layer.cache.write_rows(0, 0, k[:pos], v[:pos])
    qkv = rng.standard_normal((1, (n_heads + 2 * n_kv_heads) * head_dim)).astype(np.float32)
    q_new, k_new, v_new = split_qkv(qkv, n_heads, n_kv_heads, head_dim)
    k[pos] = as_stored(ref_rope(k_new, np.array([pos]), head_dim, theta, style)[0], "f16")
    v[pos] = as_stored(v_new[0], "f16")
    layer.step(qkv, pos, pass_pos=pass_pos)
    q_rot = ref_rope(q_new, np.array([pos]), head_dim, theta, style)
    np.testing.assert_allclose(layer.output(1), ref_attention(q_rot, k, v, pos), atol=5e-5, rtol=1e-3)
    # f32 table vs float64 angles, then one f16 rounding
    np.testing.assert_allclose(layer.cache_rows("k", pos, 1)[0], k[pos], atol=5e-4, rtol=2.0**-10)
    np.testing.assert_array_equal(layer.cache_rows("v", pos, 1)[0], v[pos])


# --- the chain and the cache ----------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("style, rope_dim", [("neox", 64), ("interleaved", 64), ("neox", 32)])
@pytest.mark.parametrize("dtype", ["f16", "f32"])
@pytest.mark.parametrize("lanes", [True, False], ids=["lane-walk", "tile-walk"])
def test_prefill_then_decode_with_cache_growth(device, kernels, style, rope_dim, fused, dtype, lanes):
    """RopeKV + Attention in one recorder (or RoPE fused into the decode kernel): a 13-token prefill,
    then decode steps that grow the cache from 16 rows through 32 to 64; the rows written before each
    growth must survive the copy, and the rebound ops must use the new buffers. Both walks of the decode
    workgroups (the lane walk where the device has subgroups)."""
    n_heads, n_kv_heads, head_dim, theta = 4, 2, 64, 10000.0
    rng = np.random.default_rng(7)
    width = (n_heads + 2 * n_kv_heads) * head_dim
    layer = Layer(
        device, kernels, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, max_tokens=13, max_context=100,
        rope_dim=rope_dim, theta=theta, style=style, initial_capacity=16, fused=fused, dtype=dtype, lanes=lanes,
    )  # fmt: skip
    all_qkv = rng.standard_normal((40, width)).astype(np.float32)
    q, k, v = split_qkv(all_qkv, n_heads, n_kv_heads, head_dim)
    positions = np.arange(40)
    q_rot = ref_rope(q, positions, rope_dim, theta, style)
    k_rot = as_stored(ref_rope(k, positions, rope_dim, theta, style), dtype)
    v = as_stored(v, dtype)
    # The GPU's f32 rotation may round a key to the neighbouring f16 value (a ~1e-4 relative change
    # of a few keys moves outputs by ~1e-5).
    atol = 3e-5 if dtype == "f32" else 6e-5

    layer.step(all_qkv[:13], 0)
    np.testing.assert_allclose(layer.output(13), ref_attention(q_rot[:13], k_rot, v, 0), atol=atol, rtol=1e-4)

    capacities = set()
    for p in range(13, 40):
        layer.step(all_qkv[p : p + 1], p, pass_pos=p % 2 == 0)
        capacities.add(layer.cache.capacity)
        np.testing.assert_allclose(
            layer.output(1), ref_attention(q_rot[p : p + 1], k_rot, v, p), atol=atol, rtol=1e-4,
            err_msg=f"decode at position {p}",
        )  # fmt: skip
    assert capacities == {16, 32, 64}
    assert layer.attention.fused_rope == fused
    np.testing.assert_allclose(
        layer.cache_rows("k", 0, 40), k_rot, atol=1e-5, rtol=1e-5 if dtype == "f32" else 2.0**-10
    )
    np.testing.assert_array_equal(layer.cache_rows("v", 0, 40), v)


def test_cache_growth_stops_at_context_length(device):
    cache = KVCache(device, n_layers=2, n_kv_heads=1, head_dim=32, max_context=40, initial_capacity=16)
    assert cache.ensure_capacity(33)
    assert cache.capacity == 40  # doubling capped at the context length
    assert not cache.ensure_capacity(40)
    with pytest.raises(KVCacheFullError, match="41 tokens exceed the model's context length of 40"):
        cache.ensure_capacity(41)


def test_f16_cache_takes_half_the_memory(device):
    shape = dict(n_layers=2, n_kv_heads=5, head_dim=128, max_context=64, initial_capacity=64)
    f16, f32 = KVCache(device, **shape, dtype="f16"), KVCache(device, **shape, dtype="f32")
    assert 2 * f16.k[0].nbytes == f32.k[0].nbytes == 64 * 5 * 128 * 4
    assert kv_bytes_per_token(2, 5, 128) == 2 * f16.row_bytes * 2 == kv_bytes_per_token(2, 5, 128, "f32") // 2
    with pytest.raises(ValueError, match="dtype must be one of"):
        KVCache(device, **shape, dtype="bf16")


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
    with pytest.raises(ValueError, match="max_splits must be a power of two"):
        AttentionScratch(device, 4, 64, 64, max_splits=48)
    with pytest.raises(ValueError, match="made for other shapes"):
        Attention(
            kernels, params, cache, 0, buf, buf, n_heads=4, max_tokens=1, scratch=AttentionScratch(device, 8, 64, 64)
        )
