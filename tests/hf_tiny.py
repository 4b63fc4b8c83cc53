"""Tiny random Hugging Face BitNet checkpoints for reference tests (a helper module, not tests).

`build_tiny_bitnet(folder, ...)` writes a folder that `transformers.BitNetForCausalLM.from_pretrained`
loads exactly like microsoft/bitnet-b1.58-2B-4T: config.json with
`quantization_config = {quant_method: bitnet, linear_class: autobitlinear, quantization_mode: offline}`
and model.safetensors holding every decoder Linear as
  `<name>.weight`       uint8 (out/4, in), packed along dim 0 by transformers' own `pack_weights`
                        (row r, bits 2i..2i+1 hold output row i*(out/4) + r; code = value + 1)
  `<name>.weight_scale` shape (1,), the absmean of the original weights (AutoBitLinear multiplies).
Weights are random normal (std 0.02) ternarized by absmean; norms are random in [0.8, 1.2] (never
exactly 1, so a skipped norm shows); the embedding is normal with std `embed_std`; embeddings are
tied (no lm_head.weight saved) unless `tied=False`. bos/eos are vocab-3 / vocab-2, like
`synthetic_vocab_metadata`. `hidden_act` ('relu2' or 'silu') and `head_dim` as in BitNetConfig;
`model_type='llama'` writes a LlamaForCausalLM with the same BitNet quantization_config (the layout
of Falcon3-*-1.58bit and HF1BitLLM: SiLU, no sub-norms).

Optional: `packed=False` saves plain float (non-ternary) weights without quantization_config (to test
absmean ternarization in a converter), `linear_class='bitlinear'` stores 1/absmean (BitLinear divides),
and `with_tokenizer=True` adds a byte-level BPE tokenizer.json trained offline on a fixed text.

Usage:
    from hf_tiny import build_tiny_bitnet, load_tiny_bitnet
    folder = build_tiny_bitnet(tmp_path / "hf")
    model = load_tiny_bitnet(folder)           # BitNetForCausalLM, eval mode, float32, f16 K/V
    logits = model(torch.tensor([[1, 2, 3]])).logits

TORCHDYNAMO_DISABLE=1 is set on import (transformers' BitNet helpers are wrapped in torch.compile,
which would otherwise spend ~45 s compiling on the first call).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import numpy as np  # noqa: E402

LINEAR_NAMES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)

TOKENIZER_TEXT = (
    "The quick brown fox jumps over the lazy dog. BitNet b1.58 uses ternary weights: -1, 0 and +1. "
    "def main():\n    return 42  # code\n\nNumbers 1234567890 and 3.14159; emoji 😀🚀; "
    "日本語のテキスト、中文文本、한국어 텍스트. Ünïcödé àccents, Ελληνικά, русский текст. "
    "   whitespace   runs\t\ttabs\n\n\nnewlines. User: hello<|eot_id|>Assistant: hi there! "
) * 4


def build_tiny_bitnet(
    folder: str | os.PathLike,
    *,
    hidden_size: int = 256,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 512,
    vocab_size: int = 1000,
    max_position_embeddings: int = 512,
    rope_theta: float = 500000.0,
    rms_norm_eps: float = 1e-5,
    embed_std: float = 1.0,
    seed: int = 0,
    dtype: str = "float32",
    packed: bool = True,
    linear_class: str = "autobitlinear",
    with_tokenizer: bool = False,
    hidden_act: str = "relu2",
    head_dim: int | None = None,
    tied: bool = True,
    model_type: str = "bitnet",
) -> Path:
    """Write a tiny random BitNetForCausalLM (or LlamaForCausalLM) checkpoint into `folder`; returns the
    folder path."""
    import torch
    from safetensors.torch import save_file
    from transformers import BitNetConfig, BitNetForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.bitnet import pack_weights

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    bitnet = model_type == "bitnet"
    config_class, model_class = (BitNetConfig, BitNetForCausalLM) if bitnet else (LlamaConfig, LlamaForCausalLM)
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=rms_norm_eps,
        tie_word_embeddings=tied,
        hidden_act=hidden_act,
        head_dim=head_dim or hidden_size // num_attention_heads,
        bos_token_id=vocab_size - 3,
        eos_token_id=vocab_size - 2,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
    )
    with torch.device("meta"):  # shapes only: the values are drawn below
        model = model_class(config)
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue  # tied to the embedding
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            value = torch.randn(tensor.shape, generator=gen) * embed_std
        elif name.endswith("norm.weight"):
            value = torch.rand(tensor.shape, generator=gen) * 0.4 + 0.8
        else:
            value = torch.randn(tensor.shape, generator=gen) * 0.02
        state[name] = value.to(torch_dtype).contiguous()

    if packed:
        for layer in range(num_hidden_layers):
            for lin in LINEAR_NAMES:
                key = f"model.layers.{layer}.{lin}"
                w = state[f"{key}.weight"].float()
                absmean = w.abs().mean().clamp(min=1e-5)
                values = (w / absmean).round().clamp(-1, 1)  # WeightQuant's formula
                state[f"{key}.weight"] = pack_weights(values.clone())
                scale = absmean if linear_class == "autobitlinear" else 1.0 / absmean
                state[f"{key}.weight_scale"] = scale.reshape(1).to(torch_dtype)

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = config.to_dict()
    cfg["architectures"] = [model_class.__name__]
    cfg["dtype"] = dtype
    cfg["rope_theta"] = rope_theta
    if packed:
        cfg["quantization_config"] = {
            "quant_method": "bitnet",
            "linear_class": linear_class,
            "quantization_mode": "offline",
        }
    else:
        cfg.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    if with_tokenizer:
        _write_tokenizer(folder, vocab_size)
    return folder


def load_tiny_bitnet(folder: str | os.PathLike, f16_kv: bool = True):
    """Reload with transformers (unpacks the uint8 weights); float32, eval mode; with `f16_kv`, K and V
    rounded to f16 as the engine's KV cache stores them (see `round_kv_to_f16`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    return round_kv_to_f16(model) if f16_kv else model


