"""Hugging Face checkpoints (config.json + safetensors + tokenizer files) straight to what the model loads.

One code path describes a checkpoint as a `GGUFWriter` (`build_gguf_writer`: metadata, and per tensor a
source that converts it when asked). `convert_hf.convert` writes it to a file; `load_folder` /
`load_from_buffers` / `load` turn it into an `UnwrittenFile`: a `GGUFFile` with no GGUF bytes, whose
tensors are converted one at a time as the model uploads them. The ternary weights are re-packed to
I2_S once, here; the model then uploads the I2_S bytes as they are.

Supported (`config.json`):
  model_type 'bitnet'   BitNetForCausalLM (microsoft/bitnet-b1.58-2B-4T): hidden_act relu2 -> GGUF arch
                        bitnet-b1.58, silu -> bitnet. Linears are one of
                          * packed uint8 (out/4, in): row r, bits 2i..2i+1 hold output row i*(out/4) + r,
                            code = value + 1, plus `weight_scale`, which multiplies for
                            quantization_config.linear_class 'autobitlinear' (it is the absmean) and
                            divides for 'bitlinear' (transformers' default when linear_class is absent);
                          * float values that are exactly -1/0/+1, plus a multiplying `weight_scale`;
                          * float master weights (bf16/fp16/fp32, the '-bf16' repositories, 'online'
                            quantization mode): ternarized by absmean (scale = mean|w|), as BitNet
                            inference does.
  model_type 'llama'    with quantization_config.quant_method 'bitnet': a Llama-layout BitNet (SiLU,
                        sub-norms only if present, untied head if lm_head exists), same weight forms.
                        GGUF arch llama: Q/K rows are permuted to the interleaved RoPE order that
                        llama-arch GGUF files use (the engine rotates pairs (2i, 2i+1) for llama).
  model_type 'llama'    without quantization_config: an ordinary fp16/bf16/fp32 Llama. EXPERIMENTAL and
                        LOSSY: every Linear is ternarized by absmean (post-training quantization of a
                        model never trained for it; expect degraded or meaningless output). Refused
                        unless `allow_lossy_ternarization=True`; the GGUF then carries a warning in
                        general.description and `bitnet_web.lossy_ternarization = true`.
Tokenizer: tokenizer.json (byte-level BPE: GPT-2 / Llama 3 style) -> tokenizer.ggml.* (model gpt2);
tokenizer_config.json for bos/eos/add_bos and the chat template (or chat_template.jinja); without
tokenizer.json a synthetic byte vocabulary (tests only).

Files of a folder URL (browser and CLI): see `files_to_fetch` and `OPTIONAL_FILES`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..formats.ggml import (
    I2S_BLOCK,
    OUTPUT,
    OUTPUT_NORM,
    TOKEN_EMBD,
    GGMLType,
    GGUFError,
    GGUFValueType,
    Keys,
    block_tensor,
)
from ..formats.gguf_reader import GGUFFile
from ..formats.gguf_writer import GGUFWriter, Typed
from ..formats.quants import i2s_pack_codes, ternarize
from ..formats.safetensors import SafetensorsError, SafetensorsFile, ShardedSafetensors, open_safetensors, parse_index
from ..model.config import head_dim_problem
from ..text.readers import hf_vocab
from ..text.vocab import TokenizerError
from .hf_urls import checkpoint_base_url, checkpoint_name
from .synthetic import bitnet_model_metadata, synthetic_vocab_metadata

ProgressCallback = Callable[[str, int, int], None]


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # newer transformers keep the template here
# Files a checkpoint may lack: a 404 for them is not an error.
OPTIONAL_FILES = frozenset({TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE})

LOSSY_KEY = "bitnet_web.lossy_ternarization"
DESCRIPTION_KEY = "general.description"
LOSSY_WARNING = (
    "EXPERIMENTAL, LOSSY: an ordinary (non-BitNet) {name} checkpoint ternarized on load by absmean "
    "post-training quantization (every Linear -> -1/0/+1 times one scale). The model was not trained "
    "for ternary weights: expect degraded or meaningless output."
)


class ConvertError(GGUFError):
    """The Hugging Face checkpoint cannot be used; the message says which file and tensor."""


class LossyTernarizationError(ConvertError):
    """An ordinary (non-BitNet) checkpoint, refused because lossy ternarization was not asked for."""


# ---------------------------------------------------------------------------------------------
# Which files to fetch (browser worker and CLI downloads)
# ---------------------------------------------------------------------------------------------


def files_to_fetch(index_json: Mapping | None = None) -> list[str]:
    """File names to download from a checkpoint folder, given its parsed model.safetensors.index.json.

    First try `<base>model.safetensors.index.json`: a 404 means a single weights file (pass None).
    Then fetch every name returned (the index itself is listed again when given: reuse its bytes);
    a 404 for a name in OPTIONAL_FILES just leaves it out. Pass everything to `load_from_buffers`.
    """
    names = [CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, CHAT_TEMPLATE_FILE]
    if index_json is None:
        return [*names, WEIGHTS_FILE]
    shards = sorted(set(parse_index(index_json, INDEX_FILE).values()))
    return [*names, INDEX_FILE, *shards]


def is_checkpoint_location(source: object) -> bool:
    """A folder path or a checkpoint folder URL (what `load` accepts), as opposed to a GGUF file."""
    if not isinstance(source, str | os.PathLike):
        return False
    text = os.fspath(source)
    if isinstance(text, bytes):
        return False
    if text.startswith(("http://", "https://")):
        return checkpoint_base_url(text) is not None
    return Path(text).is_dir()


# ---------------------------------------------------------------------------------------------
# The files of one checkpoint: a folder on disk, cached downloads, or buffers held in memory
# ---------------------------------------------------------------------------------------------


def _as_uint8(data: np.ndarray | bytes | bytearray | memoryview) -> np.ndarray:
    """A downloaded file as a 1-D uint8 array (no copy for arrays, bytes or memoryviews)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, dtype=np.uint8)


