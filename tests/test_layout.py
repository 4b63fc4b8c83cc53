"""model/layout.py: how every published BitNet shape is laid out on the GPU, and the one limit left.

The numbers follow from the kernels' constraints (128-value I2_S blocks, head dims 32/64/128/256,
query heads per KV head within one attention workgroup); the engine-vs-transformers checks of the
same shapes are in test_published_shapes.py.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from bitnet_web.convert.convert_hf import ConvertError, convert  # noqa: E402
from bitnet_web.kernels.attention import max_query_heads_per_kv  # noqa: E402
from bitnet_web.model.config import ModelConfig  # noqa: E402
from bitnet_web.model.layout import gather, gather_index, gpu_layout  # noqa: E402


def _config(dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, head_dim: int | None = None) -> ModelConfig:
    head_dim = head_dim or dim // n_heads
    return ModelConfig(
        arch="bitnet-b1.58",
        vocab_size=1000,
        context_length=64,
        dim=dim,
        n_layers=1,
        ffn_dim=ffn_dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=head_dim,
        rope_theta=1e4,
        norm_eps=1e-5,
        activation="relu2",
        rope_style="neox",
        tied_embeddings=True,
        has_sub_norms=True,
    )


# (dim, heads, kv heads, ffn) -> (gpu dim, gpu ffn, gpu head_dim, gpu kv heads)
PUBLISHED = {
    "bitnet-b1.58-2B-4T": ((2560, 20, 5, 6912), (2560, 6912, 128, 5)),
    "bitnet_b1_58-large": ((1536, 16, 16, 4096), (1536, 4096, 128, 16)),
    "bitnet_b1_58-3B": ((3200, 32, 32, 8640), (3200, 8704, 128, 32)),
    "Falcon3-1B-1.58bit": ((2048, 8, 4, 8192), (2048, 8192, 256, 4)),
    "Falcon3-3B-1.58bit": ((3072, 12, 4, 9216), (3072, 9216, 256, 4)),
    "Falcon3-7B/10B-1.58bit": ((3072, 12, 4, 23040), (3072, 23040, 256, 4)),
    "Llama3-8B-1.58": ((4096, 32, 8, 14336), (4096, 14336, 128, 8)),
    "12 query heads per KV head of 64": ((768, 12, 1, 2000), (768, 2048, 64, 2)),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_shapes_layout(name):
    (dim, heads, kv, ffn), expected = PUBLISHED[name]
    layout = gpu_layout(_config(dim, heads, kv, ffn))
    assert (layout.dim, layout.ffn_dim, layout.head_dim, layout.n_kv_heads) == expected
    assert layout.dim % 128 == 0 and layout.ffn_dim % 128 == 0 and layout.q_dim % 128 == 0
    assert layout.n_kv_heads == kv * layout.kv_repeat
    assert heads // layout.n_kv_heads <= max_query_heads_per_kv(layout.head_dim)


def test_padded_heads_and_repeated_kv_heads_gather_the_right_values():
    cfg = _config(dim=200, n_heads=4, n_kv_heads=1, ffn_dim=300, head_dim=50)
    layout = gpu_layout(cfg)
    assert (layout.head_dim, layout.n_kv_heads, layout.kv_repeat) == (64, 1, 1)
    rows = np.arange(4 * 50)
    q = gather(rows, gather_index(cfg, layout, "q"))
    for h in range(4):  # head h's 50 values, then 14 zeros
        np.testing.assert_array_equal(q[h * 64 : h * 64 + 50], rows[h * 50 : (h + 1) * 50])
        assert not q[h * 64 + 50 : (h + 1) * 64].any()
    wide = _config(dim=256, n_heads=16, n_kv_heads=2, ffn_dim=256)  # 8 heads of 16 per KV head; 4 fit
    layout = gpu_layout(wide)
    assert (layout.head_dim, layout.n_kv_heads, layout.kv_repeat) == (32, 4, 2)
    kv = gather(np.arange(2 * 16), gather_index(wide, layout, "kv")).reshape(4, 32)
    np.testing.assert_array_equal(kv[:, :16], [np.arange(16), np.arange(16), np.arange(16, 32), np.arange(16, 32)])
    assert not kv[:, 16:].any()
    m = np.arange(6).reshape(2, 3) + 1
    np.testing.assert_array_equal(gather(m, np.array([1, -1]), np.array([2, -1, 0])), [[6, 0, 4], [0, 0, 0]])


def test_convert_refuses_head_dim_over_256_before_reading_weights(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    config = {
        "model_type": "bitnet",
        "hidden_size": 640,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 256,
        "vocab_size": 300,
        "quantization_config": {"quant_method": "bitnet", "linear_class": "autobitlinear"},
    }
    (folder / "config.json").write_text(json.dumps(config))  # no weights at all: refused before them
    with pytest.raises(ConvertError, match="config.json: head_dim 320 is larger than 256"):
        convert(folder, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()