class _F16KV:
    """Stands in for an attention layer's cache: K (rotated) and V are rounded to f16 on the way in, and
    the attention then reads them back rounded, for the current tokens too, as the engine does."""

    def __init__(self, cache):
        self._cache = cache

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = key_states.half().float(), value_states.half().float()
        return (k, v) if self._cache is None else self._cache.update(k, v, layer_idx, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cache, name)


def round_kv_to_f16(model):
    """Make a transformers BitNet / Llama model attend over K and V rounded to f16, exactly the values the
    engine's f16 KV cache holds (app/bitnet_web/kernels/kv_cache.py), with or without a cache passed in:
    the reference for its math, like the F16 rounding of the embedding. Each attention module's `cache`
    argument is wrapped by a forward pre-hook; its float32 arithmetic is unchanged. Returns the model."""

    def wrap_cache(module, args, kwargs):
        return args, {**kwargs, "cache": _F16KV(kwargs.get("cache"))}

    attentions = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    if not attentions:
        raise TypeError(f"round_kv_to_f16: no attention modules in {type(model).__name__}")
    for module in attentions:
        module.register_forward_pre_hook(wrap_cache, with_kwargs=True)
    return model


def unpacked_linear_weights(model) -> dict[str, tuple[np.ndarray, float, str]]:
    """{'model.layers.N.self_attn.q_proj': (values as float array (out, in), weight_scale, class)}.

    For AutoBitLinear `weight` holds the unpacked ternary values and `weight_scale` multiplies; for
    BitLinear `weight` is still packed and `weight_scale` divides, so values come from
    transformers' `unpack_weights`.
    """
    from transformers.integrations.bitnet import AutoBitLinear, BitLinear, unpack_weights

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, AutoBitLinear):
            out[name] = (module.weight.detach().float().numpy(), float(module.weight_scale.float()), "autobitlinear")
        elif isinstance(module, BitLinear):
            values = unpack_weights(module.weight, dtype=module.weight_scale.dtype)
            out[name] = (values.float().numpy(), float(module.weight_scale.float()), "bitlinear")
    return out


def _write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE (GPT-2/Llama 3 style) trained on a fixed text, with the three special tokens
    at ids vocab-3..vocab-1, plus tokenizer_config.json naming bos/eos and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        min_frequency=1,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TOKENIZER_TEXT], trainer=trainer)
    # Specials go at the top of the id range; if training produced fewer tokens, unreachable filler
    # tokens (no merge makes them) close the gap, since tokenizers renumbers added tokens past holes.
    data = json.loads(tok.to_str())
    base = vocab_size - len(specials)
    vocab = data["model"]["vocab"]
    for tid in range(len(vocab), base):
        vocab[f"Ġfill{tid}"] = tid
    data["added_tokens"] = [
        {
            "id": base + i,
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, s in enumerate(specials)
    ]
    (folder / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    from bitnet_web.convert.synthetic import BITNET_CHAT_TEMPLATE

    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": specials[0],
                "eos_token": specials[1],
                "add_bos_token": True,
                "chat_template": BITNET_CHAT_TEMPLATE,
            }
        )
    )