class CheckpointFiles:
    """Files of a checkpoint by name: local paths (memory-mapped) or byte buffers (the browser's)."""

    def __init__(
        self,
        name: str,
        *,
        paths: Mapping[str, Path] | None = None,
        buffers: Mapping[str, np.ndarray | bytes | bytearray | memoryview] | None = None,
        source: str | None = None,
    ):
        self.name = name  # e.g. the repository or folder name (general.name)
        self.source = source or name  # shown in messages
        self.paths = {k: Path(v) for k, v in (paths or {}).items()}
        self.buffers = dict(buffers or {})

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> CheckpointFiles:
        folder = Path(folder)
        if not folder.is_dir():
            raise ConvertError(f"{folder}: not a folder")
        paths = {p.name: p for p in folder.iterdir() if p.is_file()}
        return cls(folder.resolve().name, paths=paths, source=str(folder))

    def has(self, fname: str) -> bool:
        return fname in self.paths or fname in self.buffers

    def label(self, fname: str) -> str:
        if fname in self.paths:
            return str(self.paths[fname])
        return f"{self.source}/{fname}" if not self.source.endswith("/") else self.source + fname

    def text(self, fname: str) -> str:
        try:
            if fname in self.buffers:
                return _as_uint8(self.buffers[fname]).tobytes().decode("utf-8")
            if fname in self.paths:
                return self.paths[fname].read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConvertError(f"{self.label(fname)}: cannot read ({e})") from None
        raise ConvertError(f"{self.label(fname)}: cannot read (the checkpoint has no {fname})")

    def json(self, fname: str) -> dict:
        text = self.text(fname)
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConvertError(f"{self.label(fname)}: cannot read (not JSON: {e})") from None
        if not isinstance(value, dict):
            raise ConvertError(f"{self.label(fname)}: expected a JSON object, got a {type(value).__name__}")
        return value

    def safetensors(self, fname: str) -> SafetensorsFile:
        if fname in self.buffers:
            return SafetensorsFile.from_buffer(_as_uint8(self.buffers[fname]), self.label(fname))
        if fname in self.paths:
            return open_safetensors(str(self.paths[fname]))
        raise SafetensorsError(f"{self.label(fname)}: missing (named by {INDEX_FILE})")

    def weights(self) -> ShardedSafetensors:
        """The checkpoint's tensors: the index's shards, else model.safetensors, else every *.safetensors."""
        if self.has(INDEX_FILE):
            weight_map = parse_index(self.text(INDEX_FILE), self.label(INDEX_FILE))
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not self.has(s)]
            if missing:
                raise SafetensorsError(
                    f"{self.label(INDEX_FILE)}: shard {missing[0]!r} (of {len(shards)}) is missing from the checkpoint"
                )
            return ShardedSafetensors({s: self.safetensors(s) for s in shards}, weight_map, self.label(INDEX_FILE))
        if self.has(WEIGHTS_FILE):
            names = [WEIGHTS_FILE]
        else:
            names = sorted(n for n in {*self.paths, *self.buffers} if n.endswith(".safetensors"))
        if not names:
            raise ConvertError(f"{self.source}: no .safetensors file (only safetensors checkpoints are supported)")
        return ShardedSafetensors({n: self.safetensors(n) for n in names})


