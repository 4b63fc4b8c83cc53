"""GGUF writer: files readable by the PyPI `gguf` package, streaming, and random BitNet models."""

import tracemalloc

import numpy as np
import pytest
from shapes import TINY_SHAPE

from bitnet_web.convert.synthetic import synthetic_vocab_metadata, write_random_bitnet
from bitnet_web.formats.ggml import GGMLType
from bitnet_web.formats.gguf_reader import open_gguf
from bitnet_web.formats.gguf_writer import GGUFWriter
from bitnet_web.formats.quants import float_to_bf16_bits
from bitnet_web.model.config import config_from_gguf
from bitnet_web.text.bpe import BYTE_TO_UNICODE

TINY = TINY_SHAPE

# ground-truth.md: model keys (prefix = architecture) and tokenizer keys of the 2B-4T file.
GROUND_TRUTH_ARCH_KEYS = {
    "vocab_size",
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "rope.dimension_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
}
GROUND_TRUTH_TOKENIZER_KEYS = {
    "tokenizer.ggml.model",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
}


def test_gguf_package_reads_our_standard_types(tmp_path):
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(0)
    arrays = {
        "f32": (GGMLType.F32, rng.standard_normal((3, 64)).astype(np.float32)),
        "f16": (GGMLType.F16, rng.standard_normal((2, 32)).astype(np.float32)),
        "bf16": (GGMLType.BF16, rng.standard_normal((4, 32)).astype(np.float32)),
        "q8": (GGMLType.Q8_0, rng.standard_normal((2, 64)).astype(np.float32)),
        "tq1": (GGMLType.TQ1_0, rng.standard_normal((2, 256)).astype(np.float32)),
        "tq2": (GGMLType.TQ2_0, rng.standard_normal((1, 512)).astype(np.float32)),
    }
    path = tmp_path / "w.gguf"
    w = GGUFWriter(str(path))
    w.add("general.architecture", "llama")
    w.add("llama.block_count", 2)
    w.add("tokenizer.ggml.tokens", ["a", "b"])
    for name, (t, a) in arrays.items():
        w.add_tensor(name, a.shape, t, a)
    w.write()

    reader = gguf.GGUFReader(str(path))
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    by_name = {t.name: t for t in reader.tensors}
    for name, (t, a) in arrays.items():
        rt = by_name[name]
        assert int(rt.tensor_type) == int(t)
        assert list(rt.shape) == list(reversed(a.shape))
        ref = gguf.quants.dequantize(rt.data, rt.tensor_type).reshape(a.shape)
        expect = gguf.quants.dequantize(gguf.quants.quantize(a, rt.tensor_type), rt.tensor_type)
        np.testing.assert_array_equal(ref, expect.reshape(a.shape), err_msg=name)


def test_bf16_rounding_matches_torch():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(1).standard_normal(10000).astype(np.float32) * 100
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(float_to_bf16_bits(x), ref)


def test_tensor_sources_callable_and_chunks(tmp_path):
    calls = []

    def late():
        calls.append("late")
        return np.arange(6, dtype=np.float32)

    def chunks():
        calls.append("chunks")
        yield np.arange(4, dtype=np.float32)
        yield np.arange(4, 8, dtype=np.float32).astype(np.float16)

    path = tmp_path / "s.gguf"
    w = GGUFWriter(str(path))
    w.add_tensor("a", (2, 3), GGMLType.F32, late)
    w.add_tensor("b", (8,), GGMLType.F16, chunks())
    w.add_tensor("c", (4,), GGMLType.F32, np.ones(4, np.float32).tobytes())
    assert calls == []  # nothing generated before write()
    w.write()
    assert calls == ["late", "chunks"]
    g = open_gguf(str(path))
    np.testing.assert_array_equal(g.tensor("a"), np.arange(6).reshape(2, 3))
    np.testing.assert_array_equal(g.tensor("b"), np.arange(8))
    np.testing.assert_array_equal(g.tensor("c"), np.ones(4))


def test_wrong_tensor_size_rejected(tmp_path):
    w = GGUFWriter(str(tmp_path / "bad.gguf"))
    w.add_tensor("a", (8,), GGMLType.F32, lambda: iter([np.zeros(3, np.float32)]))
    with pytest.raises(ValueError, match="'a' .* 12 bytes, expected 32"):
        w.write()
    w = GGUFWriter(str(tmp_path / "bad2.gguf"))
    w.add_tensor("a", (8,), GGMLType.F32, np.zeros(5))
    with pytest.raises(ValueError, match="5 values for shape"):
        w.write()
    with pytest.raises(ValueError, match="duplicate tensor"):
        w.add_tensor("a", (8,), GGMLType.F32, np.zeros(8))


@pytest.mark.slow
def test_streaming_keeps_memory_small(tmp_path):
    dim, vocab = 1024, 32768  # 64 MiB F16 embedding, streamed in chunks
    tracemalloc.start()
    write_random_bitnet(
        str(tmp_path / "m.gguf"), dim=dim, n_layers=1, n_heads=8, n_kv_heads=8, ffn_dim=1024, vocab_size=vocab
    )
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert (tmp_path / "m.gguf").stat().st_size > dim * vocab * 2
    assert peak < 48 << 20, f"peak {peak >> 20} MiB while writing a {dim * vocab * 2 >> 20} MiB embedding"


