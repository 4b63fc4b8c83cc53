"""The GPU forward pass (BitNetModel, driven through the Engine) against the numpy ReferenceModel.

Tiny random models of several shapes run on lavapipe; each GGUF is written once per module.

Tolerance. Both sides compute the same float32 function but sum in different orders (the GPU sums
ternary products exactly, in integers), so most logits agree to ~1e-7 of their range. But where an
activation lies within ~1e-5 of an int8 rounding boundary (x * 127 / absmax = k + 0.5) the two
sides round it one step apart; that step changes the K/V row of its position, every later position
attends to it, and their own activations then cross other boundaries: from the first flip on, all
later logits move. The numpy reference does the same to itself: a relative 1e-6 noise on the
embedding moved its logits by up to 1.1% of their range, 1.7% of their RMS (12 runs, the 4 shapes
below, 64 tokens). A real bug moves them much more: one layer's attn_sub_norm weight skipped gives
8.5% of the RMS, interleaved instead of NEOX RoPE 64%, a wrong GQA head mapping 100%. So:
  - at every position, max |diff| <= MAX_TOL = 3% of the reference's logit range;
  - overall, RMS(diff) <= RMS_TOL = 4% of RMS(reference logits);
  - greedy (argmax) agreement wherever the reference's top-2 gap exceeds MAX_TOL.
"""

from __future__ import annotations

import asyncio
import os
import zlib

import numpy as np
import pytest

from bitnet_web.convert.synthetic import write_random_bitnet  # noqa: E402
from bitnet_web.engine import Engine, EngineError  # noqa: E402
from bitnet_web.formats.gguf_reader import open_gguf  # noqa: E402
from bitnet_web.model.reference import ReferenceModel  # noqa: E402
from bitnet_web.text.sampler import SamplerSettings  # noqa: E402

pytestmark = pytest.mark.gpu

GREEDY = SamplerSettings(temperature=0)  # the engine decodes this on the GPU (argmax, pipelined)
TOP1 = SamplerSettings(temperature=1.0, top_k=1)  # also greedy, sampled on the CPU from read-back logits

MAX_TOL = 0.03  # of the reference's logit range, per position (see the module docstring)
RMS_TOL = 0.04  # of the reference's logit RMS, over all positions
KV_INITIAL_CAPACITY = 256  # KVCache's first allocation (rows)

# All shapes: 3 layers; widths multiples of 128, most not powers of two. name -> write_random_bitnet args.
PREFILL_CHUNK = 64  # the engine fixture's (tests/conftest.py)
SHAPES = {
    # GQA ratio 2, head_dim 64, width 384
    "b158_d384_gqa2_hd64": dict(dim=384, n_heads=6, n_kv_heads=3, ffn_dim=640),
    # GQA ratio 1, head_dim 64, width 640, untied output.weight
    "b158_d640_gqa1_hd64_untied": dict(dim=640, n_heads=10, n_kv_heads=10, ffn_dim=384, untied=True),
    # GQA ratio 4 (as 2B-4T), head_dim 128 (as 2B-4T)
    "b158_d512_gqa4_hd128": dict(dim=512, n_heads=4, n_kv_heads=1, ffn_dim=768),
    # `llama` (Falcon3-Edge style): SiLU gate, interleaved RoPE, no sub-norms, untied head
    "llama_d384_gqa1_hd128_untied": dict(
        dim=384, n_heads=3, n_kv_heads=3, ffn_dim=640, arch="llama", untied=True, sub_norms=False
    ),
}
# The behaviour tests (chunks, decode, KV growth, reuse, sharding, context limit) use one smaller shape
# (lavapipe runs compute on the CPU; each new shape also compiles its kernels once).
SMALL = dict(dim=256, n_heads=4, n_kv_heads=2, ffn_dim=384, n_layers=2, untied=True)
MAIN = "small"
VOCAB = 700
CONTEXT = 600  # > 2 x KV_INITIAL_CAPACITY, so the cache must grow (twice if filled)


# Fixtures ------------------------------------------------------------------------------------------