# ---------------------------------------------------------------------------------------------
# Ternary weights
# ---------------------------------------------------------------------------------------------


def unpack_hf_ternary(packed: np.ndarray) -> np.ndarray:
    """transformers' packing along dim 0: (out/4, in) uint8 -> int8 values (out, in)."""
    return hf_packed_codes(packed).view(np.int8) - np.int8(1)


def hf_packed_codes(packed: np.ndarray) -> np.ndarray:
    """(out/4, in) uint8 packed along dim 0 -> (out, in) uint8 codes 0/1/2 (= value + 1, as in I2_S)."""
    rows = packed.shape[0]
    out = np.empty((4 * rows, *packed.shape[1:]), dtype=np.uint8)
    for i in range(4):
        np.bitwise_and(packed >> np.uint8(2 * i), np.uint8(3), out=out[i * rows : (i + 1) * rows])
    return out


def permute_for_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation: rotate-half (NEOX) pair order -> interleaved pairs."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, 2, out // n_heads // 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def linear_header(
    weights: ShardedSafetensors, key: str, out_features: int, in_features: int, linear_class: str
) -> tuple[bool, float | None]:
    """(packed?, multiplying scale or None) of one HF Linear `key`, from the safetensors headers and its
    weight_scale: what can be refused before any weight is read."""
    wname, sname = f"{key}.weight", f"{key}.weight_scale"
    st = weights.file(wname)
    shape, dtype = st.shape(wname), st.dtype(wname)
    scale = None
    if sname in weights:
        s = weights.file(sname).float32(sname).reshape(-1)
        if s.size != 1 or not np.isfinite(s[0]) or s[0] <= 0:
            raise ConvertError(f"{st.source}: {sname} is {s.tolist()[:4]}, expected one positive number")
        scale = float(s[0]) if linear_class == "autobitlinear" else 1.0 / float(s[0])
    if dtype in ("U8", "I8") and shape == (out_features // 4, in_features) and out_features % 4 == 0:
        if scale is None:
            raise ConvertError(f"{st.source}: packed {wname} has no {sname}")
        return True, scale
    if shape != (out_features, in_features):
        raise ConvertError(
            f"{st.source}: {wname} has shape {list(shape)} {dtype}, expected [{out_features}, "
            f"{in_features}] (or packed uint8 [{out_features // 4}, {in_features}])"
        )
    if dtype not in ("F32", "F16", "BF16", "F64"):
        raise ConvertError(f"{st.source}: {wname} has dtype {dtype}, expected a float type or packed uint8")
    return False, scale


def linear_ternary_codes(
    weights: ShardedSafetensors, key: str, out_features: int, in_features: int, linear_class: str
) -> tuple[np.ndarray, float]:
    """(uint8 codes (out, in) = value + 1, multiplying scale) of one HF Linear `key`."""
    packed, scale = linear_header(weights, key, out_features, in_features, linear_class)
    wname = f"{key}.weight"
    st = weights.file(wname)
    if packed:
        codes = st.array(wname).view(np.uint8)
        bad = (codes & (codes >> 1) & 0x55) != 0
        if bad.any():
            raise ConvertError(
                f"{st.source}: {wname} holds code 3 (packed byte index "
                f"{int(np.argmax(bad.reshape(-1)))}); not a ternary packed weight"
            )
        return hf_packed_codes(codes), scale
    w = st.float32(wname)
    if scale is not None:
        values = np.rint(w)
        if not np.array_equal(values, w) or np.abs(values).max() > 1:
            raise ConvertError(f"{st.source}: {wname} has a weight_scale but its values are not -1/0/+1")
        return (values + 1).astype(np.uint8), scale
    values, absmean = ternarize(w)
    return (values + 1).view(np.uint8), absmean


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def _is_byte_level(data: dict) -> bool:
    return "ByteLevel" in json.dumps([data.get("pre_tokenizer"), data.get("decoder")])


def chat_template_text(files: CheckpointFiles) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's (a string, or the 'default'
    entry of a list of named templates)."""
    if files.has(CHAT_TEMPLATE_FILE):
        return files.text(CHAT_TEMPLATE_FILE)
    if not files.has(TOKENIZER_CONFIG_FILE):
        return None
    template = files.json(TOKENIZER_CONFIG_FILE).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def tokenizer_metadata(files: CheckpointFiles, vocab_size: int, config: dict) -> dict[str, object]:
    """gpt2 BPE metadata from tokenizer.json; ids missing from it become unused '[PAD{id}]' tokens."""
    label = files.label(TOKENIZER_FILE)
    data = files.json(TOKENIZER_FILE)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ConvertError(f"{label}: tokenizer model {model.get('type')!r}; only byte-level BPE is supported")
    if not _is_byte_level(data):
        raise ConvertError(
            f"{label}: a BPE tokenizer without a ByteLevel pre-tokenizer/decoder "
            "(SentencePiece style); only byte-level BPE (GPT-2 / Llama 3 style) is supported"
        )
    try:
        vocab = hf_vocab(data, vocab_size, label)
    except TokenizerError as e:
        raise ConvertError(str(e)) from None
    tokens = [text or f"[PAD{tid}]" for tid, text in enumerate(vocab.tokens)]
    types = np.array(vocab.types, dtype=np.int32)
    merges = vocab.merges or []
    by_text = vocab.added

    tok_config = files.json(TOKENIZER_CONFIG_FILE) if files.has(TOKENIZER_CONFIG_FILE) else {}

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
    if model.get("ignore_merges") is True:
        # llama.cpp (and our reader) turn ignore_merges on for this pre-tokenizer type only; it is the
        # name llama.cpp's converter writes for the Llama 3 vocabulary.
        md[Keys.TOKENIZER_PRE] = "llama-bpe"
    bos, eos = special_id("bos"), special_id("eos")
    if bos is not None:
        md[Keys.BOS_ID] = bos
    if eos is not None:
        md[Keys.EOS_ID] = eos
        md[Keys.PAD_ID] = eos
    md[Keys.ADD_BOS] = bool(tok_config.get("add_bos_token", bos is not None))
    template = chat_template_text(files)
    if template is not None:
        md[Keys.CHAT_TEMPLATE] = template
    return md


# ---------------------------------------------------------------------------------------------
# config.json -> what to build
# ---------------------------------------------------------------------------------------------

_HF_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_HF_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_sub_norm": "self_attn.attn_sub_norm",
    "ffn_sub_norm": "mlp.ffn_sub_norm",
}
_SUB_NORMS = ("attn_sub_norm", "ffn_sub_norm")


# config.json keys that are counts or sizes: a value of another type is named, not a bare int() error.
_INT_CONFIG = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)


def _cfg(config: dict, key: str, label: str) -> int:
    """A required integer of config.json."""
    if key not in config or config[key] is None:
        raise ConvertError(f"{label}: missing {key!r}")
    _check_int(config, key, label)
    return config[key]


def _check_int(config: dict, key: str, label: str) -> None:
    value = config.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConvertError(f"{label}: {key!r} is {value!r}; expected a non-negative integer")


def _rope_scaling(config: dict) -> str | None:
    """The RoPE scaling type if any (the engine implements plain RoPE only)."""
    for section in (config.get("rope_scaling"), config.get("rope_parameters")):
        if isinstance(section, dict):
            kind = section.get("rope_type") or section.get("type")
            if kind not in (None, "default"):
                return str(kind)
    return None


def _model_kind(config: dict, label: str, arch: str | None) -> tuple[str, bool]:
    """(GGUF architecture, lossy) for the model in config.json."""
    model_type = config.get("model_type")
    quant = config.get("quantization_config") or {}
    act = config.get("hidden_act", "relu2" if model_type in (None, "bitnet") else "silu")
    if model_type in (None, "bitnet"):
        default = {"relu2": "bitnet-b1.58", "silu": "bitnet"}.get(act)
        if default is None and arch is None:
            raise ConvertError(f"{label}: hidden_act {act!r} is neither relu2 nor silu")
        return arch or default, False
    if model_type == "llama":
        if act != "silu":
            raise ConvertError(f"{label}: a llama model with hidden_act {act!r}; only silu is supported")
        return arch or "llama", quant.get("quant_method") != "bitnet"
    raise ConvertError(
        f"{label}: model_type {model_type!r} is not supported (bitnet, or llama: BitNet "
        "variants, or ordinary ones with lossy ternarization)"
    )


def _linear_class(config: dict, label: str) -> str:
    """How weight_scale is used: transformers' BitNetQuantConfig defaults to 'bitlinear' (divides)."""
    quant = config.get("quantization_config") or {}
    if not quant:
        return "autobitlinear"
    if quant.get("quant_method") != "bitnet":
        raise ConvertError(
            f"{label}: quantization_config.quant_method {quant.get('quant_method')!r} is not supported (only 'bitnet')"
        )
    if quant.get("use_rms_norm"):
        raise ConvertError(
            f"{label}: quantization_config.use_rms_norm (an RMSNorm inside every BitLinear) is not supported"
        )
    skipped = [m for m in quant.get("modules_to_not_convert") or [] if "lm_head" not in m]
    if skipped:
        raise ConvertError(
            f"{label}: quantization_config.modules_to_not_convert keeps {skipped[:3]} in full "
            "precision; only ternary decoder Linears are supported"
        )
    linear_class = quant.get("linear_class", "bitlinear")
    if linear_class not in ("autobitlinear", "bitlinear"):
        raise ConvertError(f"{label}: quantization_config.linear_class {linear_class!r} is not supported")
    return linear_class


