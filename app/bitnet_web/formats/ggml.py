"""Every GGUF / GGML fact in one place: magic, versions, value and tensor types, type sizes, keys, errors.

The reader, the writer, the codecs and the converters import from here and from nowhere else for
these facts (the same role as gguf-py's constants.py). numpy + stdlib only.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
# Arrays of arrays are legal GGUF, but real files nest at most once; a hostile file could nest
# thousands deep (12 bytes per level) and exhaust Python's recursion limit.
GGUF_MAX_ARRAY_NESTING = 16


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class GGUFError(Exception):
    """Any problem with a GGUF file. Messages name the byte offset and the field."""


class GGUFTruncatedError(GGUFError):
    """The file ends before a field it announces."""


class GGUFFormatError(GGUFError):
    """The bytes are not a valid GGUF file (bad magic, lying lengths, overlapping tensors...)."""


class GGUFUnsupportedError(GGUFError):
    """A valid file using something this reader does not handle (version 1, unknown tensor type)."""


class GGUFLengthError(GGUFTruncatedError, GGUFFormatError):
    """A length or count field claims more bytes than remain: a truncated file or a lying field.

    Raised before anything proportional to the claimed length is allocated.
    """


# ---------------------------------------------------------------------------------------------
# Type tables
# ---------------------------------------------------------------------------------------------


class GGUFValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# Fixed-size value types -> little-endian numpy dtype.
VALUE_DTYPES: dict[GGUFValueType, np.dtype] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}

# Smallest encoding of one value of each type, used to reject lying array lengths before reading.
MIN_VALUE_BYTES: dict[GGUFValueType, int] = {
    **{t: d.itemsize for t, d in VALUE_DTYPES.items()},
    GGUFValueType.STRING: 8,  # u64 length, empty string
    GGUFValueType.ARRAY: 4 + 8,  # u32 element type + u64 count, empty array
}


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q8_0 = 8
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    I2_S = 36  # bitnet.cpp fork only: upstream ggml does not know 36


QK_K = 256
# I2_S (bitnet.cpp): 2-bit codes, x86 layout in blocks of 128 values per 32 bytes (ARM builds: 64 per
# 16); after a tensor's n/4 code bytes one float32 scale and 28 zero bytes (formats/quants.py).
I2S_BLOCK = 128  # values per x86 block (32 bytes); rows hold whole blocks
I2S_BLOCK_ARM = 64  # values per ARM block (16 bytes)
I2S_TAIL_BYTES = 32  # float32 scale + 28 bytes padding after the packed codes


class TypeSize(NamedTuple):
    block: int  # values per block: a row holds whole blocks
    type_size: int  # bytes per block
    tensor_tail: int = 0  # bytes once per tensor after its blocks


# Each size written as the sum of its parts. I2_S is not block-quantized in ggml's sense: it packs
# 4 values per byte and appends one float32 scale plus padding per TENSOR. How each type's bytes
# become values: the codec table, formats/quants.CODECS.
GGML_TYPE_SIZES: dict[GGMLType, TypeSize] = {
    GGMLType.F32: TypeSize(1, 4),
    GGMLType.F16: TypeSize(1, 2),
    GGMLType.BF16: TypeSize(1, 2),
    GGMLType.Q8_0: TypeSize(32, 2 + 32),  # f16 d + 32 x int8
    GGMLType.TQ1_0: TypeSize(QK_K, (QK_K - 4 * QK_K // 64) // 5 + QK_K // 64 + 2),  # qs[48] + qh[4] + f16 d
    GGMLType.TQ2_0: TypeSize(QK_K, QK_K // 4 + 2),  # qs[64] + f16 d
    GGMLType.I2_S: TypeSize(4, 1, I2S_TAIL_BYTES),
}


def tensor_nbytes(ggml_type: GGMLType, n_elements: int) -> int:
    """Bytes a tensor of `n_elements` values occupies (without alignment padding)."""
    size = GGML_TYPE_SIZES[ggml_type]
    return n_elements // size.block * size.type_size + size.tensor_tail


class TokenType(IntEnum):
    """`tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# ---------------------------------------------------------------------------------------------
# Tensor names (llama.cpp's LLM_TENSOR_NAMES for the llama / bitnet archs)
# ---------------------------------------------------------------------------------------------

TOKEN_EMBD = "token_embd.weight"  # (n_vocab, n_embd)
OUTPUT_NORM = "output_norm.weight"  # (n_embd,)
OUTPUT = "output.weight"  # (n_vocab, n_embd): the LM head, absent when it is tied to token_embd
# Per-layer tensors, named blk.{i}.{short}.weight; the sub-norms are BitNet's (absent in llama files).
BLOCK_TENSORS = (
    "attn_norm",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_sub_norm",
    "ffn_norm",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ffn_sub_norm",
)


def block_prefix(i: int) -> str:
    """The start of layer i's tensor names: block_prefix(i) + short + '.weight'."""
    return f"blk.{i}."


def block_tensor(i: int, short: str) -> str:
    """Layer i's tensor `short` (one of BLOCK_TENSORS): 'blk.{i}.{short}.weight'."""
    return f"{block_prefix(i)}{short}.weight"


# ---------------------------------------------------------------------------------------------
# Metadata keys (one namespace; "{arch}" is replaced by general.architecture)
# ---------------------------------------------------------------------------------------------


class Keys:
    ARCHITECTURE = "general.architecture"
    NAME = "general.name"
    ALIGNMENT = "general.alignment"
    FILE_TYPE = "general.file_type"
    QUANTIZATION_VERSION = "general.quantization_version"

    VOCAB_SIZE = "{arch}.vocab_size"
    CONTEXT_LENGTH = "{arch}.context_length"
    EMBEDDING_LENGTH = "{arch}.embedding_length"
    BLOCK_COUNT = "{arch}.block_count"
    FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
    HEAD_COUNT = "{arch}.attention.head_count"
    HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
    KEY_LENGTH = "{arch}.attention.key_length"
    VALUE_LENGTH = "{arch}.attention.value_length"
    LAYERNORM_RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
    ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
    ROPE_FREQ_BASE = "{arch}.rope.freq_base"

    TOKENIZER_MODEL = "tokenizer.ggml.model"
    TOKENIZER_PRE = "tokenizer.ggml.pre"
    TOKENS = "tokenizer.ggml.tokens"
    TOKEN_TYPE = "tokenizer.ggml.token_type"
    SCORES = "tokenizer.ggml.scores"
    MERGES = "tokenizer.ggml.merges"
    BOS_ID = "tokenizer.ggml.bos_token_id"
    EOS_ID = "tokenizer.ggml.eos_token_id"
    EOT_ID = "tokenizer.ggml.eot_token_id"
    UNK_ID = "tokenizer.ggml.unknown_token_id"
    PAD_ID = "tokenizer.ggml.padding_token_id"
    ADD_BOS = "tokenizer.ggml.add_bos_token"
    ADD_EOS = "tokenizer.ggml.add_eos_token"
    CHAT_TEMPLATE = "tokenizer.chat_template"

    @staticmethod
    def arch(key: str, arch: str) -> str:
        """Fill in the architecture prefix: Keys.arch(Keys.BLOCK_COUNT, 'bitnet-b1.58')."""
        return key.format(arch=arch)
