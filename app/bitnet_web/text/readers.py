"""Tokenizer vocabularies read from GGUF metadata or a Hugging Face tokenizer.json, every field type-checked.

Both readers return the keyword arguments of `Tokenizer(...)`; `Tokenizer.from_gguf` and
`Tokenizer.from_hf_json` call them. Imports only the standard library.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Mapping
from typing import NamedTuple

from ..formats.ggml import TokenType
from .bpe import LLAMA3_PRE_NAMES
from .spm import SPM_SPACE
from .vocab import TokenizerError

# Metadata comes from untrusted files: every key is checked for the type the tokenizer needs, so a
# wrongly typed value is a TokenizerError naming the key, never a TypeError from deep inside.


def _metadata_int(metadata: Mapping[str, object], key: str) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TokenizerError(f"metadata {key!r}: expected an integer token id, got {_describe(value)}")
    return int(value)


def _metadata_bool(metadata: Mapping[str, object], key: str, default: bool) -> bool:
    value = metadata.get(key)
    if value is None:
        return default
    dtype_kind = getattr(getattr(value, "dtype", None), "kind", None)
    numpy_bool = dtype_kind == "b" and getattr(value, "ndim", 1) == 0
    if not (isinstance(value, bool | numbers.Integral) or numpy_bool):
        raise TokenizerError(f"metadata {key!r}: expected a bool, got {_describe(value)}")
    return bool(value)


def _metadata_list(metadata: Mapping[str, object], key: str, kinds: str) -> list | None:
    """An array value as a list: `kinds` is 's' for strings, or numpy dtype kinds ('iu', 'iuf') for
    numbers (the GGUF reader returns numeric arrays as numpy arrays, string arrays as list[str])."""
    value = metadata.get(key)
    if value is None:
        return None
    dtype_kind = getattr(getattr(value, "dtype", None), "kind", None)
    if kinds != "s" and dtype_kind is not None and dtype_kind in kinds and getattr(value, "ndim", 0) == 1:
        return value.tolist()  # type: ignore[union-attr]
    if isinstance(value, list | tuple):
        if kinds == "s":
            ok = all(isinstance(v, str) for v in value)
        else:
            allowed = (numbers.Integral,) if "f" not in kinds else (numbers.Integral, numbers.Real)
            ok = all(isinstance(v, allowed) and not isinstance(v, bool) for v in value)
        if ok:
            return list(value)
    what = "strings" if kinds == "s" else "integers" if "f" not in kinds else "numbers"
    raise TokenizerError(f"metadata {key!r}: expected an array of {what}, got {_describe(value)}")


def _describe(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def gguf_fields(metadata: Mapping[str, object]) -> dict[str, object]:
    """Tokenizer arguments from GGUF metadata (`tokenizer.ggml.*` keys, as the GGUF reader returns them)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise TokenizerError("metadata has no 'tokenizer.ggml.model' (this GGUF carries no vocabulary)")
    if not isinstance(model, str):
        raise TokenizerError(f"metadata 'tokenizer.ggml.model': expected a string, got {_describe(model)}")
    tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", "s")
    if tokens is None:
        raise TokenizerError("metadata has no 'tokenizer.ggml.tokens'")
    pre = metadata.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre is not None and str(pre) not in LLAMA3_PRE_NAMES:
        raise TokenizerError(
            f"tokenizer.ggml.pre {pre!r} is not supported: only the Llama 3 pre-tokenizer is implemented "
            f"({', '.join(sorted(LLAMA3_PRE_NAMES))}, or no tokenizer.ggml.pre as in BitNet b1.58 2B-4T)"
        )
    return dict(
        model=model,
        tokens=tokens,
        token_types=_metadata_list(metadata, "tokenizer.ggml.token_type", "iu"),
        merges=_metadata_list(metadata, "tokenizer.ggml.merges", "s"),
        scores=_metadata_list(metadata, "tokenizer.ggml.scores", "iuf"),
        bos_id=_metadata_int(metadata, "tokenizer.ggml.bos_token_id"),
        eos_id=_metadata_int(metadata, "tokenizer.ggml.eos_token_id"),
        eot_id=_metadata_int(metadata, "tokenizer.ggml.eot_token_id"),
        unk_id=_metadata_int(metadata, "tokenizer.ggml.unknown_token_id"),
        pad_id=_metadata_int(metadata, "tokenizer.ggml.padding_token_id"),
        add_bos=_metadata_bool(metadata, "tokenizer.ggml.add_bos_token", True),
        add_space_prefix=_metadata_bool(metadata, "tokenizer.ggml.add_space_prefix", True),
        # llama.cpp sets ignore_merges for its llama3 pre-tokenizer types (llama-vocab.cpp), as HF's
        # tokenizer.json of those models does; without tokenizer.ggml.pre it stays off there too.
        ignore_merges=model == "gpt2" and pre is not None and str(pre) in LLAMA3_PRE_NAMES,
    )


