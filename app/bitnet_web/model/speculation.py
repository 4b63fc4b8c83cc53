"""Speculative decoding's rules on the host: prompt-lookup drafts and how a verified draft is accepted.

A draft needs no second model: the tokens that followed the most recent earlier occurrence of the
text's last n-gram (n = NGRAM_MAX down to 1) are proposed as the next tokens. One forward pass over
[last token, draft...] (k + 1 rows) then scores every drafted position at once. These functions are
the reference the GPU kernels are tested against and what the acceptance statistics are computed
with; they import only numpy and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NGRAM_MAX = 3  # longest n-gram matched; shorter ones are tried when it has no earlier occurrence


def prompt_lookup_draft(history: Sequence[int], k: int, ngram_max: int = NGRAM_MAX) -> list[int]:
    """Up to `k` drafted tokens after `history` (the prompt and every token generated so far).

    For n = ngram_max .. 1: find the largest i < len(history) - n with history[i:i+n] equal to the
    last n tokens; the draft is history[i+n : i+n+k] (shorter where the history ends). The first n
    with a match decides; no match gives an empty draft.
    """
    h = list(history)
    length = len(h)
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), 0, -1):
        tail = h[length - n :]
        for i in range(length - n - 1, -1, -1):
            if h[i : i + n] == tail:
                return h[i + n : min(i + n + k, length)]
    return []


def accept_greedy(draft: Sequence[int], chosen: Sequence[int]) -> tuple[int, list[int]]:
    """`chosen[j]`: the greedy token after row j of the verify pass (row 0 is the last accepted token,
    row j > 0 is draft[j-1]). Returns (accepted, tokens): how many drafted tokens equal what greedy
    decoding would have produced, and the tokens to emit: those plus the next greedy token, so every
    verify step emits at least one token and the text is exactly plain greedy decoding's."""
    accepted = 0
    while accepted < len(draft) and int(draft[accepted]) == int(chosen[accepted]):
        accepted += 1
    return accepted, [int(t) for t in draft[:accepted]] + [int(chosen[accepted])]


def accept_sampled(draft_token: int, p: np.ndarray, u_accept: float, u_draw: float) -> tuple[bool, int]:
    """One position of speculative sampling with a deterministic draft (a point mass on draft_token):
    accept it with probability p[draft_token]; otherwise draw from p with draft_token removed and
    renormalized. `p` is the target distribution (after every sampler setting), u_* uniform in [0, 1).
    The token emitted is then distributed exactly as p."""
    p = np.asarray(p, dtype=np.float64)
    if u_accept < p[draft_token]:
        return True, int(draft_token)
    residual = p.copy()
    residual[draft_token] = 0.0
    total = residual.sum()
    if total <= 0.0:  # p is a point mass on the draft: acceptance was certain
        return True, int(draft_token)
    cdf = np.cumsum(residual / total)
    return False, int(min(np.searchsorted(cdf, u_draw, side="right"), len(p) - 1))
