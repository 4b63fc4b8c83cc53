"""HF BitNet checkpoint -> GGUF I2_S: our decoded weights must equal what transformers uses."""

import json
import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_tiny import build_tiny_bitnet, load_tiny_bitnet, unpacked_linear_weights  # noqa: E402
from wrong_files import write_wrong_copy  # noqa: E402

from bitnet_web.convert.convert_hf import ConvertError, convert, permute_for_interleaved_rope  # noqa: E402
from bitnet_web.formats.ggml import GGMLType  # noqa: E402
from bitnet_web.formats.gguf_reader import open_gguf  # noqa: E402
from bitnet_web.model.config import config_from_gguf  # noqa: E402

GGUF_OF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
NORM_OF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.attn_sub_norm": "attn_sub_norm",
    "mlp.ffn_sub_norm": "ffn_sub_norm",
}

SHAPES = {
    "default": dict(),
    "wide": dict(
        hidden_size=384,
        intermediate_size=768,
        num_attention_heads=6,
        num_key_value_heads=2,
        num_hidden_layers=1,
        vocab_size=700,
    ),
    "narrow-bf16": dict(
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=3,
        vocab_size=400,
        dtype="bfloat16",
    ),
}


def gguf_linear_name(hf_name: str) -> str:
    layer = hf_name.split(".")[2]
    return f"blk.{layer}.{GGUF_OF[hf_name.split('.', 3)[3]]}.weight"


@pytest.fixture(scope="module", params=list(SHAPES))
def converted(request, tmp_path_factory):
    folder = build_tiny_bitnet(tmp_path_factory.mktemp(request.param), **SHAPES[request.param])
    out = folder / "model.gguf"
    convert(folder, out, embed_type="F32")
    return folder, open_gguf(str(out)), load_tiny_bitnet(folder)


def test_decoded_weights_equal_transformers(converted):
    _, g, model = converted
    linears = unpacked_linear_weights(model)
    assert len(linears) == 7 * model.config.num_hidden_layers
    for hf_name, (values, scale, kind) in linears.items():
        assert kind == "autobitlinear"
        ours, our_scale = g.ternary(gguf_linear_name(hf_name))
        assert ours.shape == values.shape
        np.testing.assert_array_equal(ours, values, err_msg=hf_name)
        assert our_scale == np.float32(scale), hf_name
        assert g.tensors[gguf_linear_name(hf_name)].ggml_type == GGMLType.I2_S


def test_norms_and_embedding_equal_transformers(converted):
    _, g, model = converted
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    np.testing.assert_array_equal(g.tensor("token_embd.weight"), state["model.embed_tokens.weight"])
    np.testing.assert_array_equal(g.tensor("output_norm.weight"), state["model.norm.weight"])
    for i in range(model.config.num_hidden_layers):
        for hf, ours in NORM_OF.items():
            np.testing.assert_array_equal(g.tensor(f"blk.{i}.{ours}.weight"), state[f"model.layers.{i}.{hf}.weight"])
    cfg = config_from_gguf(g)
    assert cfg.tied_embeddings and "output.weight" not in g.tensors
    assert (cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim) == (
        model.config.hidden_size,
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.intermediate_size,
    )
    assert cfg.rope_theta == 500000.0 and cfg.activation == "relu2"


def act_quant_matmul(values: np.ndarray, scale: float, x: np.ndarray) -> np.ndarray:
    """ground-truth BitLinear: s = 127/absmax(x), xq = clamp(round(x*s)), y = (W @ xq) * scale / s."""
    s = 127.0 / np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-5)
    xq = np.clip(np.round(x * s), -128, 127)
    return (xq @ values.T.astype(np.float64)) * scale / s