class HFVocab(NamedTuple):
    """The vocabulary of a Hugging Face tokenizer.json, by token id."""

    tokens: list[str]  # "" where no entry has the id (type UNUSED)
    types: list[int]  # TokenType values
    merges: list[str] | None  # 'left right' (None for a SentencePiece-style vocabulary)
    spm: bool  # SentencePiece style (byte fallback / Metaspace), else byte-level BPE
    ignore_merges: bool
    added: dict[str, int]  # added tokens' text -> id


def hf_vocab(tokenizer_json: Mapping[str, object], size: int | None = None, label: str = "tokenizer.json") -> HFVocab:
    """The one tokenizer.json reader (Tokenizer.from_hf_json, and the checkpoint converter's GGUF metadata).

    `size`: the model's vocabulary size: every model.vocab id must be below it, added tokens at or above
    it are left out (no embedding row), and `tokens` has exactly `size` entries. None: max id + 1.
    Errors are TokenizerError naming `label`.
    """
    model_section = tokenizer_json.get("model")
    if not isinstance(model_section, Mapping) or model_section.get("type") != "BPE":
        kind = model_section.get("type") if isinstance(model_section, Mapping) else model_section
        raise TokenizerError(f"{label}: model.type is {kind!r}, only 'BPE' is supported")
    vocab = model_section.get("vocab")
    if not isinstance(vocab, Mapping):
        raise TokenizerError(f"{label}: model.vocab is missing or not an object")
    added = [a for a in tokenizer_json.get("added_tokens") or [] if isinstance(a, Mapping)]  # type: ignore[union-attr]
    for text, i in [*vocab.items(), *((a.get("content"), a.get("id")) for a in added)]:
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise TokenizerError(f"{label}: token {text!r} has id {i!r}, expected a non-negative integer")
        if size is not None and i >= size and text in vocab:
            raise TokenizerError(f"{label}: token {text!r} has id {i}, outside the model vocabulary {size}")
    if size is None:
        size = max([*vocab.values(), *(a["id"] for a in added)], default=-1) + 1
    tokens = [""] * size
    types = [int(TokenType.UNUSED)] * size
    for text, i in vocab.items():
        tokens[i] = str(text)
        types[i] = int(TokenType.NORMAL)
    by_text: dict[str, int] = {}
    for a in added:
        i = a["id"]
        if i >= size:
            continue  # no embedding row: the model can neither read nor produce it
        tokens[i] = str(a["content"])
        types[i] = int(TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED)
        by_text[tokens[i]] = i

    spm = (
        bool(model_section.get("byte_fallback"))
        or SPM_SPACE in repr(tokenizer_json.get("normalizer"))
        or ("Metaspace" in repr(tokenizer_json.get("pre_tokenizer")))
    )
    if spm:
        for i, text in enumerate(tokens):
            if types[i] == TokenType.NORMAL and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
                types[i] = int(TokenType.BYTE)
        unk = model_section.get("unk_token")
        if isinstance(unk, str) and unk in vocab:
            types[int(vocab[unk])] = int(TokenType.UNKNOWN)

    ignore_merges = model_section.get("ignore_merges", False)
    if not isinstance(ignore_merges, bool):
        raise TokenizerError(f"{label}: model.ignore_merges: expected true or false, got {_describe(ignore_merges)}")
    merges = None
    if not spm and isinstance(model_section.get("merges"), list):
        merges = [m if isinstance(m, str) else " ".join(m) for m in model_section["merges"]]
    return HFVocab(tokens, types, merges, spm, ignore_merges and not spm, by_text)


def hf_fields(
    tokenizer_json: Mapping[str, object], tokenizer_config: Mapping[str, object] | None = None
) -> dict[str, object]:
    """Tokenizer arguments from a Hugging Face `tokenizer.json` (and optionally `tokenizer_config.json`)."""
    vocab = hf_vocab(tokenizer_json)
    tokens, spm = vocab.tokens, vocab.spm

    config = tokenizer_config or {}

    def token_id(key: str) -> int | None:
        value = config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if value is None:
            return None
        try:
            return tokens.index(str(value))
        except ValueError:
            raise TokenizerError(f"tokenizer_config.json: {key} {value!r} is not in the vocabulary") from None

    bos_id = token_id("bos_token")
    eos_id = token_id("eos_token")
    if bos_id is None and "<|begin_of_text|>" in tokens:
        bos_id = tokens.index("<|begin_of_text|>")
    if eos_id is None and "<|end_of_text|>" in tokens:
        eos_id = tokens.index("<|end_of_text|>")
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # HF adds BOS through its post-processor template; absent that, no BOS by default.
        add_bos = bos_id is not None and tokens[bos_id] in json.dumps(tokenizer_json.get("post_processor"))
    return dict(
        model="llama" if spm else "gpt2",
        tokens=tokens,
        token_types=vocab.types,
        merges=vocab.merges,
        scores=None,
        bos_id=bos_id,
        eos_id=eos_id,
        unk_id=token_id("unk_token"),
        pad_id=token_id("pad_token"),
        add_bos=bool(add_bos),
        add_space_prefix=True,
        ignore_merges=vocab.ignore_merges,
    )
