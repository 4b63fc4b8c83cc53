"""Model configuration from GGUF metadata, checked against the tensor table.

Supported architectures (general.architecture):
  bitnet-b1.58, bitnet-25  BitNet b1.58 2B-4T: relu^2 gate, NEOX RoPE, attn/ffn sub-norms,
                           LM head tied to token_embd unless output.weight exists.
  bitnet                   1bitLLM models: SiLU gate, NEOX RoPE, sub-norms, untied if output.weight.
  llama                    Falcon3-Edge style: SiLU gate, interleaved RoPE (Q/K rows permuted by the
                           converter), untied output.weight; sub-norms only if the tensors exist.

Every problem found (missing keys, missing tensors, wrong shapes or types, contradictions) is
collected and reported in one ModelConfigError. Widths, head dims and GQA ratios the kernels do not
take directly are padded / repeated at upload (model/layout.py); the one shape limit left is the
head dim (at most MAX_HEAD_DIM), checked here, so `inspect`, `convert` and loading refuse such a
model before any work.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.ggml import (
    BLOCK_TENSORS,
    OUTPUT,
    OUTPUT_NORM,
    TOKEN_EMBD,
    GGMLType,
    GGUFError,
    Keys,
    block_prefix,
    block_tensor,
)
from ..formats.gguf_reader import GGUFFile
from ..kernels.attention import SUPPORTED_HEAD_DIMS

ARCH_TRAITS: dict[str, dict[str, object]] = {
    # arch: activation, rope_style, sub-norms required (True) or optional (None)
    "bitnet-b1.58": {"activation": "relu2", "rope_style": "neox", "sub_norms": True},
    "bitnet-25": {"activation": "relu2", "rope_style": "neox", "sub_norms": True},
    "bitnet": {"activation": "silu", "rope_style": "neox", "sub_norms": True},
    "llama": {"activation": "silu", "rope_style": "interleaved", "sub_norms": None},
}

TERNARY_TYPES = (GGMLType.I2_S, GGMLType.TQ1_0, GGMLType.TQ2_0)
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)
MAX_HEAD_DIM = max(SUPPORTED_HEAD_DIMS)  # smaller heads are zero-padded up to a supported size
DEFAULT_ROPE_THETA = 10000.0


class ModelConfigError(GGUFError):
    """The GGUF does not describe a model this engine can run; the message lists every problem."""


class HeadWidths:
    """The attention projections' widths, for a dataclass with n_heads, n_kv_heads and head_dim."""

    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig(HeadWidths):
    arch: str
    vocab_size: int  # rows of token_embd (the logits width)
    context_length: int
    dim: int  # embedding width
    n_layers: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_dim: int  # leading dims of each head that get RoPE (= head_dim for BitNet)
    rope_theta: float
    norm_eps: float
    activation: str  # 'relu2' | 'silu'
    rope_style: str  # 'neox' (pairs i, i + d/2) | 'interleaved' (pairs 2i, 2i+1)
    tied_embeddings: bool  # LM head is token_embd (no output.weight)
    has_sub_norms: bool  # attn_sub_norm before attn_output, ffn_sub_norm before ffn_down


def layer_tensor_names(i: int) -> dict[str, str]:
    return {short: block_tensor(i, short) for short in BLOCK_TENSORS}


def _int_key(gguf: GGUFFile, key: str, problems: list[str], required: bool = True) -> int | None:
    v = gguf.metadata.get(key)
    if v is None:
        if required:
            problems.append(f"missing metadata key {key}")
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        problems.append(f"metadata key {key} is {v!r}, expected an integer")
        return None
    if v <= 0:
        problems.append(f"metadata key {key} is {v}, expected > 0")
        return None
    return v


def _float_key(gguf: GGUFFile, key: str, problems: list[str], default: float | None) -> float | None:
    v = gguf.metadata.get(key)
    if v is None:
        if default is None:
            problems.append(f"missing metadata key {key}")
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or v != v or v == float("inf"):
        problems.append(f"metadata key {key} is {v!r}, expected a positive finite number")
        return default
    return float(v)


