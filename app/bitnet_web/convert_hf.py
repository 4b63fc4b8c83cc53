"""Convert a Hugging Face BitNet checkpoint folder to GGUF with I2_S weights (numpy only, no torch).

Input: config.json + model.safetensors (or sharded model-*.safetensors with an index), optional
tokenizer.json / tokenizer_config.json. Weights of the decoder Linears come in one of two forms:
  * packed uint8 (out/4, in), as microsoft/bitnet-b1.58-2B-4T ships them: row r, bits 2i..2i+1 hold
    output row i*(out/4) + r, code = value + 1; plus `weight_scale`. With
    quantization_config.linear_class 'autobitlinear' the scale multiplies (it is the absmean);
    with 'bitlinear' it divides (it is 1/absmean).
  * unpacked float (bf16/f16/f32) weights: exactly ternary values with a `weight_scale` (multiplies),
    or full-precision weights, ternarized here by absmean (scale = mean|w|).
Output: architecture bitnet-b1.58 (relu2 checkpoints) or bitnet (silu), metadata keys as the 2B-4T
file, F32 norms, F16 (or `embed_type`) embedding, tied head unless lm_head.weight exists and
tie_word_embeddings is false. Tokenizer: gpt2 BPE from tokenizer.json, else a synthetic vocabulary.

Deliberately WRONG files for sensitivity tests (each option documented in `convert`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .gguf import GGMLType, GGUFError, GGUFValueType, Keys
from .gguf_writer import (
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    GGUFWriter,
    Typed,
    bitnet_model_metadata,
    synthetic_vocab_metadata,
)
from .quants import i2s_encode, ternarize

TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNUSED = 4, 5


class ConvertError(GGUFError):
    """The Hugging Face folder cannot be converted; the message says which file and tensor."""


# ---------------------------------------------------------------------------------------------
# safetensors, read with numpy
# ---------------------------------------------------------------------------------------------

_ST_DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "U8": np.dtype("u1"),
              "I8": np.dtype("i1"), "F64": np.dtype("<f8"), "I32": np.dtype("<i4"), "I64": np.dtype("<i8")}


class SafetensorsFile:
    """A memory-mapped .safetensors file: 8-byte header length, JSON header, raw little-endian data."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path}: too short for a safetensors header")
            n = int.from_bytes(head, "little")
            if n > size - 8 or n > 100 << 20:
                raise ConvertError(f"{path}: header length {n} does not fit in the file ({size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConvertError(f"{path}: safetensors header is not JSON ({e})") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self.data_start = 8 + n
        self.data = np.memmap(path, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, np.uint8)
        for name, e in header.items():
            begin, end = e["data_offsets"]
            if e["dtype"] not in _ST_DTYPES:
                continue
            expected = int(np.prod(e["shape"], dtype=np.int64)) * _ST_DTYPES[e["dtype"]].itemsize
            if end - begin != expected or self.data_start + end > size:
                raise ConvertError(f"{path}: tensor {name!r} data offsets {begin}..{end} do not match shape "
                                   f"{e['shape']} {e['dtype']} or the file size {size}")

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def raw(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if e["dtype"] not in _ST_DTYPES:
            raise ConvertError(f"{self.path}: tensor {name!r} has unsupported dtype {e['dtype']}")
        begin, end = e["data_offsets"]
        return self.data[self.data_start + begin:self.data_start + end].view(_ST_DTYPES[e["dtype"]]) \
            .reshape(e["shape"])

    def float32(self, name: str) -> np.ndarray:
        """Values as float32; bf16 is widened by shifting its 16 bits into the high half."""
        arr = self.raw(name)
        if self.dtype(name) == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)


class Checkpoint:
    """All safetensors files of a folder, looked up by tensor name."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{folder}: no .safetensors file (only safetensors checkpoints are supported)")
        self.where: dict[str, SafetensorsFile] = {}
        for path in files:
            st = SafetensorsFile(path)
            for name in st.entries:
                self.where[name] = st

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def file(self, name: str) -> SafetensorsFile:
        try:
            return self.where[name]
        except KeyError:
            raise ConvertError(f"checkpoint has no tensor {name!r}") from None


# ---------------------------------------------------------------------------------------------
# Ternary weights
# ---------------------------------------------------------------------------------------------

def unpack_hf_ternary(packed: np.ndarray) -> np.ndarray:
    """transformers' packing along dim 0: (out/4, in) uint8 -> int8 values (out, in)."""
    rows = packed.shape[0]
    out = np.empty((4 * rows, *packed.shape[1:]), dtype=np.int8)
    for i in range(4):
        codes = (packed >> (2 * i)) & 3
        out[i * rows:(i + 1) * rows] = codes.astype(np.int8) - 1
    return out


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: rotate-half (NEOX) pair order -> interleaved pairs."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def _linear_ternary(ckpt: Checkpoint, key: str, out_features: int, linear_class: str
                    ) -> tuple[np.ndarray, float]:
    """(int8 values (out, in), multiplying scale) of one HF Linear."""
    st = ckpt.file(f"{key}.weight")
    wname = f"{key}.weight"
    has_scale = f"{key}.weight_scale" in ckpt
    scale = None
    if has_scale:
        s = ckpt.file(f"{key}.weight_scale").float32(f"{key}.weight_scale").reshape(-1)
        if s.size != 1 or not np.isfinite(s[0]) or s[0] <= 0:
            raise ConvertError(f"{st.path}: {key}.weight_scale is {s.tolist()}, expected one positive number")
        scale = float(s[0]) if linear_class == "autobitlinear" else 1.0 / float(s[0])
    if st.dtype(wname) in ("U8", "I8") and st.shape(wname)[0] * 4 == out_features:
        packed = st.raw(wname).view(np.uint8)
        bad = (packed & (packed >> 1) & 0x55) != 0
        if bad.any():
            raise ConvertError(f"{st.path}: {wname} holds code 3 (packed byte index "
                               f"{int(np.argmax(bad.reshape(-1)))}); not a ternary packed weight")
        if scale is None:
            raise ConvertError(f"{st.path}: packed {wname} has no {key}.weight_scale")
        return unpack_hf_ternary(packed), scale
    if st.shape(wname)[0] != out_features:
        raise ConvertError(f"{st.path}: {wname} has shape {list(st.shape(wname))}, expected {out_features} "
                           f"rows (or {out_features // 4} packed rows)")
    w = st.float32(wname)
    if scale is not None:
        values = np.rint(w)
        if not np.array_equal(values, w) or np.abs(values).max() > 1:
            raise ConvertError(f"{st.path}: {wname} has a weight_scale but its values are not -1/0/+1")
        return values.astype(np.int8), scale
    return ternarize(w)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def tokenizer_metadata(folder: Path, vocab_size: int, config: dict) -> dict[str, object]:
    """gpt2 BPE metadata from tokenizer.json; ids missing from it become unused '[PAD{id}]' tokens."""
    path = folder / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{path}: cannot read ({e})") from None
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ConvertError(f"{path}: tokenizer model {model.get('type')!r}; only byte-level BPE is supported")
    tokens: list[str | None] = [None] * vocab_size
    types = np.full(vocab_size, TOKEN_TYPE_NORMAL, dtype=np.int32)
    for text, tid in model["vocab"].items():
        if not 0 <= tid < vocab_size:
            raise ConvertError(f"{path}: token {text!r} has id {tid}, outside the model vocabulary {vocab_size}")
        tokens[tid] = text
    by_text: dict[str, int] = {}
    for added in data.get("added_tokens", []):
        tid = added["id"]
        if tid >= vocab_size:
            continue        # no embedding row: the model can neither read nor produce it
        if tid < 0:
            raise ConvertError(f"{path}: added token {added['content']!r} has id {tid}")
        tokens[tid] = added["content"]
        types[tid] = TOKEN_TYPE_CONTROL if added.get("special") else TOKEN_TYPE_USER_DEFINED
        by_text[added["content"]] = tid
    for tid, text in enumerate(tokens):
        if text is None:
            tokens[tid] = f"[PAD{tid}]"
            types[tid] = TOKEN_TYPE_UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    tok_config = {}
    if (folder / "tokenizer_config.json").exists():
        tok_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))

    def special_id(kind: str) -> int | None:
        text = tok_config.get(f"{kind}_token")
        if isinstance(text, dict):
            text = text.get("content")
        if isinstance(text, str) and text in by_text:
            return by_text[text]
        tid = config.get(f"{kind}_token_id")
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        return tid if isinstance(tid, int) else None

    md: dict[str, object] = {
        Keys.TOKENIZER_MODEL: "gpt2",
        Keys.TOKENS: tokens,
        Keys.TOKEN_TYPE: types,
        Keys.SCORES: np.zeros(vocab_size, dtype=np.float32),
        Keys.MERGES: Typed(GGUFValueType.STRING, merges, True),
    }
    bos, eos = special_id("bos"), special_id("eos")
    if bos is not None:
        md[Keys.BOS_ID] = bos
    if eos is not None:
        md[Keys.EOS_ID] = eos
        md[Keys.PAD_ID] = eos
    md[Keys.ADD_BOS] = bool(tok_config.get("add_bos_token", bos is not None))
    if isinstance(tok_config.get("chat_template"), str):
        md[Keys.CHAT_TEMPLATE] = tok_config["chat_template"]
    return md