def test_transformers_linear_forward_matches_decoded_weights(converted):
    _, g, model = converted
    rng = np.random.default_rng(0)
    layer = model.model.layers[0]
    for hf_short, module in (("self_attn.q_proj", layer.self_attn.q_proj), ("mlp.down_proj", layer.mlp.down_proj)):
        x = rng.standard_normal((3, module.in_features)).astype(np.float32)
        with torch.no_grad():
            ref = module(torch.from_numpy(x).to(module.weight.dtype)).float().numpy()
        values, scale = g.ternary(f"blk.0.{GGUF_OF[hf_short]}.weight")
        ours = act_quant_matmul(values, scale, x.astype(np.float64))
        tol = 2e-2 if module.weight.dtype == torch.bfloat16 else 1e-4
        np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol * np.abs(ref).max())


def test_bitlinear_scale_divides(tmp_path):
    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1, linear_class="bitlinear")
    convert(folder, tmp_path / "m.gguf")
    g = open_gguf(str(tmp_path / "m.gguf"))
    model = load_tiny_bitnet(folder)
    linears = unpacked_linear_weights(model)
    rng = np.random.default_rng(1)
    for hf_name, (values, weight_scale, kind) in linears.items():
        assert kind == "bitlinear"
        ours, scale = g.ternary(gguf_linear_name(hf_name))
        np.testing.assert_array_equal(ours, values)
        assert scale == pytest.approx(1.0 / weight_scale, rel=1e-6)
    module = model.model.layers[0].self_attn.v_proj
    x = rng.standard_normal((2, module.in_features)).astype(np.float32)
    with torch.no_grad():
        ref = module(torch.from_numpy(x)).numpy()
    values, scale = g.ternary("blk.0.attn_v.weight")
    np.testing.assert_allclose(
        act_quant_matmul(values, scale, x.astype(np.float64)), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max()
    )


