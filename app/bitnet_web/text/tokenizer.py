"""Tokenizers for the vocabularies BitNet models ship with, in pure Python.

Two models, chosen by `tokenizer.ggml.model`:

- ``gpt2``: byte-level BPE (Llama 3 and BitNet b1.58 2B-4T). Text is cut into pre-tokens by the
  Llama 3 regex, each pre-token's UTF-8 bytes are mapped to the GPT-2 byte alphabet and merged by
  merge rank. Matches Hugging Face `tokenizers` token for token.
- ``llama``: SentencePiece BPE (1bitLLM models). Spaces become U+2581, one space is prepended
  (llama.cpp's `add_space_prefix`), adjacent symbols merge by the score of the merged piece, and
  characters missing from the vocabulary fall back to ``<0xNN>`` byte tokens. Same algorithm as
  llama.cpp's `llm_tokenizer_spm`.

Special tokens (GGUF token types CONTROL and USER_DEFINED) are recognised in text only when the
caller passes ``allow_special=True``; otherwise their text is tokenized like any other text, so user
input can never smuggle in control tokens.

Imports only the standard library (runs unchanged under Pyodide).
"""

from __future__ import annotations

import codecs
import heapq
import json
import numbers
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

__all__ = [
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenType",
    "llama3_pretokenize",
]


class TokenizerError(ValueError):
    """Vocabulary metadata that cannot make a tokenizer, or a token id out of range."""