# ---------------------------------------------------------------------------------------------
# Conversion
# ---------------------------------------------------------------------------------------------

_HF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_HF_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm"}


def _cfg(config: dict, key: str, path: Path):
    if key not in config:
        raise ConvertError(f"{path}: missing {key!r}")
    return config[key]


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, embed_type: str = "F16",
            arch: str | None = None, swap_codes: bool = False, permute_qk: bool = False,
            ones_norm: str | None = None, name: str | None = None) -> dict[str, object]:
    """Convert `hf_dir` to a GGUF file at `out_path`; returns a small summary dict.

    embed_type: 'F16' (like the 2B-4T file), 'F32' or 'BF16' for token_embd (and output.weight).
    arch: override the architecture (default: bitnet-b1.58 for relu2, bitnet for silu).
    Deliberately wrong files, for sensitivity tests:
      swap_codes   every ternary value negated (2-bit codes -1 <-> +1 swapped);
      permute_qk   Q/K rows permuted to interleaved-RoPE order (what llama-arch converters do);
      ones_norm    a GGUF norm tensor name (e.g. 'blk.0.attn_sub_norm.weight') written as all ones.
    """
    folder = Path(hf_dir)
    cfg_path = folder / "config.json"
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConvertError(f"{cfg_path}: cannot read ({e})") from None
    dim = int(_cfg(config, "hidden_size", cfg_path))
    n_layers = int(_cfg(config, "num_hidden_layers", cfg_path))
    n_heads = int(_cfg(config, "num_attention_heads", cfg_path))
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    ffn_dim = int(_cfg(config, "intermediate_size", cfg_path))
    vocab_size = int(_cfg(config, "vocab_size", cfg_path))
    head_dim = int(config.get("head_dim") or dim // n_heads)
    rope = config.get("rope_parameters") or {}
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    act = config.get("hidden_act", "relu2")
    if arch is None:
        arch = {"relu2": "bitnet-b1.58", "silu": "bitnet"}.get(act)
        if arch is None:
            raise ConvertError(f"{cfg_path}: hidden_act {act!r} is neither relu2 nor silu")
    qcfg = config.get("quantization_config") or {}
    linear_class = qcfg.get("linear_class", "autobitlinear")
    if linear_class not in ("autobitlinear", "bitlinear"):
        raise ConvertError(f"{cfg_path}: quantization_config.linear_class {linear_class!r} is not supported")
    if embed_type not in ("F16", "F32", "BF16"):
        raise ValueError(f"embed_type must be F16, F32 or BF16, not {embed_type!r}")

    ckpt = Checkpoint(folder)
    embd_name = "model.embed_tokens.weight"
    embd_shape = ckpt.file(embd_name).shape(embd_name)
    if embd_shape != (vocab_size, dim):
        raise ConvertError(f"{folder}: {embd_name} has shape {list(embd_shape)}, expected [{vocab_size}, {dim}]")
    untied = "lm_head.weight" in ckpt and not config.get("tie_word_embeddings", False)

    writer = GGUFWriter(str(out_path))
    writer.add_dict(bitnet_model_metadata(
        arch, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn_dim=ffn_dim,
        vocab_size=vocab_size, context_length=int(config.get("max_position_embeddings", 4096)),
        rope_theta=rope_theta, norm_eps=float(config.get("rms_norm_eps", 1e-5)), head_dim=head_dim,
        name=name or folder.name))
    if (folder / "tokenizer.json").exists():
        writer.add_dict(tokenizer_metadata(folder, vocab_size, config))
    else:
        writer.add_dict(synthetic_vocab_metadata(vocab_size))

    float_type = GGMLType[embed_type]

    def float_tensor(hf_name: str):
        return lambda: ckpt.file(hf_name).float32(hf_name)

    def embedding_tensor(hf_name: str):
        # Row chunks, so a 128256 x 2560 bf16 embedding never exists as one float32 array.
        def chunks():
            st = ckpt.file(hf_name)
            raw = st.raw(hf_name)
            rows = max(1, (1 << 22) // max(1, raw.shape[1]))
            for start in range(0, raw.shape[0], rows):
                part = raw[start:start + rows]
                yield (part.astype(np.uint32) << 16).view(np.float32) if st.dtype(hf_name) == "BF16" \
                    else part.astype(np.float32)
        return chunks

    def norm_tensor(hf_name: str, gguf_name: str):
        if gguf_name == ones_norm:
            return lambda: np.ones(ckpt.file(hf_name).shape(hf_name), dtype=np.float32)
        return float_tensor(hf_name)

    def ternary_tensor(key: str, out_features: int, heads: int | None):
        def make() -> np.ndarray:
            values, scale = _linear_ternary(ckpt, key, out_features, linear_class)
            if swap_codes:
                values = -values
            if permute_qk and heads is not None:
                values = permute_for_interleaved_rope(values, heads)
            return i2s_encode(values, scale)
        return make

    out_features = {"attn_q": n_heads * head_dim, "attn_k": n_kv_heads * head_dim,
                    "attn_v": n_kv_heads * head_dim, "attn_output": dim, "ffn_gate": ffn_dim,
                    "ffn_up": ffn_dim, "ffn_down": dim}
    in_features = {"attn_q": dim, "attn_k": dim, "attn_v": dim, "attn_output": n_heads * head_dim,
                   "ffn_gate": dim, "ffn_up": dim, "ffn_down": ffn_dim}
    heads_of = {"attn_q": n_heads, "attn_k": n_kv_heads}

    writer.add_tensor("token_embd.weight", (vocab_size, dim), float_type, embedding_tensor(embd_name))
    known = {embd_name, "model.norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        hf = f"model.layers.{i}."
        for short, hf_norm in _HF_NORMS.items():
            hf_name = hf + hf_norm + ".weight"
            gguf_name = f"blk.{i}.{short}.weight"
            shape = ckpt.file(hf_name).shape(hf_name)
            writer.add_tensor(gguf_name, shape, GGMLType.F32, norm_tensor(hf_name, gguf_name))
            known.add(hf_name)
        for short, hf_lin in _HF_LINEARS.items():
            key = hf + hf_lin
            ckpt.file(key + ".weight")                  # fail early if missing
            writer.add_tensor(f"blk.{i}.{short}.weight", (out_features[short], in_features[short]),
                              GGMLType.I2_S, ternary_tensor(key, out_features[short], heads_of.get(short)))
            known.update({key + ".weight", key + ".weight_scale"})
    writer.add_tensor("output_norm.weight", (dim,), GGMLType.F32,
                      norm_tensor("model.norm.weight", "output_norm.weight"))
    if untied:
        writer.add_tensor("output.weight", (vocab_size, dim), float_type, embedding_tensor("lm_head.weight"))
    unknown = sorted(n for n in ckpt.where if n not in known and "rotary_emb" not in n)
    if unknown:
        raise ConvertError(f"{folder}: unexpected tensors in the checkpoint (e.g. {unknown[:3]}); "
                           "not a BitNetForCausalLM layout")
    size = writer.write()
    return {"path": str(out_path), "arch": arch, "bytes": size, "tensors": len(writer.tensors),
            "untied": untied, "tokenizer": "tokenizer.json" if (folder / "tokenizer.json").exists()
            else "synthetic"}