class Models:
    """GGUF files written on first use (once per module), with their numpy reference."""

    def __init__(self, folder):
        self.folder = folder
        self.paths: dict[str, str] = {}
        self.refs: dict[str, ReferenceModel] = {}

    def path(self, name: str, **kwargs) -> str:
        if name not in self.paths:
            args = dict(n_layers=3, vocab_size=VOCAB, context_length=CONTEXT, seed=zlib.crc32(name.encode()))
            args.update(SHAPES.get(name, SMALL), **kwargs)
            path = str(self.folder / f"{name}.gguf")
            write_random_bitnet(path, **args)
            self.paths[name] = path
        return self.paths[name]

    def ref(self, name: str) -> ReferenceModel:
        if name not in self.refs:
            self.refs[name] = ReferenceModel(open_gguf(self.path(name)))
        return self.refs[name]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Models:
    return Models(tmp_path_factory.mktemp("model_ggufs"))


def loaded(engine: Engine, models: Models, name: str, fresh: bool = False):
    """The engine's model for `name`, loading it unless it is already the loaded one."""
    path = models.path(name)
    if fresh or engine.model is None or engine.name != os.path.basename(path):
        engine.load(path)
    return engine.model


def run(coroutine):
    return asyncio.run(coroutine)


def token_ids(n: int, seed: int, low: int = 0, high: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(low, high, n).tolist()


def assert_logits_close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """The tolerance of the module docstring; `want` is the reference, rows are positions."""
    got, want = np.atleast_2d(got), np.atleast_2d(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    span = float(np.ptp(want))
    per_position = np.abs(got - want).max(axis=1)
    worst = int(per_position.argmax())
    assert per_position[worst] <= MAX_TOL * span, (
        f"{what}: position {worst} differs by {per_position[worst]:.4g}, over {MAX_TOL:.0%} of the "
        f"logit range {span:.4g}"
    )
    rms_ratio = float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want.astype(np.float64) ** 2)))
    assert rms_ratio <= RMS_TOL, f"{what}: RMS difference is {rms_ratio:.2%} of the logits' RMS"
    top2 = np.sort(want, axis=1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > MAX_TOL * span
    mismatched = np.nonzero(decided & (got.argmax(axis=1) != want.argmax(axis=1)))[0]
    assert mismatched.size == 0, f"{what}: greedy token differs at positions {mismatched.tolist()}"


# Shapes and architectures ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.slow
def test_logits_match_reference_for_shape(engine, models, name):
    model = loaded(engine, models, name)
    cfg = model.config
    spec = SHAPES[name]
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads) == (spec["dim"], spec["n_heads"], spec["n_kv_heads"])
    assert cfg.tied_embeddings == (not spec.get("untied", False))
    if spec.get("arch") == "llama":
        assert (cfg.activation, cfg.rope_style, cfg.has_sub_norms) == ("silu", "interleaved", False)
    else:
        assert (cfg.activation, cfg.rope_style, cfg.has_sub_norms) == ("relu2", "neox", True)
    ids = token_ids(40, seed=1)
    want = models.ref(name).logits(ids)
    decided = np.diff(np.sort(want, axis=1)[:, -2:], axis=1)[:, 0] > MAX_TOL * np.ptp(want)
    assert decided.mean() > 0.25, "the greedy check would be nearly vacuous for this model"
    assert_logits_close(engine.logits(ids), want, name)


# Prefill chunks, decode steps and the KV cache -----------------------------------------------------------


@pytest.fixture(scope="module")
def main_sequence(models):
    """64 token ids and their reference logits on the main model."""
    ids = token_ids(64, seed=2)
    return ids, models.ref(MAIN).logits(ids)


@pytest.fixture(scope="module")
def one_pass_logits(engine, models, main_sequence):
    model = loaded(engine, models, MAIN)
    ids, _ = main_sequence
    model.truncate(0)
    logits = run(model.prefill(ids, chunk=64, all_logits=True))
    assert model.last_dispatches > 0 and model.n_cached == 64
    return logits


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.slow
def test_prefill_in_chunks_equals_one_pass(engine, models, main_sequence, one_pass_logits, chunk):
    model = loaded(engine, models, MAIN)
    ids, want = main_sequence
    model.truncate(0)
    got = run(model.prefill(ids, chunk=chunk, all_logits=True))
    assert model.cached_tokens == ids
    assert_logits_close(got, one_pass_logits, f"chunk {chunk} vs one pass")
    assert_logits_close(got, want, f"chunk {chunk} vs reference")