def config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    """Read and validate the model configuration; raises ModelConfigError listing ALL problems."""
    problems: list[str] = []
    arch = gguf.metadata.get(Keys.ARCHITECTURE)
    if not isinstance(arch, str):
        raise ModelConfigError(
            f"{gguf.source}: missing metadata key {Keys.ARCHITECTURE} (supported: {', '.join(ARCH_TRAITS)})"
        )
    if arch not in ARCH_TRAITS:
        raise ModelConfigError(
            f"{gguf.source}: unsupported architecture {arch!r} (supported: {', '.join(ARCH_TRAITS)})"
        )
    traits = ARCH_TRAITS[arch]

    def k(key: str) -> str:
        return Keys.arch(key, arch)

    n_layers = _int_key(gguf, k(Keys.BLOCK_COUNT), problems)
    dim = _int_key(gguf, k(Keys.EMBEDDING_LENGTH), problems)
    ffn_dim = _int_key(gguf, k(Keys.FEED_FORWARD_LENGTH), problems)
    n_heads = _int_key(gguf, k(Keys.HEAD_COUNT), problems)
    context_length = _int_key(gguf, k(Keys.CONTEXT_LENGTH), problems)
    n_kv_heads = _int_key(gguf, k(Keys.HEAD_COUNT_KV), problems, required=False) or n_heads
    norm_eps = _float_key(gguf, k(Keys.LAYERNORM_RMS_EPS), problems, None)
    rope_theta = _float_key(gguf, k(Keys.ROPE_FREQ_BASE), problems, DEFAULT_ROPE_THETA)

    head_dim = None
    if dim and n_heads:
        head_dim = _int_key(gguf, k(Keys.KEY_LENGTH), problems, required=False)
        if head_dim is None:
            if dim % n_heads:
                problems.append(f"{k(Keys.EMBEDDING_LENGTH)} {dim} is not divisible by {k(Keys.HEAD_COUNT)} {n_heads}")
            else:
                head_dim = dim // n_heads
        value_length = _int_key(gguf, k(Keys.VALUE_LENGTH), problems, required=False)
        if head_dim and value_length not in (None, head_dim):
            problems.append(f"{k(Keys.VALUE_LENGTH)} {value_length} differs from key length {head_dim}")
    if n_heads and n_kv_heads and n_heads % n_kv_heads:
        problems.append(f"{k(Keys.HEAD_COUNT)} {n_heads} is not a multiple of {k(Keys.HEAD_COUNT_KV)} {n_kv_heads}")
    rope_dim = _int_key(gguf, k(Keys.ROPE_DIMENSION_COUNT), problems, required=False) or head_dim
    if rope_dim and head_dim and (rope_dim > head_dim or rope_dim % 2):
        problems.append(f"{k(Keys.ROPE_DIMENSION_COUNT)} {rope_dim} must be even and <= head_dim {head_dim}")
    problem = head_dim_problem(head_dim)
    if problem:
        problems.append(problem)

    tensors = gguf.tensors
    # Vocabulary: rows of token_embd; cross-checked against the vocab_size key and tokenizer tokens.
    vocab_size = None
    embd = tensors.get(TOKEN_EMBD)
    if embd is None:
        problems.append(f"missing tensor {TOKEN_EMBD}")
    else:
        if embd.ggml_type not in FLOAT_TYPES:
            problems.append(f"{TOKEN_EMBD} has type {embd.ggml_type.name}, expected F16/F32/BF16")
        if len(embd.shape) != 2 or (dim and embd.shape[1] != dim):
            problems.append(f"{TOKEN_EMBD} has shape {list(embd.shape)}, expected [n_vocab, {dim}]")
        else:
            vocab_size = embd.shape[0]
    key_vocab = gguf.metadata.get(k(Keys.VOCAB_SIZE))
    tokens = gguf.metadata.get(Keys.TOKENS)
    if vocab_size is None and isinstance(tokens, list):
        vocab_size = len(tokens)
    if vocab_size is not None:
        if isinstance(key_vocab, int) and key_vocab != vocab_size:
            problems.append(f"{k(Keys.VOCAB_SIZE)} is {key_vocab} but {TOKEN_EMBD} has {vocab_size} rows")
        if isinstance(tokens, list) and len(tokens) > vocab_size:
            problems.append(f"tokenizer has {len(tokens)} tokens but the embedding only {vocab_size} rows")

    # Output head.
    output = tensors.get(OUTPUT)
    tied = output is None
    if output is not None:
        if output.ggml_type not in FLOAT_TYPES:
            problems.append(f"{OUTPUT} has type {output.ggml_type.name}, expected F16/F32/BF16")
        if vocab_size and dim and tuple(output.shape) != (vocab_size, dim):
            problems.append(f"{OUTPUT} has shape {list(output.shape)}, expected [{vocab_size}, {dim}]")
    _check_tensor(tensors, OUTPUT_NORM, (dim,), FLOAT_TYPES[:1], problems)

    # Per-layer tensors. Expected shapes are (out, in) in numpy order.
    has_sub_norms = bool(traits["sub_norms"])
    if n_layers and n_layers > len(tensors):
        # A hostile block_count (up to 2^64 - 1) must not drive the per-layer loops below: every
        # layer needs at least 9 tensors, so more layers than tensors is a contradiction on its own.
        problems.append(
            f"{k(Keys.BLOCK_COUNT)} is {n_layers} but the file has only {len(tensors)} tensors "
            "(each layer needs at least 9)"
        )
        n_layers = None
    if n_layers and traits["sub_norms"] is None:
        present = [block_tensor(i, n) in tensors for i in range(n_layers) for n in ("attn_sub_norm", "ffn_sub_norm")]
        has_sub_norms = all(present)
        if any(present) and not all(present):
            problems.append("sub-norm tensors (attn_sub_norm/ffn_sub_norm) exist in some layers but not all")
    if n_layers:
        # Unknown dimensions (missing keys, already reported) leave shapes unchecked but presence
        # and types are still checked, so one message lists everything.
        q_dim = n_heads * head_dim if n_heads and head_dim else None
        kv_dim = n_kv_heads * head_dim if n_kv_heads and head_dim else None
        expected = {
            "attn_norm": ((dim,), FLOAT_TYPES[:1]),
            "attn_q": ((q_dim, dim), TERNARY_TYPES),
            "attn_k": ((kv_dim, dim), TERNARY_TYPES),
            "attn_v": ((kv_dim, dim), TERNARY_TYPES),
            "attn_output": ((dim, q_dim), TERNARY_TYPES),
            "ffn_norm": ((dim,), FLOAT_TYPES[:1]),
            "ffn_gate": ((ffn_dim, dim), TERNARY_TYPES),
            "ffn_up": ((ffn_dim, dim), TERNARY_TYPES),
            "ffn_down": ((dim, ffn_dim), TERNARY_TYPES),
        }
        if has_sub_norms:
            expected["attn_sub_norm"] = ((q_dim,), FLOAT_TYPES[:1])
            expected["ffn_sub_norm"] = ((ffn_dim,), FLOAT_TYPES[:1])
        for i in range(n_layers):
            names = layer_tensor_names(i)
            for short, (shape, types) in expected.items():
                _check_tensor(tensors, names[short], shape, types, problems)
        separate_scales = [n for n in tensors if n.startswith("blk.") and n.endswith(".scale")]
        if separate_scales:
            problems.append(f"separate weight scale tensors ({separate_scales[0]}, ...) are not supported")
        extra_layers = [n for n in tensors if n.startswith(block_prefix(n_layers))]
        if extra_layers:
            problems.append(f"tensor {extra_layers[0]} belongs to a layer beyond block_count {n_layers}")

    if problems:
        raise ModelConfigError(
            f"{gguf.source}: cannot build a {arch} model, {len(problems)} problem(s):\n  " + "\n  ".join(problems)
        )
    return ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        context_length=context_length,
        dim=dim,
        n_layers=n_layers,
        ffn_dim=ffn_dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        rope_theta=rope_theta,
        norm_eps=norm_eps,
        activation=str(traits["activation"]),
        rope_style=str(traits["rope_style"]),
        tied_embeddings=tied,
        has_sub_norms=has_sub_norms,
    )


def head_dim_problem(head_dim: int | None) -> str | None:
    """Why the engine cannot run heads of `head_dim` values, or None (shared with the HF converter)."""
    if head_dim and head_dim > MAX_HEAD_DIM:
        return (
            f"head_dim {head_dim} is larger than {MAX_HEAD_DIM}, the largest head the attention kernels "
            "hold in one workgroup"
        )
    return None


def _check_tensor(tensors: dict, name: str, shape: tuple, types: tuple, problems: list[str]) -> None:
    info = tensors.get(name)
    if info is None:
        problems.append(f"missing tensor {name}")
        return
    if None not in shape and tuple(info.shape) != tuple(shape):
        problems.append(f"tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
    if info.ggml_type not in types:
        problems.append(f"tensor {name} has type {info.ggml_type.name}, expected {'/'.join(t.name for t in types)}")
