"""Synthetic models for tests and benchmarks: a byte-level vocabulary, BitNet metadata, random BitNet GGUFs.

`random_bitnet_writer` streams each tensor from its own seeded RNG, so any shape (up to 2B-4T) is
written with little memory and the same arguments always give the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from ..formats.ggml import OUTPUT, OUTPUT_NORM, TOKEN_EMBD, GGMLType, GGUFValueType, Keys, TokenType, block_tensor
from ..formats.gguf_writer import GGUFWriter, Typed
from ..formats.quants import random_i2s_bytes
from ..text.bpe import BYTE_TO_UNICODE

# The chat template of microsoft/bitnet-b1.58-2B-4T (tokenizer_config.json): "Role: content<|eot_id|>"
# per message, BOS before the first, "Assistant: " as the generation prompt.
BITNET_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = message['role'] | capitalize + ': '+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)

LLAMA3_BOS, LLAMA3_EOS, LLAMA3_EOT = 128000, 128001, 128009


def synthetic_vocab_metadata(vocab_size: int, *, with_eot_key: bool = False) -> dict[str, object]:
    """A gpt2-style byte-level vocabulary with no merges (every byte is its own token).

    Tokens 0..255: the GPT-2 byte characters (token i is byte i). Then filler tokens "Ġw{i}"
    (decode to " w{i}", never produced by the empty merge list). Special tokens (token_type 3):
    with vocab_size >= 128256 at the Llama 3 ids (<|begin_of_text|> 128000, <|end_of_text|> 128001,
    <|eot_id|> 128009, reserved specials around them), otherwise the last three ids.
    The real 2B-4T file has no eot key; `with_eot_key` adds tokenizer.ggml.eot_token_id.
    """
    if vocab_size < 259:
        raise ValueError(f"vocab_size {vocab_size} too small: 256 byte tokens + 3 special tokens needed")
    b2u = BYTE_TO_UNICODE
    tokens = [b2u[b] for b in range(256)] + [f"Ġw{i}" for i in range(256, vocab_size)]
    token_type = np.full(vocab_size, TokenType.NORMAL, dtype=np.int32)
    if vocab_size >= 128256:
        bos, eos, eot = LLAMA3_BOS, LLAMA3_EOS, LLAMA3_EOT
        for i in range(128000, vocab_size):
            tokens[i] = f"<|reserved_special_token_{i - 128000}|>"
            token_type[i] = TokenType.CONTROL
    else:
        bos, eos, eot = vocab_size - 3, vocab_size - 2, vocab_size - 1
    for tid, text in ((bos, "<|begin_of_text|>"), (eos, "<|end_of_text|>"), (eot, "<|eot_id|>")):
        tokens[tid] = text
        token_type[tid] = TokenType.CONTROL
    md: dict[str, object] = {
        Keys.TOKENIZER_MODEL: "gpt2",
        Keys.TOKENS: tokens,
        Keys.TOKEN_TYPE: token_type,
        Keys.SCORES: np.zeros(vocab_size, dtype=np.float32),
        Keys.MERGES: Typed(GGUFValueType.STRING, [], True),
        Keys.BOS_ID: bos,
        Keys.EOS_ID: eos,
        Keys.PAD_ID: eos,
        Keys.ADD_BOS: True,
        Keys.CHAT_TEMPLATE: BITNET_CHAT_TEMPLATE,
    }
    if with_eot_key:
        md[Keys.EOT_ID] = eot
    return md


def bitnet_model_metadata(
    arch: str,
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    context_length: int,
    rope_theta: float,
    norm_eps: float = 1e-5,
    head_dim: int | None = None,
    name: str = "bitnet-web random",
) -> dict[str, object]:
    """The model keys of the 2B-4T file (types as bitnet.cpp's converter writes them)."""
    head_dim = head_dim or dim // n_heads

    def k(key: str) -> str:
        return Keys.arch(key, arch)

    return {
        Keys.ARCHITECTURE: arch,
        Keys.NAME: name,
        k(Keys.VOCAB_SIZE): vocab_size,
        k(Keys.CONTEXT_LENGTH): context_length,
        k(Keys.EMBEDDING_LENGTH): dim,
        k(Keys.BLOCK_COUNT): n_layers,
        k(Keys.FEED_FORWARD_LENGTH): ffn_dim,
        k(Keys.ROPE_DIMENSION_COUNT): head_dim,
        k(Keys.HEAD_COUNT): n_heads,
        k(Keys.HEAD_COUNT_KV): n_kv_heads,
        k(Keys.LAYERNORM_RMS_EPS): float(norm_eps),
        k(Keys.ROPE_FREQ_BASE): float(rope_theta),
        Keys.FILE_TYPE: 40,
        Keys.QUANTIZATION_VERSION: 2,
    }


def write_random_bitnet(path: str, **kwargs) -> int:
    """Write a random BitNet model as GGUF (arguments: see random_bitnet_writer); returns the size."""
    return random_bitnet_writer(path, **kwargs).write()


def random_bitnet_writer(
    path: str,
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    vocab_size: int,
    context_length: int = 4096,
    seed: int = 0,
    arch: str = "bitnet-b1.58",
    embed_std: float = 1.0,
    tokenizer_metadata: dict[str, object] | None = None,
    rope_theta: float = 500000.0,
    untied: bool = False,
    norm_eps: float = 1e-5,
    sub_norms: bool = True,
    head_dim: int | None = None,
) -> GGUFWriter:
    """A GGUFWriter set up with a random BitNet model (nothing generated until `write()`).

    Weights: uniform random ternary I2_S with per-tensor scale U(0.5, 1.5) / sqrt(2/3 * in_features)
    (so a unit-RMS input gives roughly unit-RMS outputs, keeping deep random models finite).
    Norms: F32 U(0.8, 1.2) (never exactly 1, so a skipped norm changes the output). Embedding
    (and output.weight if `untied`): F16 normal with std `embed_std`. Every tensor is generated
    from its own seeded RNG just before it is written, so memory stays small for any shape.
    """
    head_dim = head_dim or dim // n_heads
    q_dim, kv_dim = n_heads * head_dim, n_kv_heads * head_dim
    w = GGUFWriter(path)
    w.add_dict(
        bitnet_model_metadata(
            arch,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_dim=ffn_dim,
            vocab_size=vocab_size,
            context_length=context_length,
            rope_theta=rope_theta,
            norm_eps=norm_eps,
            head_dim=head_dim,
        )
    )
    w.add_dict(tokenizer_metadata if tokenizer_metadata is not None else synthetic_vocab_metadata(vocab_size))

    counter = iter(range(1 << 30))

    def rng() -> np.random.Generator:
        return np.random.default_rng([seed, next(counter)])

    def embedding(gen: np.random.Generator) -> Callable[[], Iterator[np.ndarray]]:
        def chunks() -> Iterator[np.ndarray]:
            rows = max(1, (1 << 22) // dim)  # ~4M values per chunk
            for start in range(0, vocab_size, rows):
                n = min(rows, vocab_size - start)
                yield (gen.standard_normal((n, dim), dtype=np.float32) * np.float32(embed_std)).astype("<f2")

        return chunks

    def ternary(gen: np.random.Generator, out_f: int, in_f: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            scale = gen.uniform(0.5, 1.5) / np.sqrt(2.0 / 3.0 * in_f)
            return random_i2s_bytes(gen, out_f * in_f, float(scale))

        return make

    def norm(gen: np.random.Generator, n: int) -> Callable[[], np.ndarray]:
        return lambda: gen.uniform(0.8, 1.2, size=n).astype(np.float32)

    w.add_tensor(TOKEN_EMBD, (vocab_size, dim), GGMLType.F16, embedding(rng()))
    for i in range(n_layers):
        w.add_tensor(block_tensor(i, "attn_norm"), (dim,), GGMLType.F32, norm(rng(), dim))
        w.add_tensor(block_tensor(i, "attn_q"), (q_dim, dim), GGMLType.I2_S, ternary(rng(), q_dim, dim))
        w.add_tensor(block_tensor(i, "attn_k"), (kv_dim, dim), GGMLType.I2_S, ternary(rng(), kv_dim, dim))
        w.add_tensor(block_tensor(i, "attn_v"), (kv_dim, dim), GGMLType.I2_S, ternary(rng(), kv_dim, dim))
        w.add_tensor(block_tensor(i, "attn_output"), (dim, q_dim), GGMLType.I2_S, ternary(rng(), dim, q_dim))
        if sub_norms:
            w.add_tensor(block_tensor(i, "attn_sub_norm"), (q_dim,), GGMLType.F32, norm(rng(), q_dim))
        w.add_tensor(block_tensor(i, "ffn_norm"), (dim,), GGMLType.F32, norm(rng(), dim))
        w.add_tensor(block_tensor(i, "ffn_gate"), (ffn_dim, dim), GGMLType.I2_S, ternary(rng(), ffn_dim, dim))
        w.add_tensor(block_tensor(i, "ffn_up"), (ffn_dim, dim), GGMLType.I2_S, ternary(rng(), ffn_dim, dim))
        w.add_tensor(block_tensor(i, "ffn_down"), (dim, ffn_dim), GGMLType.I2_S, ternary(rng(), dim, ffn_dim))
        if sub_norms:
            w.add_tensor(block_tensor(i, "ffn_sub_norm"), (ffn_dim,), GGMLType.F32, norm(rng(), ffn_dim))
    w.add_tensor(OUTPUT_NORM, (dim,), GGMLType.F32, norm(rng(), dim))
    if untied:
        w.add_tensor(OUTPUT, (vocab_size, dim), GGMLType.F16, embedding(rng()))
    return w