@pytest.mark.slow
def test_prefill_then_decode_matches_full_sequence(engine, models, main_sequence):
    """Each decode step reads every earlier K/V row from the cache: logits at each position must equal
    the full-sequence reference."""
    model = loaded(engine, models, MAIN)
    ids, want = main_sequence
    model.truncate(0)
    rows = [run(model.prefill(ids[:40]))]  # logits of position 39
    for token in ids[40:]:
        rows.append(run(model.decode(token)))
        assert model.n_cached == len(rows) + 39
    assert_logits_close(np.stack(rows), want[39:], "prefill 40 + decode 24")


@pytest.fixture(scope="module")
def long_sequence(models):
    ids = token_ids(270, seed=3)
    return ids, models.ref(MAIN).logits(ids)


@pytest.mark.parametrize("grow_during", ["prefill", "decode"])
@pytest.mark.slow
def test_kv_cache_grows_past_initial_capacity(engine, models, long_sequence, grow_during):
    """270 tokens on a 600-token model: the cache starts at 256 rows and must grow, keeping old rows."""
    model = loaded(engine, models, MAIN, fresh=True)
    ids, want = long_sequence
    assert model.kv_cache.capacity == KV_INITIAL_CAPACITY
    if grow_during == "prefill":
        # chunks of 40: the chunk at positions 240..279 straddles the old capacity
        got = run(model.prefill(ids, chunk=40, all_logits=True))
        assert_logits_close(got, want, "prefill of 270 tokens in chunks of 40")
    else:
        first = run(model.prefill(ids[:250], all_logits=True))
        assert model.kv_cache.capacity == KV_INITIAL_CAPACITY
        steps = np.stack([run(model.decode(t)) for t in ids[250:]])  # grows at position 256
        assert_logits_close(first, want[:250], "prefill of 250 tokens")
        assert_logits_close(steps, want[250:], "decode of positions 250..269")
    assert model.kv_cache.capacity > KV_INITIAL_CAPACITY
    assert model.n_cached == 270


@pytest.mark.slow
def test_queued_prefill_chunks_fill_the_cache(engine, models, long_sequence):
    """prefill without all_logits submits every chunk but the last without waiting for it: the last
    token's logits and every K/V row the queued chunks wrote (read back by decode steps) must match
    the reference, with the cache growing while chunks are queued (chunk 240..279 crosses 256)."""
    model = loaded(engine, models, MAIN, fresh=True)
    ids, want = long_sequence
    last = run(model.prefill(ids[:265], chunk=40))  # 6 queued chunks + a last one of 25
    assert model.cached_tokens == ids[:265] and model.kv_cache.capacity > KV_INITIAL_CAPACITY
    steps = [last] + [run(model.decode(t)) for t in ids[265:]]
    assert_logits_close(np.stack(steps), want[264:], "queued prefill of 265 tokens + decode")


# Prefix reuse ------------------------------------------------------------------------------------


def test_reuse_prefix_equals_recomputing(engine, models):
    model = loaded(engine, models, MAIN)
    ref = models.ref(MAIN)
    prefix, old_tail, new_tail = token_ids(30, 4), token_ids(25, 5), token_ids(20, 6)
    assert old_tail[0] != new_tail[0]
    model.truncate(0)
    run(model.prefill(prefix + old_tail))  # rows 30..54 hold the old tail's K/V
    reused = model.reuse_prefix(prefix + new_tail)
    assert reused == 30 and model.n_cached == 30
    got = run(model.prefill(new_tail, all_logits=True))  # overwrites rows 30..49
    want = ref.logits(prefix + new_tail)
    assert_logits_close(got, want[30:], "after reusing a 30-token prefix")
    model.truncate(0)
    recomputed = run(model.prefill(prefix + new_tail, all_logits=True))
    assert_logits_close(got, recomputed[30:], "reused vs recomputed")

    # A prompt that is a prefix of the cache still recomputes its last token (its logits start the reply).
    assert model.reuse_prefix(prefix) == 29
    assert_logits_close(run(model.prefill(prefix[29:])), want[29], "prompt = cached prefix")


# Tensor sharding -----------------------------------------------------------------------------------

