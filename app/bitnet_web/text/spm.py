"""SentencePiece BPE (the `llama` model: 1bitLLM models), as llama.cpp's `llm_tokenizer_spm` does it.

Spaces become U+2581, adjacent symbols merge by the score of the merged piece, and characters
missing from the vocabulary fall back to ``<0xNN>`` byte tokens. (The space prefix that llama.cpp's
`add_space_prefix` adds is the caller's: tokenizer.py knows where a text fragment starts.)
Imports only the standard library.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from .vocab import TokenizerError

SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


class SentencePieceBPE:
    """SentencePiece BPE over one vocabulary: merges by piece score, then byte fallback."""

    def __init__(
        self, token_to_id: Mapping[str, int], n_tokens: int, scores: Sequence[float] | None, unk_id: int | None
    ) -> None:
        self._token_to_id = token_to_id
        self.unk_id = unk_id
        if scores is None:
            # Without scores, SentencePiece's convention (pieces sorted by score) gives -id.
            self._scores = [-float(i) for i in range(n_tokens)]
        else:
            self._scores = [float(s) for s in scores]
            if len(self._scores) != n_tokens:
                raise TokenizerError(
                    f"tokenizer.ggml.scores has {len(self._scores)} entries, tokenizer.ggml.tokens has {n_tokens}"
                )
        self._byte_ids: list[int | None] = [token_to_id.get(f"<0x{b:02X}>") for b in range(256)]

    def encode(self, text: str, out: list[int]) -> None:
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
