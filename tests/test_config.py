"""ModelConfig from GGUF metadata + tensor table: every architecture, and every problem listed."""

import math

import pytest
from shapes import TINY_SHAPE

from bitnet_web.convert.synthetic import random_bitnet_writer
from bitnet_web.formats.ggml import GGMLType, GGUFError, tensor_nbytes
from bitnet_web.formats.gguf_reader import parse_header
from bitnet_web.model.config import ModelConfigError, config_from_gguf

TINY = TINY_SHAPE
B2_4T = dict(dim=2560, n_layers=30, n_heads=20, n_kv_heads=5, ffn_dim=6912, vocab_size=128256)


def header_config(writer):
    """Parse only the header bytes (tensor data is never generated): config checks need no data."""
    g = parse_header(writer.header_bytes(), None)
    assert g is not None
    return config_from_gguf(g)


def drop_tensors(writer, names):
    writer.tensors[:] = [t for t in writer.tensors if t.name not in names]


def replace_tensor(writer, name, shape=None, ggml_type=None):
    for i, t in enumerate(writer.tensors):
        if t.name == name:
            shape, ggml_type = shape or t.shape, ggml_type or t.ggml_type
            n = math.prod(shape)
            writer.tensors[i] = t._replace(
                shape=shape, ggml_type=ggml_type, n_elements=n, n_bytes=tensor_nbytes(ggml_type, n)
            )


def test_2b4t_shapes():
    cfg = header_config(random_bitnet_writer("unused", **B2_4T))
    assert (cfg.arch, cfg.dim, cfg.n_layers, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads) == (
        "bitnet-b1.58",
        2560,
        30,
        6912,
        20,
        5,
    )
    assert cfg.head_dim == 128 and cfg.rope_dim == 128 and cfg.vocab_size == 128256
    assert cfg.context_length == 4096 and cfg.rope_theta == 500000.0
    assert cfg.norm_eps == pytest.approx(1e-5)
    assert cfg.activation == "relu2" and cfg.rope_style == "neox"
    assert cfg.tied_embeddings and cfg.has_sub_norms
    assert cfg.q_dim == 2560 and cfg.kv_dim == 640


@pytest.mark.parametrize(
    "arch,activation,rope",
    [
        ("bitnet-b1.58", "relu2", "neox"),
        ("bitnet-25", "relu2", "neox"),
        ("bitnet", "silu", "neox"),
        ("llama", "silu", "interleaved"),
    ],
)
@pytest.mark.parametrize("untied", [False, True])
def test_architectures(arch, activation, rope, untied):
    cfg = header_config(random_bitnet_writer("unused", arch=arch, untied=untied, **TINY))
    assert cfg.arch == arch and cfg.activation == activation and cfg.rope_style == rope
    assert cfg.tied_embeddings is (not untied)
    assert cfg.has_sub_norms


def test_llama_without_sub_norms():
    cfg = header_config(random_bitnet_writer("unused", arch="llama", sub_norms=False, untied=True, **TINY))
    assert not cfg.has_sub_norms and not cfg.tied_embeddings


def test_llama_with_partial_sub_norms_rejected():
    w = random_bitnet_writer("unused", arch="llama", **TINY)
    drop_tensors(w, {"blk.1.attn_sub_norm.weight"})
    with pytest.raises(ModelConfigError, match="exist in some layers but not all"):
        header_config(w)


def test_bitnet_requires_sub_norms():
    w = random_bitnet_writer("unused", arch="bitnet-b1.58", sub_norms=False, **TINY)
    with pytest.raises(ModelConfigError) as e:
        header_config(w)
    assert "missing tensor blk.0.attn_sub_norm.weight" in str(e.value)
    assert "missing tensor blk.1.ffn_sub_norm.weight" in str(e.value)


def test_missing_keys_all_listed():
    w = random_bitnet_writer("unused", **TINY)
    for key in (
        "bitnet-b1.58.block_count",
        "bitnet-b1.58.feed_forward_length",
        "bitnet-b1.58.attention.layer_norm_rms_epsilon",
        "bitnet-b1.58.context_length",
    ):
        del w.metadata[key]
    with pytest.raises(ModelConfigError) as e:
        header_config(w)
    msg = str(e.value)
    for key in ("block_count", "feed_forward_length", "attention.layer_norm_rms_epsilon", "context_length"):
        assert f"missing metadata key bitnet-b1.58.{key}" in msg
    assert isinstance(e.value, GGUFError)