SHARD_LIMIT = 256 * 1024  # bytes per binding: a 3000 x 256 F16 matrix (1.5 MB) splits into 6 shards
SHARDED = dict(SMALL, vocab_size=3000, context_length=256)


@pytest.mark.slow
def test_sharded_embedding_and_head_match_reference(models):
    """token_embd and output.weight split into shards of 512 rows: lookups of ids in later shards and
    logits of rows past the first shard must be right."""
    path = models.path("sharded", **SHARDED)
    ref = ReferenceModel(open_gguf(path))
    engine = Engine(max_binding_size=SHARD_LIMIT, prefill_chunk=16)
    try:
        engine.load(path)
        model = engine.model
        embd, head = model.token_embd, model.output
        assert head is not embd
        for matrix in (embd, head):
            assert len(matrix.shards) >= 3
            assert all(buf.nbytes <= SHARD_LIMIT for _, _, buf in matrix.shards)
        first_end = embd.shards[0][1]
        # ids only from shards 1.. (none from the first), covering the last shard's final row
        ids = token_ids(23, seed=7, low=first_end, high=SHARDED["vocab_size"]) + [SHARDED["vocab_size"] - 1]
        shard_of = [next(i for i, (a, b, _) in enumerate(embd.shards) if a <= t < b) for t in ids]
        assert {1, 2} <= set(shard_of) and len(embd.shards) - 1 in shard_of
        want = ref.logits(ids)
        assert_logits_close(engine.logits(ids), want, "sharded prefill")
        # the decode path (one token per step) reads the shards too
        model.truncate(0)
        run(model.prefill(ids[:8]))
        steps = np.stack([run(model.decode(t)) for t in ids[8:16]])
        assert_logits_close(steps, want[8:16], "sharded decode")
        # the reference's top token lies past the first shard at some positions: the head's later rows count
        assert (want.argmax(axis=1) >= first_end).any()
    finally:
        engine.close()


# Context limit -------------------------------------------------------------------------------------

SMALL_CONTEXT = 40


@pytest.mark.parametrize("settings", [GREEDY, TOP1], ids=["gpu_argmax", "cpu_top1"])
@pytest.mark.slow
def test_context_full_is_a_clear_error_and_a_stop_reason(engine, models, settings):
    models.path("ctx40", context_length=SMALL_CONTEXT)  # written on first use with this context
    model = loaded(engine, models, "ctx40")
    ref = models.ref("ctx40")
    ids = token_ids(SMALL_CONTEXT + 1, seed=8)

    # The model: a full context refuses one more token and keeps its state.
    model.truncate(0)
    run(model.prefill(ids[:SMALL_CONTEXT]))
    with pytest.raises(ValueError, match="context"):
        run(model.decode(ids[SMALL_CONTEXT]))
    assert model.cached_tokens == ids[:SMALL_CONTEXT]

    # The engine: logits of too many ids and a prompt filling the context are refused by name.
    with pytest.raises(EngineError, match="context length 40"):
        engine.logits(ids)
    with pytest.raises(EngineError, match="context holds 40"):
        list(engine.generate(tokens=ids[:SMALL_CONTEXT], settings=GREEDY))

    # Generation runs until the last cache row is used, then stops with reason 'context_full'.
    prompt = ids[:30]
    pieces = list(engine.generate(tokens=prompt, settings=settings, max_tokens=100))
    stats = engine.last_stats
    assert stats.stop_reason == "context_full"
    assert model.n_cached == SMALL_CONTEXT
    assert stats.n_generated == SMALL_CONTEXT - len(prompt) + 1  # the last one is sampled, not decoded
    assert "".join(pieces) == engine.tokenizer.decode(engine.generated_tokens)
    # greedy, teacher-forced: each token is the reference's argmax unless its top-2 gap is within MAX_TOL
    generated = engine.generated_tokens
    logits = ref.logits(prompt + generated[:-1])[len(prompt) - 1 :]  # the logits each token was chosen from
    chosen = logits[np.arange(len(generated)), generated]
    assert (chosen >= logits.max(axis=1) - MAX_TOL * np.ptp(logits)).all()

    # ... and the engine serves the next request.
    list(engine.generate(tokens=ids[:5], settings=settings, max_tokens=3))
    assert engine.last_stats.n_generated == 3 and engine.last_stats.stop_reason == "max_tokens"