class TokenType:
    """GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


_SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED})

# Texts that end a turn in the chat formats we know; any of them present as a special token is a
# stop token (llama.cpp collects the same set into its end-of-generation list).
_END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)

# `tokenizer.ggml.pre` names for which llama.cpp uses the Llama 3 regex (llama-vocab.cpp).
_LLAMA3_PRE_NAMES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon_e", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)

SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space

# Words longer than this many bytes take the O(n log n) BPE path (see Tokenizer._bpe_merge_heap).
_LONG_WORD = 64
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# GPT-2 byte alphabet: each of the 256 byte values gets a printable character, so that byte
# strings can be stored as text in the vocabulary.
# ---------------------------------------------------------------------------------------------


def _byte_to_unicode() -> dict[int, str]:
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("\xa1"), ord("\xac") + 1))
    printable += list(range(ord("\xae"), ord("\xff") + 1))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_UNICODE: dict[int, str] = _byte_to_unicode()
UNICODE_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_UNICODE.items()}
# bytes.translate table: byte value -> its alphabet character, done in C for speed.
_BYTE_TO_UNICODE_TABLE = [BYTE_TO_UNICODE[b] for b in range(256)]


def _bytes_to_alphabet(data: bytes) -> str:
    return "".join([_BYTE_TO_UNICODE_TABLE[b] for b in data])


# ---------------------------------------------------------------------------------------------
# The Llama 3 pre-tokenizer regex, for the standard `re` module.
#
# HF's pattern (Oniguruma syntax):
#   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*
#   |\s*[\r\n]+|\s+(?!\S)|\s+
# Python's `re` has no \p{..}, and its \s also matches U+001C..U+001F, which Oniguruma's does not.
# So the letter, number and space classes are spelled out: letters and numbers from the Unicode
# general categories L* and N* (unicodedata), space as Oniguruma's Unicode \s (checked against HF:
# U+0085 and U+00A0 are spaces; U+001C, U+180E and U+200B are not). Case-insensitive "'s" also
# matches "'ſ" (U+017F case-folds to s), as it does in HF.
# ---------------------------------------------------------------------------------------------

_WHITESPACE_CHARS = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(chr(c) for c in range(0x2000, 0x200B)) + (
    "\u2028\u2029\u202f\u205f\u3000"
)

# Planes 4..13 have never had assigned characters and planes 14..16 hold no letters or numbers,
# so scanning up to U+3FFFF covers every L/N code point while keeping import time low.
_SCAN_LIMIT = 0x40000


def _class_ranges(prefix: str) -> str:
    """Regex character-class body covering every code point whose category starts with `prefix`."""
    parts: list[str] = []
    category = unicodedata.category
    start = -1
    for cp in range(_SCAN_LIMIT + 1):
        inside = cp < _SCAN_LIMIT and category(chr(cp))[0] == prefix
        if inside and start < 0:
            start = cp
        elif not inside and start >= 0:
            end = cp - 1
            parts.append(_escape_cp(start) if start == end else f"{_escape_cp(start)}-{_escape_cp(end)}")
            start = -1
    return "".join(parts)


def _escape_cp(cp: int) -> str:
    return f"\\U{cp:08x}" if cp > 0xFFFF else f"\\u{cp:04x}"


@lru_cache(maxsize=1)
def _llama3_regex() -> re.Pattern[str]:
    letters = _class_ranges("L")
    numbers = _class_ranges("N")
    space = "".join(_escape_cp(ord(c)) for c in _WHITESPACE_CHARS)
    pattern = (
        r"'(?:[sS\u017f]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
        rf"|[^\r\n{letters}{numbers}]?[{letters}]+"
        rf"|[{numbers}]{{1,3}}"
        rf"| ?[^{space}{letters}{numbers}]+[\r\n]*"
        rf"|[{space}]*[\r\n]+"
        rf"|[{space}]+(?![^{space}])"
        rf"|[{space}]+"
    )
    return re.compile(pattern)


def llama3_pretokenize(text: str) -> list[str]:
    """Split `text` into Llama 3 pre-tokens (the pieces BPE runs on separately)."""
    return _llama3_regex().findall(text)


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


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


class Tokenizer:
    """Text <-> token ids for one vocabulary. Build with `from_gguf` or `from_hf_json`."""

    def __init__(
        self,
        *,
        model: str,
        tokens: Sequence[str],
        token_types: Sequence[int] | None = None,
        merges: Sequence[str] | Sequence[Sequence[str]] | None = None,
        scores: Sequence[float] | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        eot_id: int | None = None,
        unk_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = True,
        add_space_prefix: bool = True,
    ) -> None:
        if model not in ("gpt2", "llama"):
            raise TokenizerError(
                f"tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE)"
            )
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer.ggml.tokens is empty")
        self.model = model
        self._tokens: list[str] = [str(t) for t in tokens]
        if token_types is None:
            types = [TokenType.NORMAL] * n
        else:
            types = [int(t) for t in token_types]
            if len(types) != n:
                raise TokenizerError(
                    f"tokenizer.ggml.token_type has {len(types)} entries, tokenizer.ggml.tokens has {n}"
                )
        self._types = types
        self._token_to_id: dict[str, int] = {}
        for i, tok in enumerate(self._tokens):
            # First occurrence wins, as in llama.cpp (duplicates exist in some vocabularies).
            self._token_to_id.setdefault(tok, i)

        for name, value in (("bos", bos_id), ("eos", eos_id), ("eot", eot_id), ("unk", unk_id), ("pad", pad_id)):
            if value is not None and not 0 <= value < n:
                raise TokenizerError(f"tokenizer.ggml.{name}_token_id = {value} is outside the vocabulary (0..{n - 1})")
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.unk_id = unk_id
        self.pad_id = pad_id
        self.add_bos = bool(add_bos)
        self.add_space_prefix = bool(add_space_prefix)
        if eot_id is None:
            eot_id = self._token_to_id.get("<|eot_id|>")
        self.eot_id = eot_id

        stops = {i for i in (eos_id, eot_id) if i is not None}
        for text in _END_OF_TURN_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None and self._types[i] in _SPECIAL_TYPES:
                stops.add(i)
        self.stop_ids: frozenset[int] = frozenset(stops)

        # Special tokens matched in text when allow_special=True: longest first so that a token that
        # is a prefix of another never wins.
        self._special_ids = {i for i, t in enumerate(types) if t in _SPECIAL_TYPES and self._tokens[i]}
        special_texts = sorted({self._tokens[i] for i in self._special_ids}, key=lambda s: (-len(s), s))
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in special_texts) + ")") if special_texts else None
        )

        self._word_cache: dict[str, tuple[int, ...]] = {}
        self._bytes_cache: dict[int, bytes] = {}
        if model == "gpt2":
            if merges is None:
                raise TokenizerError("tokenizer.ggml.merges is missing (required for a 'gpt2' BPE vocabulary)")
            self._ranks = self._parse_merges(merges)
            self._pretokenize = _llama3_regex().findall
        else:
            if scores is None:
                # Without scores, SentencePiece's convention (pieces sorted by score) gives -id.
                self._scores = [-float(i) for i in range(n)]
            else:
                self._scores = [float(s) for s in scores]
                if len(self._scores) != n:
                    raise TokenizerError(
                        f"tokenizer.ggml.scores has {len(self._scores)} entries, tokenizer.ggml.tokens has {n}"
                    )
            self._byte_ids: list[int | None] = [self._token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, object]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*` keys, as the GGUF reader returns them)."""
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("metadata has no 'tokenizer.ggml.model' (this GGUF carries no vocabulary)")
        if not isinstance(model, str):
            raise TokenizerError(
                f"metadata 'tokenizer.ggml.model': expected a string, got {_describe(model)}")
        tokens = _metadata_list(metadata, "tokenizer.ggml.tokens", "s")
        if tokens is None:
            raise TokenizerError("metadata has no 'tokenizer.ggml.tokens'")
        pre = metadata.get("tokenizer.ggml.pre")
        if model == "gpt2" and pre is not None and str(pre) not in _LLAMA3_PRE_NAMES:
            raise TokenizerError(
                f"tokenizer.ggml.pre {pre!r} is not supported: only the Llama 3 pre-tokenizer is implemented "
                f"({', '.join(sorted(_LLAMA3_PRE_NAMES))}, or no tokenizer.ggml.pre as in BitNet b1.58 2B-4T)"
            )
        return cls(
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
        )

    @classmethod
    def from_hf_json(
        cls, tokenizer_json: Mapping[str, object], tokenizer_config: Mapping[str, object] | None = None
    ) -> Tokenizer:
        """Build from a Hugging Face `tokenizer.json` (and optionally `tokenizer_config.json`)."""
        model_section = tokenizer_json.get("model")
        if not isinstance(model_section, Mapping) or model_section.get("type") != "BPE":
            kind = model_section.get("type") if isinstance(model_section, Mapping) else model_section
            raise TokenizerError(f"tokenizer.json: model.type is {kind!r}, only 'BPE' is supported")
        vocab = model_section.get("vocab")
        if not isinstance(vocab, Mapping):
            raise TokenizerError("tokenizer.json: model.vocab is missing or not an object")
        added = tokenizer_json.get("added_tokens") or []
        n = max([int(i) for i in vocab.values()] + [int(a["id"]) for a in added]) + 1  # type: ignore[index]
        tokens = [""] * n
        types = [TokenType.UNUSED] * n
        for text, i in vocab.items():
            tokens[int(i)] = str(text)
            types[int(i)] = TokenType.NORMAL
        for a in added:  # type: ignore[union-attr]
            i = int(a["id"])
            tokens[i] = str(a["content"])
            types[i] = TokenType.CONTROL if a.get("special") else TokenType.USER_DEFINED

        spm = bool(model_section.get("byte_fallback")) or SPM_SPACE in repr(tokenizer_json.get("normalizer")) or (
            "Metaspace" in repr(tokenizer_json.get("pre_tokenizer"))
        )
        if spm:
            for i, text in enumerate(tokens):
                if types[i] == TokenType.NORMAL and re.fullmatch(r"<0x[0-9A-F]{2}>", text):
                    types[i] = TokenType.BYTE
            unk = model_section.get("unk_token")
            if isinstance(unk, str) and unk in vocab:
                types[int(vocab[unk])] = TokenType.UNKNOWN

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
        return cls(
            model="llama" if spm else "gpt2",
            tokens=tokens,
            token_types=types,
            merges=None if spm else model_section.get("merges"),  # type: ignore[arg-type]
            scores=None,
            bos_id=bos_id,
            eos_id=eos_id,
            unk_id=token_id("unk_token"),
            pad_id=token_id("pad_token"),
            add_bos=bool(add_bos),
            add_space_prefix=True,
        )

    @staticmethod
    def _parse_merges(merges: Iterable[str] | Iterable[Sequence[str]]) -> dict[tuple[str, str], int]:
        ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            if isinstance(merge, str):
                left, sep, right = merge.partition(" ")
                if not sep or not left or not right:
                    raise TokenizerError(f"tokenizer.ggml.merges[{rank}] = {merge!r}: expected 'left right'")
            else:
                if len(merge) != 2:
                    raise TokenizerError(f"merges[{rank}] = {merge!r}: expected a pair")
                left, right = str(merge[0]), str(merge[1])
            ranks.setdefault((left, right), rank)
        return ranks

    # -- properties --------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    def token_text(self, token_id: int) -> str:
        """The token as stored in the vocabulary (byte-alphabet or ▁ form)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled exactly `text`, or None."""
        return self._token_to_id.get(text)

    def is_special(self, token_id: int) -> bool:
        self._check_id(token_id)
        return token_id in self._special_ids

    def _check_id(self, token_id: int) -> None:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
            raise TokenizerError(f"token id {token_id!r} is not an integer ({type(token_id).__name__})")
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = False) -> list[int]:
        """Token ids for `text`. Special-token text becomes special tokens only if `allow_special`."""
        return self.encode_segments([(text, allow_special)], add_bos=add_bos)

    def encode_segments(
        self, segments: Iterable[tuple[str, bool]], add_bos: bool = False, continuation: bool = False
    ) -> list[int]:
        """Token ids for text made of parts, special tokens recognised only in parts flagged True.

        Plain text is tokenized across part boundaries as one text, so the result equals
        ``encode("".join(parts), allow_special=True)`` whenever the unflagged parts contain no
        special-token text; where they do, that text stays plain text. Chat templates use this to
        let markup carry control tokens while message contents cannot. `continuation` says the text
        continues earlier tokens (no SentencePiece space prefix at its start).
        """
        ids: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise TokenizerError("add_bos=True but the vocabulary has no tokenizer.ggml.bos_token_id")
            ids.append(self.bos_id)
        pending: list[str] = []
        at_start = not continuation

        def flush_plain() -> None:
            nonlocal at_start
            if pending:
                self._encode_text("".join(pending), ids, at_start)
                pending.clear()
                at_start = False

        for text, allow_special in segments:
            if not text:
                continue
            if allow_special and self._special_re is not None:
                # re.split with one capture group alternates: text, special, text, special, ...
                for k, piece in enumerate(self._special_re.split(text)):
                    if k % 2 == 1:
                        flush_plain()
                        ids.append(self._token_to_id[piece])
                        at_start = True  # llama.cpp: a fragment after a special token counts as a start
                    elif piece:
                        pending.append(piece)
            else:
                pending.append(text)
        flush_plain()
        return ids

    def _encode_text(self, text: str, out: list[int], at_start: bool) -> None:
        if _has_lone_surrogate(text):
            # Not Unicode (a broken paste, bytes decoded with surrogateescape): like the browser's
            # TextEncoder, each lone surrogate becomes U+FFFD instead of failing the whole prompt.
            text = _LONE_SURROGATE.sub("\ufffd", text)
        if self.model == "gpt2":
            self._encode_bpe(text, out)
        else:
            # llama.cpp prefixes a space to a text fragment at the start or right after a special token.
            if self.add_space_prefix and at_start:
                text = " " + text
            self._encode_spm(text, out)

    def _encode_bpe(self, text: str, out: list[int]) -> None:
        cache = self._word_cache
        for word in self._pretokenize(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._bpe_word(word)
                if len(cache) < 200_000:
                    cache[word] = ids
            out.extend(ids)

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        symbols = list(_bytes_to_alphabet(word.encode("utf-8")))
        if len(symbols) > _LONG_WORD:
            return self._symbol_ids(self._bpe_merge_heap(symbols))
        ranks = self._ranks
        # Repeatedly merge the adjacent pair with the lowest merge rank, all its occurrences left to
        # right (the GPT-2 formulation; identical to HF's one-at-a-time heap because a merge that
        # uses a merged symbol always ranks after the merge that made it).
        while len(symbols) > 1:
            best_rank = None
            best_pair = None
            for pair in zip(symbols, symbols[1:], strict=False):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank = rank
                    best_pair = pair
            if best_pair is None:
                break
            left, right = best_pair
            merged: list[str] = []
            i = 0
            n = len(symbols)
            while i < n:
                if i < n - 1 and symbols[i] == left and symbols[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            symbols = merged
        return self._symbol_ids(symbols)

    def _bpe_merge_heap(self, symbols: list[str]) -> list[str]:
        """BPE for long words (a run of letters or CJK can be thousands of bytes): O(n log n) instead
        of the quadratic pass-per-merge above. Merges the lowest-rank adjacent pair, leftmost among
        equals, one at a time, keeping neighbours in linked lists (HF tokenizers' algorithm; the same
        result as the loop above because a merge using a merged symbol ranks after the one making it).
        """
        ranks = self._ranks
        n = len(symbols)
        sym: list[str | None] = list(symbols)
        nxt = list(range(1, n + 1))
        prev = list(range(-1, n - 1))
        heap = [(r, i) for i in range(n - 1) if (r := ranks.get((symbols[i], symbols[i + 1]))) is not None]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = nxt[i]
            # Stale entries: i was merged into its left neighbour, or the pair at i has changed.
            if sym[i] is None or j >= n or ranks.get((sym[i], sym[j])) != rank:  # type: ignore[arg-type]
                continue
            sym[i] = sym[i] + sym[j]  # type: ignore[operator]
            sym[j] = None
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prev[nxt[j]] = i
            for left in (prev[i], i):
                right = nxt[left] if left >= 0 else n
                if right < n:
                    r = ranks.get((sym[left], sym[right]))  # type: ignore[arg-type]
                    if r is not None:
                        heapq.heappush(heap, (r, left))
        return [s for s in sym if s is not None]

    def _symbol_ids(self, symbols: list[str]) -> tuple[int, ...]:
        token_to_id = self._token_to_id
        ids: list[int] = []
        for sym in symbols:
            i = token_to_id.get(sym)
            if i is None:
                # Only possible with a vocabulary that lacks some single byte: fall back per byte.
                for ch in sym:
                    j = token_to_id.get(ch)
                    if j is None:
                        if self.unk_id is None:
                            raise TokenizerError(
                                f"byte {UNICODE_TO_BYTE.get(ch, -1):#04x} has no token and the vocabulary has "
                                "no unknown token"
                            )
                        j = self.unk_id
                    ids.append(j)
            else:
                ids.append(i)
        return tuple(ids)

    def _encode_spm(self, text: str, out: list[int]) -> None:
        """llama.cpp's SentencePiece BPE: merge adjacent symbols whose concatenation is a vocabulary
        piece, highest piece score first (leftmost on ties), then byte fallback for the rest."""
        text = text.replace(" ", SPM_SPACE)
        symbols: list[str | None] = list(text)
        n = len(symbols)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        token_to_id = self._token_to_id
        scores = self._scores
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right >= n:
                return
            merged = symbols[left] + symbols[right]  # type: ignore[operator]
            tid = token_to_id.get(merged)
            if tid is not None:
                heapq.heappush(heap, (-scores[tid], left, right, merged))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            # Skip stale entries: one side was merged away or changed since this pair was queued.
            if symbols[left] is None or symbols[right] is None or nxt[left] != right:
                continue
            if symbols[left] + symbols[right] != merged:  # type: ignore[operator]
                continue
            symbols[left] = merged
            symbols[right] = None
            nxt[left] = nxt[right]
            if nxt[right] < n:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        i = 0
        while i < n:
            sym = symbols[i]
            assert sym is not None
            tid = token_to_id.get(sym)
            if tid is not None:
                out.append(tid)
            else:
                for b in sym.encode("utf-8"):
                    bid = self._byte_ids[b]
                    if bid is None:
                        if self.unk_id is None:
                            raise TokenizerError(
                                f"character {sym!r} has no token, no <0x{b:02X}> byte token, and no unknown token"
                            )
                        bid = self.unk_id
                    out.append(bid)
            i = nxt[i]

    # -- decoding ----------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token stands for in text (special tokens: their text)."""
        cached = self._bytes_cache.get(token_id) if type(token_id) is int else None
        if cached is not None:
            return cached
        self._check_id(token_id)
        token_id = int(token_id)
        text = self._tokens[token_id]
        ttype = self._types[token_id]
        if ttype in _SPECIAL_TYPES:
            data = text.encode("utf-8")
        elif self.model == "gpt2":
            try:
                data = bytes([UNICODE_TO_BYTE[c] for c in text])
            except KeyError:
                # A normal token outside the byte alphabet (not in Llama 3): take it as text.
                data = text.encode("utf-8")
        elif ttype == TokenType.BYTE or re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", text):
            data = bytes([int(text[3:5], 16)])
        elif ttype in (TokenType.UNKNOWN, TokenType.UNUSED):
            data = b""
        else:
            data = text.replace(SPM_SPACE, " ").encode("utf-8")
        self._bytes_cache[token_id] = data
        return data

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`. Invalid UTF-8 left at the end becomes U+FFFD (errors='replace').

        For SentencePiece vocabularies the space that encoding prefixed is removed again, as HF does.
        """
        ids = list(ids)
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self.model == "llama" and self.add_space_prefix and text.startswith(" "):
            first_text = next((i for i in ids if not self.is_special(i)), None)
            if first_text is not None and self.token_bytes(first_text).startswith(b" "):
                text = text[1:]
        return text


class StreamDecoder:
    """Turns generated token ids into text as they arrive, never emitting half a character.

    Tokens of byte-level BPE can end inside a multi-byte UTF-8 character (CJK, emoji); the partial
    bytes are held until the tokens completing them arrive. The concatenation of all `push` results
    and `flush` equals `tokenizer.decode(ids)` (apart from the SentencePiece leading-space rule,
    which the stream does not apply because it continues a prompt).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text completed by it (maybe '')."""
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def flush(self) -> str:
        """End of stream: return what is held back (an incomplete character becomes U+FFFD)."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text
