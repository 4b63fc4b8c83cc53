"""Tokenizers for the vocabularies BitNet models ship with, in pure Python.

Two models, chosen by `tokenizer.ggml.model`:

- ``gpt2``: byte-level BPE (Llama 3 and BitNet b1.58 2B-4T), in bpe.py. Matches Hugging Face
  `tokenizers` token for token.
- ``llama``: SentencePiece BPE (1bitLLM models), in spm.py; one space is prepended to a text
  fragment at the start (llama.cpp's `add_space_prefix`). Same algorithm as llama.cpp's
  `llm_tokenizer_spm`.

This module is the facade: special tokens, stop ids, decoding, streaming. The vocabulary readers
(GGUF metadata, tokenizer.json) are in readers.py.

Special tokens (GGUF token types CONTROL and USER_DEFINED) are recognised in text only when the
caller passes ``allow_special=True``; otherwise their text is tokenized like any other text, so user
input can never smuggle in control tokens.

Imports the standard library and formats.ggml (runs unchanged under Pyodide).
"""

from __future__ import annotations

import codecs
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence

from ..formats.ggml import TokenType
from .bpe import UNICODE_TO_BYTE, ByteLevelBPE, llama3_pretokenize
from .readers import gguf_fields, hf_fields
from .spm import SPM_SPACE, SentencePieceBPE
from .vocab import END_OF_TURN_TEXTS, SPECIAL_TYPES, TokenizerError

__all__ = [
    "SPM_SPACE",
    "UNICODE_TO_BYTE",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerError",
    "TokenType",
    "llama3_pretokenize",
]


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


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
        ignore_merges: bool = False,
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
        self.ignore_merges = bool(ignore_merges) and model == "gpt2"
        if eot_id is None:
            eot_id = self._token_to_id.get("<|eot_id|>")
        self.eot_id = eot_id

        stops = {i for i in (eos_id, eot_id) if i is not None}
        for text in END_OF_TURN_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None and self._types[i] in SPECIAL_TYPES:
                stops.add(i)
        self.stop_ids: frozenset[int] = frozenset(stops)

        # Special tokens matched in text when allow_special=True: longest first so that a token that
        # is a prefix of another never wins.
        self._special_ids = {i for i, t in enumerate(types) if t in SPECIAL_TYPES and self._tokens[i]}
        special_texts = sorted({self._tokens[i] for i in self._special_ids}, key=lambda s: (-len(s), s))
        self._special_re = (
            re.compile("(" + "|".join(re.escape(s) for s in special_texts) + ")") if special_texts else None
        )

        self._bytes_cache: dict[int, bytes] = {}
        self._algorithm: ByteLevelBPE | SentencePieceBPE = (
            ByteLevelBPE(self._token_to_id, merges, unk_id, ignore_merges, frozenset(self._special_ids))
            if model == "gpt2"
            else SentencePieceBPE(self._token_to_id, n, scores, unk_id)
        )

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, object]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*` keys, as the GGUF reader returns them)."""
        return cls(**gguf_fields(metadata))

    @classmethod
    def from_hf_json(
        cls, tokenizer_json: Mapping[str, object], tokenizer_config: Mapping[str, object] | None = None
    ) -> Tokenizer:
        """Build from a Hugging Face `tokenizer.json` (and optionally `tokenizer_config.json`)."""
        return cls(**hf_fields(tokenizer_json, tokenizer_config))

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
        if self.model == "llama" and self.add_space_prefix and at_start:
            # llama.cpp prefixes a space to a text fragment at the start or right after a special token.
            text = " " + text
        self._algorithm.encode(text, out)

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
        if ttype in SPECIAL_TYPES:
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