def test_unpacked_float_weights_ternarized_by_absmean(tmp_path):
    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1, packed=False)
    convert(folder, tmp_path / "m.gguf")
    g = open_gguf(str(tmp_path / "m.gguf"))
    from safetensors.numpy import load_file

    state = load_file(str(folder / "model.safetensors"))
    for hf_short, ours_short in GGUF_OF.items():
        w = torch.from_numpy(state[f"model.layers.0.{hf_short}.weight"])
        inv = 1.0 / w.abs().mean().clamp(min=1e-5)  # transformers' WeightQuant
        ref = (w * inv).round().clamp(-1, 1).numpy().astype(np.int8)
        values, scale = g.ternary(f"blk.0.{ours_short}.weight")
        np.testing.assert_array_equal(values, ref)
        assert scale == pytest.approx(float(w.abs().mean()), rel=1e-6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = build_tiny_bitnet(tmp_path_factory.mktemp("tiny"), num_hidden_layers=1)
    convert(folder, folder / "good.gguf")
    return folder, open_gguf(str(folder / "good.gguf"))


def test_wrong_file_swapped_codes(tiny):
    folder, good = tiny
    write_wrong_copy(folder / "good.gguf", folder / "swap.gguf", swap_codes=True)
    bad = open_gguf(str(folder / "swap.gguf"))
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
        np.testing.assert_array_equal(bad.ternary(name)[0], -good.ternary(name)[0])
    np.testing.assert_array_equal(bad.tensor("blk.0.attn_norm.weight"), good.tensor("blk.0.attn_norm.weight"))


def test_wrong_file_permuted_qk(tiny):
    folder, good = tiny
    write_wrong_copy(folder / "good.gguf", folder / "perm.gguf", permute_qk=True)
    bad = open_gguf(str(folder / "perm.gguf"))
    q, k = good.ternary("blk.0.attn_q.weight")[0], good.ternary("blk.0.attn_k.weight")[0]
    head_dim = 64
    # interleaved order: within each head, row 2j is NEOX row j, row 2j+1 is NEOX row j + head_dim/2
    j = np.arange(head_dim // 2)
    qb = bad.ternary("blk.0.attn_q.weight")[0]
    for h in range(4):
        np.testing.assert_array_equal(qb[h * head_dim + 2 * j], q[h * head_dim + j])
        np.testing.assert_array_equal(qb[h * head_dim + 2 * j + 1], q[h * head_dim + head_dim // 2 + j])
    np.testing.assert_array_equal(bad.ternary("blk.0.attn_k.weight")[0], permute_for_interleaved_rope(k, 2))
    assert not np.array_equal(qb, q)
    np.testing.assert_array_equal(bad.ternary("blk.0.attn_v.weight")[0], good.ternary("blk.0.attn_v.weight")[0])


def test_wrong_file_ones_sub_norm(tiny):
    folder, good = tiny
    write_wrong_copy(folder / "good.gguf", folder / "ones.gguf", ones_norm="blk.0.ffn_sub_norm.weight")
    bad = open_gguf(str(folder / "ones.gguf"))
    assert np.all(bad.tensor("blk.0.ffn_sub_norm.weight") == 1.0)
    assert not np.any(good.tensor("blk.0.ffn_sub_norm.weight") == 1.0)
    np.testing.assert_array_equal(bad.tensor("blk.0.attn_sub_norm.weight"), good.tensor("blk.0.attn_sub_norm.weight"))


def test_synthetic_vocab_without_tokenizer(tiny):
    _, g = tiny
    assert len(g.metadata["tokenizer.ggml.tokens"]) == 1000
    assert g.metadata["tokenizer.ggml.bos_token_id"] == 997


def test_tokenizer_json_metadata(tmp_path):
    from tokenizers import Tokenizer

    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1, with_tokenizer=True)
    convert(folder, tmp_path / "m.gguf")
    md = open_gguf(str(tmp_path / "m.gguf")).metadata
    hf = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens, types = md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"]
    assert len(tokens) == 1000
    for tid in range(1000):
        text = hf.id_to_token(tid)
        if text is None:
            assert tokens[tid] == f"[PAD{tid}]" and types[tid] == 5
        else:
            assert tokens[tid] == text
    assert md["tokenizer.ggml.bos_token_id"] == hf.token_to_id("<|begin_of_text|>") == 997
    assert md["tokenizer.ggml.eos_token_id"] == hf.token_to_id("<|end_of_text|>") == 998
    assert types[997] == types[998] == types[999] == 3
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    assert md["tokenizer.ggml.merges"] == [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(md["tokenizer.ggml.merges"]) > 100
    assert md["tokenizer.ggml.model"] == "gpt2" and "tokenizer.ggml.pre" not in md
    assert "<|eot_id|>" in md["tokenizer.chat_template"]


def test_bad_checkpoints(tmp_path):
    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "nocfg" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConvertError, match="missing 'hidden_size'"):
        convert(tmp_path / "nocfg", tmp_path / "x.gguf")
    with pytest.raises(ConvertError, match="cannot read"):
        convert(tmp_path / "missing", tmp_path / "x.gguf")

    from safetensors.numpy import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    broken = dict(state)
    broken["model.layers.0.mlp.up_proj.weight"] = broken["model.layers.0.mlp.up_proj.weight"] | 0b11
    save_file(broken, str(folder / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"mlp\.up_proj\.weight holds code 3"):
        convert(folder, tmp_path / "x.gguf")
    del state["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ConvertError, match=r"no model\.layers\.0\.mlp\.up_proj\.weight_scale"):
        convert(folder, tmp_path / "x.gguf")


def test_untied_lm_head(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = build_tiny_bitnet(tmp_path / "hf", num_hidden_layers=1)
    state = load_file(str(folder / "model.safetensors"))
    head = np.random.default_rng(2).standard_normal((1000, 256)).astype(np.float32)
    state["lm_head.weight"] = head
    save_file(state, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(cfg))
    convert(folder, tmp_path / "m.gguf", embed_type="F32")
    g = open_gguf(str(tmp_path / "m.gguf"))
    np.testing.assert_array_equal(g.tensor("output.weight"), head)
    assert not config_from_gguf(g).tied_embeddings
    model = load_tiny_bitnet(folder)
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), head)