class ConfigCheck(NamedTuple):
    arch: str  # the GGUF architecture the checkpoint becomes
    lossy: bool  # an ordinary checkpoint, ternarized by absmean (opt-in)
    linear_class: str  # how weight_scale is used: 'autobitlinear' multiplies, 'bitlinear' divides
    warning: str | None  # general.description of a lossy GGUF


_REQUIRED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def check_config(
    config: dict, label: str = CONFIG_FILE, *, arch: str | None = None, allow_lossy_ternarization: bool = False
) -> ConfigCheck:
    """Everything config.json alone decides, checked before any weights are read: the browser calls this
    as soon as config.json has arrived, so an unsupported model is refused before gigabytes of shards are
    fetched. Raises ConvertError (LossyTernarizationError without the opt-in) naming `label`."""
    for key in _REQUIRED_CONFIG:
        _cfg(config, key, label)
    for key in _INT_CONFIG:
        _check_int(config, key, label)
    arch, lossy = _model_kind(config, label, arch)
    head_dim, n_heads, dim = config.get("head_dim"), config["num_attention_heads"], config["hidden_size"]
    if not isinstance(head_dim, int) and isinstance(n_heads, int) and isinstance(dim, int) and n_heads > 0:
        head_dim = dim // n_heads
    problem = head_dim_problem(head_dim) if isinstance(head_dim, int) else None
    if problem:  # the engine's one shape limit, said before any weight is read
        raise ConvertError(f"{label}: {problem}")
    linear_class = _linear_class(config, label)
    warning = None
    if lossy:
        if not allow_lossy_ternarization:
            raise LossyTernarizationError(
                f"{label}: an ordinary {config.get('model_type')} checkpoint (no BitNet "
                "quantization_config). Ternarizing it is lossy post-training quantization and needs an "
                "explicit opt-in (allow_lossy_ternarization=True, CLI --ternarize-lossy, in the app the "
                "EXPERIMENTAL, LOSSY box under the URL)"
            )
        warning = LOSSY_WARNING.format(name=config.get("model_type"))
    scaling = _rope_scaling(config)
    if scaling is not None:
        if not lossy:
            raise ConvertError(f"{label}: RoPE scaling {scaling!r} is not supported (plain RoPE only)")
        warning += f" Its RoPE scaling {scaling!r} is ignored (plain RoPE), a further inaccuracy."
    return ConfigCheck(arch, lossy, linear_class, warning)


