"""Forward steps over 2..SMALL_T_MAX rows (speculative verify steps) take the GPU path of every
BitLinear (each small-T path of kernels/linear.py: the fused kernel's norm once + the GEMV per row, the
fused norm + GEMV kernel per row, both by row count, the norm once + ternary_gemv_rows) and the one-pass
LM head: the whole model against the numpy ReferenceModel; and each verify row equals its decode step
bit for bit.

lavapipe is a CPU adapter, where NormTernaryLinear.record normally takes norm + GEMM; the test turns
the GPU path on, as a discrete GPU runs it.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from test_model import SMALL, VOCAB, assert_logits_close

from bitnet_web.convert.synthetic import write_random_bitnet
from bitnet_web.engine import Engine
from bitnet_web.formats.gguf_reader import open_gguf
from bitnet_web.kernels import attention as attention_module
from bitnet_web.kernels import linear as linear_module
from bitnet_web.kernels.attention import DIRECT_MAX_TILES
from bitnet_web.kernels.common import SMALL_T_MAX
from bitnet_web.kernels.linear import SMALL_T_PATHS, split_min_live_rows
from bitnet_web.model.reference import ReferenceModel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", SMALL_T_PATHS)
def test_verify_rows_match_reference(tmp_path, path):
    path = tmp_path / "small.gguf"
    write_random_bitnet(str(path), vocab_size=VOCAB, context_length=128, seed=15, **SMALL)
    ids = np.random.default_rng(15).integers(0, VOCAB, 2 + 5 + SMALL_T_MAX).tolist()
    want = ReferenceModel(open_gguf(str(path))).logits(ids)
    engine = Engine(prefill_chunk=64)
    try:
        engine.load(str(path))
        model = engine.model
        for layer in model.layer_ops:
            for op in (layer.qkv, layer.wo, layer.gate_up, layer.down):
                op.fuse_decode, op.small_t_path = True, path
        got, start = [], 0
        for t in (2, 5, SMALL_T_MAX):  # steps of t rows, each after the previous ones' KV rows
            got.append(asyncio.run(model.forward(ids[start : start + t], all_logits=True)))
            start += t
        assert model.n_cached == len(ids)
        assert_logits_close(np.concatenate(got), want, f"verify rows ({path} path)")
    finally:
        engine.close()


def _small_engine(tmp_path, seed: int) -> Engine:
    """The SMALL model (512-token context) loaded, its verify-row kernels built as the first speculative
    reply builds them (at load on a GPU)."""
    path = tmp_path / "small.gguf"
    write_random_bitnet(str(path), vocab_size=VOCAB, context_length=512, seed=seed, **SMALL)
    engine = Engine(prefill_chunk=64)
    engine.load(str(path))
    for layer in engine.model.layer_ops:
        layer.attention.prepare_draft_rows()
    return engine


@pytest.mark.parametrize(
    "gpu_kernels, lanes",
    [(False, True), (True, True), (False, False)],
    ids=["adapter-default", "gpu-kernels", "tile-walk"],
)
def test_verify_rows_equal_decode_steps_bit_for_bit(tmp_path, monkeypatch, gpu_kernels, lanes):
    """Greedy speculative output equals plain decoding only if each verify row computes exactly the
    logits of its decode step: same kernels per row, same reduction order (a last-bit difference can
    flip an int8 activation code and, at a near tie, the greedy token). Contexts where decode takes
    the one-dispatch attention (under DIRECT_MAX_TILES tiles: one tile, several tiles), a step that
    crosses into the split attention, and one past it; with the adapter's own kernel choice and with
    the discrete GPU's (the fused norm + GEMV); and with the attention's tile walk (devices whose
    subgroups are narrower than a lane group)."""
    monkeypatch.setattr(attention_module, "USE_LANES", lanes)
    monkeypatch.setattr(linear_module, "SPLIT_MIN_WEIGHTS", 0)  # this small model's BitLinears split as 2B-4T's
    # a split cap that binds past the direct attention (~10 tiles), not a power of two
    monkeypatch.setattr(attention_module, "SPLIT_CAP", 3)
    engine = _small_engine(tmp_path, seed=16)
    try:
        model = engine.model
        tile = model.layer_ops[0].attention.tile
        assert model.layer_ops[0].attention.draft_rows >= 5, "verify rows must take the fused RoPE kernel"
        assert model.layer_ops[0].attention.lanes == (lanes and "subgroups" in engine.device.features)
        if gpu_kernels:
            for layer in model.layer_ops:
                for op in (layer.qkv, layer.wo, layer.gate_up, layer.down):
                    op.fuse_decode = True
        rng = np.random.default_rng(16)
        rows = 5
        for cached in (3, tile + 8, DIRECT_MAX_TILES * tile - 2, DIRECT_MAX_TILES * tile + 40):
            ids = rng.integers(0, VOCAB, cached + rows).tolist()
            model.truncate(0)
            asyncio.run(model.prefill(ids[:cached]))
            decoded = np.stack([asyncio.run(model.forward([t])).reshape(-1) for t in ids[cached:]])
            model.truncate(cached)
            decode_dispatches = model.last_dispatches
            verified = asyncio.run(model.forward(ids[cached:], all_logits=True))
            # RoPE and the KV append run inside the attention kernel for verify rows as for a decode
            # step: a verify step takes no more dispatches than the decode step at the same position,
            # but for the split BitLinears' norm dispatches (5 rows take the split path on a GPU)
            fused = model.layer_ops[0].qkv.fuse_decode
            split = 4 * len(model.layer_ops) if fused and rows >= split_min_live_rows(engine.device) else 0
            assert model.last_dispatches <= decode_dispatches + split, (model.last_dispatches, decode_dispatches)
            differ = [i for i in range(rows) if not np.array_equal(decoded[i], verified[i])]
            assert not differ, f"after {cached} cached tokens, verify rows {differ} differ from their decode steps"
    finally:
        engine.close()


def _forward_on_a_bound(model, token_ids: list[int], bound: int) -> np.ndarray:
    """forward(token_ids, all_logits=True) as a queued speculative step records it: the position known only
    on the GPU (StepParams written apart), the attention dispatched for the upper bound `bound`."""
    n, pos = len(token_ids), model.n_cached
    model.kv_cache.ensure_capacity(bound + n)
    model.device.upload(model.token_ids, 0, np.asarray(token_ids, dtype=np.uint32))
    model.step.write(n, pos, model.kv_cache.capacity)
    model._record_step(n, all_logits=True, pos=bound, params_on_gpu=True).submit()
    model.cached_tokens.extend(token_ids)
    raw = asyncio.run(model.device.read(model.logits, 0, 4 * n * model.config.vocab_size))
    return raw.view(np.float32).reshape(n, model.config.vocab_size)


@pytest.mark.parametrize("lanes", [True, False], ids=["lane-walk", "tile-walk"])
def test_steps_on_a_loose_position_bound_equal_exact_ones(tmp_path, monkeypatch, lanes):
    """A queued verify or draft-off step knows only an upper bound of its position, so its attention takes
    the split kernels even where its rows fit the one-dispatch attention. There a split kernel writes the
    output itself and the combine leaves at once (attention.wgsl DIRECT_OUT): one-row and verify-row steps
    recorded on a bound past the direct limit give the logits of the exact recording bit for bit, at
    contexts within the direct limit, and past it (where the combine merges partials)."""
    monkeypatch.setattr(attention_module, "USE_LANES", lanes)
    engine = _small_engine(tmp_path, seed=17)
    try:
        model = engine.model
        tile = model.layer_ops[0].attention.tile
        direct = DIRECT_MAX_TILES * tile
        rng = np.random.default_rng(17)
        for cached in (3, direct - 6, direct + 20):
            for rows in (1, 5):
                ids = rng.integers(0, VOCAB, cached + rows).tolist()
                model.truncate(0)
                asyncio.run(model.prefill(ids[:cached]))
                exact = asyncio.run(model.forward(ids[cached:], all_logits=True))
                model.truncate(cached)
                bounded = _forward_on_a_bound(model, ids[cached:], direct + 3 * tile)
                assert np.array_equal(exact, bounded), f"{rows} rows after {cached} cached tokens"
    finally:
        engine.close()
