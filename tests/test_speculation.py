"""Speculative decoding's host rules (model/speculation.py) against brute force and their defining properties."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web.model.speculation import accept_greedy, accept_sampled, prompt_lookup_draft


def brute_force_draft(history: list[int], k: int, ngram_max: int) -> list[int]:
    """Every (n, i) pair scored: longest n first, then the latest start."""
    best = None
    for n in range(1, ngram_max + 1):
        for i in range(len(history) - n):
            if history[i : i + n] == history[len(history) - n :] and (best is None or (n, i) > best):
                best = (n, i)
    if best is None:
        return []
    n, i = best
    return history[i + n : i + n + k]


@pytest.mark.parametrize("seed", range(20))
def test_draft_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
    for k in (1, 3, 8):
        assert prompt_lookup_draft(history, k) == brute_force_draft(history, k, 3)


def test_draft_copies_what_followed_the_latest_match() -> None:
    history = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert prompt_lookup_draft(history, 2) == [7, 8]  # the later "1 2 3" wins over the first
    assert prompt_lookup_draft([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    assert prompt_lookup_draft([4, 4], 3) == [4]  # the draft stops where the history ends
    assert prompt_lookup_draft(history, 0) == []


@pytest.mark.parametrize("seed", range(10))
def test_greedy_acceptance_reproduces_plain_greedy(seed: int) -> None:
    """Drive the rules with a deterministic 'model' (next token = a fixed function of the last
    three): speculative decoding must emit exactly the plain greedy sequence."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 6, size=(6, 6, 6))

    def next_token(h: list[int]) -> int:
        return int(table[h[-3], h[-2], h[-1]])

    prompt = rng.integers(0, 6, size=8).tolist()
    plain = list(prompt)
    while len(plain) < 80:
        plain.append(next_token(plain))
    spec, accepted_total = list(prompt), 0
    while len(spec) < 80:
        draft = prompt_lookup_draft(spec, 4)
        rows = [spec + draft[:j] for j in range(len(draft) + 1)]
        accepted, tokens = accept_greedy(draft, [next_token(r) for r in rows])
        accepted_total += accepted
        spec.extend(tokens)
    assert spec[:80] == plain
    assert accepted_total > 0  # a period-<=216 sequence repeats: drafts must get accepted


def test_sampled_acceptance_keeps_the_distribution() -> None:
    """Accept-or-resample with a point-mass draft must give tokens distributed exactly as p."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    n = 60_000
    counts = np.zeros(6)
    accepted = 0
    for _ in range(n):
        ok, token = accept_sampled(2, p, rng.random(), rng.random())
        counts[token] += 1
        accepted += ok
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    assert abs(accepted / n - p[2]) < 4 * np.sqrt(p[2] * (1 - p[2]) / n)