# ---------------------------------------------------------------------------------------------
# Checkpoint -> GGUFWriter (the one code path of convert_hf.convert and the in-memory loaders)
# ---------------------------------------------------------------------------------------------


def build_gguf_writer(
    files: CheckpointFiles,
    out_path: str = "<memory>",
    *,
    embed_type: str = "F16",
    arch: str | None = None,
    name: str | None = None,
    allow_lossy_ternarization: bool = False,
    progress: ProgressCallback | None = None,
) -> tuple[GGUFWriter, dict[str, object]]:
    """A GGUFWriter for the checkpoint (tensor data produced only when written) and a summary dict.

    Options as `convert_hf.convert`; `progress('convert', i, n)` is called as tensor i starts.
    """
    cfg_label = files.label(CONFIG_FILE)
    config = files.json(CONFIG_FILE)
    for key in _INT_CONFIG:
        _check_int(config, key, cfg_label)
    dim = int(_cfg(config, "hidden_size", cfg_label))
    n_layers = int(_cfg(config, "num_hidden_layers", cfg_label))
    n_heads = int(_cfg(config, "num_attention_heads", cfg_label))
    n_kv_heads = int(config.get("num_key_value_heads") or n_heads)
    ffn_dim = int(_cfg(config, "intermediate_size", cfg_label))
    vocab_size = int(_cfg(config, "vocab_size", cfg_label))
    head_dim = int(config.get("head_dim") or dim // n_heads)
    rope = config.get("rope_parameters") or {}
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    arch, lossy, linear_class, warning = check_config(
        config, cfg_label, arch=arch, allow_lossy_ternarization=allow_lossy_ternarization
    )
    if embed_type not in ("F16", "F32", "BF16"):
        raise ValueError(f"embed_type must be F16, F32 or BF16, not {embed_type!r}")
    model_name = name or files.name
    # llama-arch GGUFs hold Q/K rows in interleaved-RoPE order.
    permute = arch == "llama"

    weights = files.weights()
    embd_name = "model.embed_tokens.weight"
    embd_shape = weights.file(embd_name).shape(embd_name)
    if embd_shape != (vocab_size, dim):
        raise ConvertError(f"{files.source}: {embd_name} has shape {list(embd_shape)}, expected [{vocab_size}, {dim}]")
    untied = "lm_head.weight" in weights and not config.get("tie_word_embeddings", False)

    writer = GGUFWriter(str(out_path))
    writer.add_dict(
        bitnet_model_metadata(
            arch,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_dim=ffn_dim,
            vocab_size=vocab_size,
            context_length=int(config.get("max_position_embeddings", 4096)),
            rope_theta=rope_theta,
            norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            head_dim=head_dim,
            name=model_name,
        )
    )
    if head_dim * n_heads != dim:
        writer.add(Keys.arch(Keys.KEY_LENGTH, arch), head_dim)
        writer.add(Keys.arch(Keys.VALUE_LENGTH, arch), head_dim)
    if warning is not None:
        writer.add(DESCRIPTION_KEY, warning)
        writer.add(LOSSY_KEY, True)
    if files.has(TOKENIZER_FILE):
        writer.add_dict(tokenizer_metadata(files, vocab_size, config))
    else:
        writer.add_dict(synthetic_vocab_metadata(vocab_size))

    float_type = GGMLType[embed_type]
    started = [0]  # tensors whose data was requested so far

    def reported(make: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            if progress:
                progress("convert", started[0], len(writer.tensors))
            started[0] += 1
            return make()

        return run

    def embedding_tensor(hf_name: str):
        # Row chunks, so a 128256 x 2560 bf16 embedding never exists as one float32 array.
        def chunks():
            st = weights.file(hf_name)
            if st.dtype(hf_name) not in ("F32", "F16", "BF16"):
                raise ConvertError(f"{st.source}: {hf_name} has dtype {st.dtype(hf_name)}, expected F32/F16/BF16")
            n_rows, n_cols = st.shape(hf_name)
            rows = max(1, (1 << 22) // max(1, n_cols))
            for start in range(0, n_rows, rows):
                yield st.float32_rows(hf_name, slice(start, start + rows))

        return chunks

    def norm_tensor(hf_name: str):
        return lambda: weights.file(hf_name).float32(hf_name)

    def ternary_tensor(key: str, out_f: int, in_f: int, heads: int | None):
        def make() -> np.ndarray:
            codes, scale = linear_ternary_codes(weights, key, out_f, in_f, linear_class)
            if permute and heads is not None:
                codes = permute_for_interleaved_rope(codes, heads)
            if codes.size % I2S_BLOCK:
                raise ConvertError(
                    f"{files.source}: {key}.weight has {codes.size} values, not whole I2_S blocks of {I2S_BLOCK}"
                )
            return i2s_pack_codes(codes, scale)

        return make

    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    shapes = {
        "attn_q": (q_dim, dim),
        "attn_k": (kv_dim, dim),
        "attn_v": (kv_dim, dim),
        "attn_output": (dim, q_dim),
        "ffn_gate": (ffn_dim, dim),
        "ffn_up": (ffn_dim, dim),
        "ffn_down": (dim, ffn_dim),
    }
    heads_of = {"attn_q": n_heads, "attn_k": n_kv_heads}

    writer.add_tensor(TOKEN_EMBD, (vocab_size, dim), float_type, reported(embedding_tensor(embd_name)))
    known = {embd_name, "model.norm.weight", "lm_head.weight"}
    for i in range(n_layers):
        hf = f"model.layers.{i}."
        for short, hf_norm in _HF_NORMS.items():
            hf_name = hf + hf_norm + ".weight"
            gguf_name = block_tensor(i, short)
            if short in _SUB_NORMS and arch == "llama" and hf_name not in weights:
                continue  # llama-layout BitNets may have no sub-norms
            shape = weights.file(hf_name).shape(hf_name)
            writer.add_tensor(gguf_name, shape, GGMLType.F32, reported(norm_tensor(hf_name)))
            known.add(hf_name)
        for short, hf_lin in _HF_LINEARS.items():
            key = hf + hf_lin
            out_f, in_f = shapes[short]
            linear_header(weights, key, out_f, in_f, linear_class)  # refused before any weight is read
            writer.add_tensor(
                block_tensor(i, short),
                shapes[short],
                GGMLType.I2_S,
                reported(ternary_tensor(key, out_f, in_f, heads_of.get(short))),
            )
            known.update({key + ".weight", key + ".weight_scale"})
    writer.add_tensor(OUTPUT_NORM, (dim,), GGMLType.F32, reported(norm_tensor("model.norm.weight")))
    if untied:
        writer.add_tensor(OUTPUT, (vocab_size, dim), float_type, reported(embedding_tensor("lm_head.weight")))
    unknown = sorted(n for n in weights if n not in known and "rotary_emb" not in n)
    if unknown:
        raise ConvertError(
            f"{files.source}: unexpected tensors in the checkpoint (e.g. {unknown[:3]}); "
            f"not a {'LlamaForCausalLM' if arch == 'llama' else 'BitNetForCausalLM'} layout "
            "this loader knows"
        )
    summary = {
        "path": str(out_path),
        "arch": arch,
        "tensors": len(writer.tensors),
        "untied": untied,
        "tokenizer": TOKENIZER_FILE if files.has(TOKENIZER_FILE) else "synthetic",
        "lossy": lossy,
        "linear_class": linear_class,
    }
    return writer, summary


# ---------------------------------------------------------------------------------------------
# Loading into memory
# ---------------------------------------------------------------------------------------------


def load_files(
    files: CheckpointFiles,
    *,
    allow_lossy_ternarization: bool = False,
    embed_type: str = "F16",
    progress: ProgressCallback | None = None,
) -> GGUFFile:
    """The checkpoint as the model loads it (ready for Engine.load / load_async): what its GGUF would
    hold, with no GGUF bytes; each tensor is converted when the model reads it (`UnwrittenFile`), so
    memory holds the checkpoint's files and one converted tensor, never a converted copy of it all."""
    writer, _ = build_gguf_writer(files, embed_type=embed_type, allow_lossy_ternarization=allow_lossy_ternarization)
    if progress:
        progress("convert", len(writer.tensors), len(writer.tensors))
    return writer.as_file(source=files.source)


def load_from_buffers(
    files: Mapping[str, np.ndarray | bytes | bytearray | memoryview],
    *,
    name: str = "model",
    allow_lossy_ternarization: bool = False,
    embed_type: str = "F16",
    progress: ProgressCallback | None = None,
) -> GGUFFile:
    """The browser's entry point: {file name: downloaded bytes (uint8 array)} -> GGUFFile.

    `files` holds what `files_to_fetch` listed (optional files may be absent). `name` becomes
    general.name (e.g. 'microsoft/bitnet-b1.58-2B-4T'). The returned file keeps the buffers: its tensors
    are converted from them when the model reads them.
    """
    return load_files(
        CheckpointFiles(name, buffers=files),
        embed_type=embed_type,
        progress=progress,
        allow_lossy_ternarization=allow_lossy_ternarization,
    )


def load_folder(
    folder: str | os.PathLike,
    *,
    allow_lossy_ternarization: bool = False,
    embed_type: str = "F16",
    progress: ProgressCallback | None = None,
) -> GGUFFile:
    """A checkpoint folder on disk -> GGUFFile (the safetensors files are memory-mapped)."""
    return load_files(
        CheckpointFiles.from_folder(folder),
        embed_type=embed_type,
        progress=progress,
        allow_lossy_ternarization=allow_lossy_ternarization,
    )


def _is_not_found(exc: BaseException) -> bool:
    cause = exc.__cause__
    return getattr(cause, "code", None) == 404


def download_checkpoint(url: str, progress: ProgressCallback | None = None) -> CheckpointFiles:
    """Download (or find in the cache) the files of a checkpoint folder URL (CPython)."""
    from ..sources import DownloadError, cached_path, download_to_cache

    base = checkpoint_base_url(url)
    if base is None:
        raise ConvertError(f"{url}: not a checkpoint folder URL (expected .../ORG/REPO or .../resolve/main/)")

    def fetch(fname: str, optional: bool) -> Path | None:
        # an optional file's 404 is remembered too, so a cached checkpoint loads with no request at all
        absent = cached_path(base + fname).with_suffix(".absent")
        if optional and absent.exists():
            return None
        try:
            return download_to_cache(base + fname, progress=progress)
        except DownloadError as e:
            if optional and _is_not_found(e):
                absent.touch()
                return None
            raise

    if cached_path(base + WEIGHTS_FILE).exists():
        index = None
    else:
        index_path = fetch(INDEX_FILE, optional=True)
        index = None
        if index_path is not None:
            try:
                index = json.loads(index_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"{base}{INDEX_FILE}: not JSON ({e})") from None
    paths: dict[str, Path] = {}
    for fname in files_to_fetch(index):
        path = fetch(fname, optional=fname in OPTIONAL_FILES)
        if path is not None:
            paths[fname] = path
    return CheckpointFiles(checkpoint_name(base), paths=paths, source=base)


def load(
    location: str | os.PathLike, *, allow_lossy_ternarization: bool = False, progress: ProgressCallback | None = None
) -> GGUFFile:
    """A checkpoint folder path or folder URL (downloaded once into the cache) -> GGUFFile (CPython)."""
    text = os.fspath(location)
    if isinstance(text, str) and text.startswith(("http://", "https://")):
        files = download_checkpoint(text, progress=progress)
    else:
        files = CheckpointFiles.from_folder(location)
    return load_files(files, allow_lossy_ternarization=allow_lossy_ternarization, progress=progress)