def test_random_bitnet_contents(tmp_path):
    path = tmp_path / "r.gguf"
    write_random_bitnet(str(path), embed_std=0.5, **TINY)
    g = open_gguf(str(path))
    cfg = config_from_gguf(g)
    assert cfg.dim == 256 and cfg.vocab_size == 1000 and cfg.tied_embeddings
    g.validate_tensors()
    types = [t.ggml_type for t in g.tensors.values()]
    assert types.count(GGMLType.I2_S) == 14 and types.count(GGMLType.F32) == 9 and types.count(GGMLType.F16) == 1
    scales = set()
    for name, info in g.tensors.items():
        if info.ggml_type == GGMLType.I2_S:
            values, scale = g.ternary(name)
            counts = np.bincount(values.reshape(-1) + 1, minlength=3) / values.size
            assert np.all(np.abs(counts - 1 / 3) < 0.05), name
            in_features = info.shape[1]
            assert 0.5 <= scale * np.sqrt(2 / 3 * in_features) <= 1.5
            scales.add(scale)
        elif info.ggml_type == GGMLType.F32:
            w = g.tensor(name)
            assert np.all((w >= 0.8) & (w <= 1.2)) and not np.any(w == 1.0), name
    assert len(scales) == 14
    emb = g.tensor("token_embd.weight").astype(np.float32)
    assert abs(emb.std() - 0.5) < 0.01 and abs(emb.mean()) < 0.01


def test_random_bitnet_is_seeded(tmp_path):
    a, b, c = (tmp_path / n for n in ("a.gguf", "b.gguf", "c.gguf"))
    write_random_bitnet(str(a), seed=3, **TINY)
    write_random_bitnet(str(b), seed=3, **TINY)
    write_random_bitnet(str(c), seed=4, **TINY)
    assert a.read_bytes() == b.read_bytes() and a.read_bytes() != c.read_bytes()


def test_metadata_keys_as_ground_truth(tmp_path):
    path = tmp_path / "k.gguf"
    write_random_bitnet(str(path), **TINY)
    md = open_gguf(str(path)).metadata
    arch_keys = {k[len("bitnet-b1.58.") :] for k in md if k.startswith("bitnet-b1.58.")}
    assert arch_keys == GROUND_TRUTH_ARCH_KEYS
    assert {k for k in md if k.startswith("tokenizer.")} == GROUND_TRUTH_TOKENIZER_KEYS
    assert md["general.architecture"] == "bitnet-b1.58" and md["general.file_type"] == 40
    assert "tokenizer.ggml.pre" not in md
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.add_bos_token"] is True
    assert not md["tokenizer.ggml.scores"].any()


def test_synthetic_vocab_small():
    md = synthetic_vocab_metadata(300)
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == 300 == len(set(tokens))
    ref = pytest.importorskip("transformers.convert_slow_tokenizer").bytes_to_unicode()
    assert BYTE_TO_UNICODE == ref
    assert tokens[:256] == [ref[b] for b in range(256)]
    bos, eos = md["tokenizer.ggml.bos_token_id"], md["tokenizer.ggml.eos_token_id"]
    assert (tokens[bos], tokens[eos], tokens[299]) == ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")
    assert types[bos] == types[eos] == types[299] == 3 and np.all(types[:297] == 1)
    assert md["tokenizer.ggml.padding_token_id"] == eos
    assert "<|eot_id|>" in md["tokenizer.chat_template"] and "Assistant: " in md["tokenizer.chat_template"]


def test_synthetic_vocab_llama3_ids():
    md = synthetic_vocab_metadata(128256, with_eot_key=True)
    tokens = md["tokenizer.ggml.tokens"]
    assert md["tokenizer.ggml.bos_token_id"] == 128000 and tokens[128000] == "<|begin_of_text|>"
    assert md["tokenizer.ggml.eos_token_id"] == 128001 and tokens[128001] == "<|end_of_text|>"
    assert md["tokenizer.ggml.eot_token_id"] == 128009 and tokens[128009] == "<|eot_id|>"
    assert np.all(md["tokenizer.ggml.token_type"][128000:] == 3)
    assert len(set(tokens)) == 128256


@pytest.mark.slow
def test_2b4t_shaped_model_streams(tmp_path):
    """The exact 2B-4T shapes (1.18 GB): written with little memory, header as ground truth."""
    path = tmp_path / "big.gguf"
    tracemalloc.start()
    size = write_random_bitnet(
        str(path), dim=2560, n_layers=30, n_heads=20, n_kv_heads=5, ffn_dim=6912, vocab_size=128256
    )
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 200 << 20
    g = open_gguf(str(path))
    assert size == path.stat().st_size and 1.1e9 < size < 1.25e9
    types = [t.ggml_type for t in g.tensors.values()]
    assert len(types) == 332
    assert (types.count(GGMLType.I2_S), types.count(GGMLType.F32), types.count(GGMLType.F16)) == (210, 121, 1)
    assert g.tensors["token_embd.weight"].shape == (128256, 2560)
    cfg = config_from_gguf(g)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (20, 5, 128, 6912)
    g.validate_tensors()
    path.unlink()
