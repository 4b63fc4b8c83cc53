"""Forward steps over 2..SMALL_T_MAX rows (speculative verify steps) take the GPU path of every
BitLinear (each small-T path of kernels/linear.py: the norm once + the GEMV per row, the fused norm +
GEMV kernel per row, the norm once + ternary_gemv_rows) and the one-pass LM head: the whole model
against the numpy ReferenceModel.

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
from bitnet_web.kernels.common import SMALL_T_MAX
from bitnet_web.kernels.linear import SMALL_T_PATHS
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
