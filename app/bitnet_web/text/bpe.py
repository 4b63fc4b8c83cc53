"""Byte-level BPE (the `gpt2` model: Llama 3, BitNet b1.58 2B-4T): byte alphabet, Llama 3 pre-tokenizer, merges.

Text is cut into pre-tokens by the Llama 3 regex, each pre-token's UTF-8 bytes are mapped to the
GPT-2 byte alphabet and merged by merge rank. Matches Hugging Face `tokenizers` token for token.
Imports only the standard library.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

from . import unicode_classes
from .vocab import TokenizerError

# `tokenizer.ggml.pre` names for which llama.cpp uses the Llama 3 regex (llama-vocab.cpp).
LLAMA3_PRE_NAMES = frozenset(
    {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon_e", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
)

# Words longer than this many bytes take the O(n log n) BPE path (see ByteLevelBPE._merge_heap).
_LONG_WORD = 64


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
# So the letter, number and space classes are spelled out: letters and numbers from the shipped
# Unicode tables (unicode_classes.py, the version HF's Oniguruma uses, so the split is the same on
# every Python whatever its own `unicodedata`), space as Oniguruma's Unicode \s (checked against HF:
# U+0085 and U+00A0 are spaces; U+001C, U+180E and U+200B are not). Case-insensitive "'s" also
# matches "'ſ" (U+017F case-folds to s), as it does in HF.
# ---------------------------------------------------------------------------------------------

_WHITESPACE_CHARS = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680"
    + "".join(chr(c) for c in range(0x2000, 0x200B))
    + ("\u2028\u2029\u202f\u205f\u3000")
)


def _class_ranges(table: str) -> str:
    """Regex character-class body for a table of hex ranges ("41-5a 61-7a aa ...")."""
    parts: list[str] = []
    for item in table.split():
        start, _, end = item.partition("-")
        a = _escape_cp(int(start, 16))
        parts.append(f"{a}-{_escape_cp(int(end, 16))}" if end else a)
    return "".join(parts)


def _escape_cp(cp: int) -> str:
    return f"\\U{cp:08x}" if cp > 0xFFFF else f"\\u{cp:04x}"


@lru_cache(maxsize=1)
def _llama3_regex() -> re.Pattern[str]:
    letters = _class_ranges(unicode_classes.LETTERS)
    numbers = _class_ranges(unicode_classes.NUMBERS)
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
# Merges
# ---------------------------------------------------------------------------------------------


def parse_merges(merges: Iterable[str] | Iterable[Sequence[str]]) -> dict[tuple[str, str], int]:
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


class ByteLevelBPE:
    """Byte-level BPE over one vocabulary: each pre-token merged by merge rank, cached per word."""

    def __init__(
        self,
        token_to_id: Mapping[str, int],
        merges: Iterable[str] | Iterable[Sequence[str]] | None,
        unk_id: int | None,
        ignore_merges: bool = False,
        special_ids: frozenset[int] | set[int] = frozenset(),
    ) -> None:
        if merges is None:
            raise TokenizerError("tokenizer.ggml.merges is missing (required for a 'gpt2' BPE vocabulary)")
        self._token_to_id = token_to_id
        # ignore_merges (HF's BPE option, Llama 3's setting; llama.cpp's for its llama3 pre-tokenizer
        # types): a pre-token that is itself a vocabulary entry becomes that one token, even where the
        # merges would not build it (" Việt"). Special tokens are not vocabulary entries for this.
        self.ignore_merges = bool(ignore_merges)
        self._special_ids = special_ids
        self._ranks = parse_merges(merges)
        self.unk_id = unk_id
        self._pretokenize = _llama3_regex().findall
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, out: list[int]) -> None:
        """Append the ids of `text` (plain text, no special tokens) to `out`."""
        cache = self._word_cache
        for word in self._pretokenize(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._word(word)
                if len(cache) < 200_000:
                    cache[word] = ids
            out.extend(ids)

    def _word(self, word: str) -> tuple[int, ...]:
        spelled = _bytes_to_alphabet(word.encode("utf-8"))
        if self.ignore_merges:
            whole = self._token_to_id.get(spelled)
            if whole is not None and whole not in self._special_ids:
                return (whole,)
        symbols = list(spelled)
        if len(symbols) > _LONG_WORD:
            return self._symbol_ids(self._merge_heap(symbols))
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

    def _merge_heap(self, symbols: list[str]) -> list[str]:
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