def test_missing_and_wrong_tensors_all_listed():
    w = random_bitnet_writer("unused", **TINY)
    drop_tensors(w, {"blk.0.attn_k.weight", "output_norm.weight"})
    replace_tensor(w, "blk.1.ffn_down.weight", shape=(256, 384))
    replace_tensor(w, "blk.1.attn_norm.weight", ggml_type=GGMLType.F16)
    replace_tensor(w, "blk.0.ffn_up.weight", ggml_type=GGMLType.F16)
    with pytest.raises(ModelConfigError) as e:
        header_config(w)
    msg = str(e.value)
    assert "5 problem(s)" in msg
    assert "missing tensor blk.0.attn_k.weight" in msg and "missing tensor output_norm.weight" in msg
    assert "blk.1.ffn_down.weight has shape [256, 384], expected [256, 512]" in msg
    assert "blk.1.attn_norm.weight has type F16, expected F32" in msg
    assert "blk.0.ffn_up.weight has type F16, expected I2_S/TQ1_0/TQ2_0" in msg


def test_unknown_architecture():
    w = random_bitnet_writer("unused", arch="gpt2", **TINY)
    with pytest.raises(ModelConfigError, match="unsupported architecture 'gpt2'.*bitnet-b1.58"):
        header_config(w)


def test_missing_architecture():
    w = random_bitnet_writer("unused", **TINY)
    del w.metadata["general.architecture"]
    with pytest.raises(ModelConfigError, match="missing metadata key general.architecture"):
        header_config(w)


def test_widths_not_multiples_of_128_and_any_gqa_ratio_are_accepted():
    # padded and repeated at upload (model/layout.py); 12 query heads per KV head of 16 dims
    w = random_bitnet_writer("unused", dim=192, n_layers=1, n_heads=12, n_kv_heads=1, ffn_dim=320, vocab_size=300)
    cfg = header_config(w)
    assert (cfg.dim, cfg.ffn_dim, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads) == (192, 320, 16, 12, 1)


def test_head_dim_over_256_is_refused_before_loading():
    w = random_bitnet_writer("unused", dim=640, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300)
    with pytest.raises(ModelConfigError, match="head_dim 320 is larger than 256"):
        header_config(w)


def test_vocab_contradictions():
    w = random_bitnet_writer("unused", **TINY)
    w.metadata["bitnet-b1.58.vocab_size"] = 999
    with pytest.raises(ModelConfigError, match="vocab_size is 999 but token_embd.weight has 1000 rows"):
        header_config(w)
    w = random_bitnet_writer("unused", **TINY)
    replace_tensor(w, "token_embd.weight", shape=(900, 256))
    w.metadata["bitnet-b1.58.vocab_size"] = 900
    with pytest.raises(ModelConfigError, match="tokenizer has 1000 tokens but the embedding only 900 rows"):
        header_config(w)


def test_head_count_contradictions():
    w = random_bitnet_writer("unused", **TINY)
    w.metadata["bitnet-b1.58.attention.head_count_kv"] = 3
    with pytest.raises(ModelConfigError) as e:
        header_config(w)
    assert "head_count 4 is not a multiple of bitnet-b1.58.attention.head_count_kv 3" in str(e.value)
    assert "blk.0.attn_k.weight has shape [128, 256], expected [192, 256]" in str(e.value)


def test_untied_output_shape_checked():
    w = random_bitnet_writer("unused", untied=True, **TINY)
    replace_tensor(w, "output.weight", shape=(1000, 128))
    with pytest.raises(ModelConfigError, match=r"output.weight has shape \[1000, 128\], expected \[1000, 256\]"):
        header_config(w)


def test_defaults_when_optional_keys_absent():
    w = random_bitnet_writer("unused", **TINY)
    for key in ("attention.head_count_kv", "rope.dimension_count", "rope.freq_base"):
        del w.metadata[f"bitnet-b1.58.{key}"]
    drop_tensors(w, {f"blk.{i}.{n}.weight" for i in range(2) for n in ("attn_k", "attn_v")})
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_k.weight", (256, 256), GGMLType.I2_S, b"")
        w.add_tensor(f"blk.{i}.attn_v.weight", (256, 256), GGMLType.I2_S, b"")
    cfg = header_config(w)
    assert cfg.n_kv_heads == 4 and cfg.rope_dim == 64 and cfg.rope_theta == 10000.0
