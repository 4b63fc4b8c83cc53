"""Sampler on hand-built distributions (exact expectations) and seeded statistical checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitnet_web.text.sampler import Sampler, SamplerSettings
from bitnet_web.text.stops import StopMatcher


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def frequencies(sampler: Sampler, logits: np.ndarray, n: int, history=()) -> np.ndarray:
    counts = np.zeros(logits.shape[0])
    for _ in range(n):
        counts[sampler.sample(logits, history)] += 1
    return counts / n


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be >= 0"),
        ("temperature", float("nan"), "temperature must be a finite number"),
        ("top_k", -1, "top_k must be >= 0"),
        ("top_k", 2.5, "top_k must be an integer"),
        ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
        ("min_p", -0.1, r"min_p must be in \[0, 1\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
        ("repeat_last_n", -2, "repeat_last_n must be >= -1"),
        ("seed", -5, "seed must be >= 0"),
        ("seed", "abc", "seed must be an integer"),
    ],
)
def test_settings_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplerSettings(**{field: value})


def test_bad_logits_and_history():
    s = Sampler(SamplerSettings(seed=0, repetition_penalty=1.1))
    with pytest.raises(ValueError, match="1-D"):
        s.sample(np.zeros((2, 3), np.float32), [])
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0.0, np.nan], np.float32), [])
    with pytest.raises(ValueError, match="all logits are -inf"):
        s.sample(np.full(3, -np.inf, np.float32), [])
    # a +inf logit wins outright, even when sampling
    assert Sampler(SamplerSettings(temperature=1.0, seed=0)).sample(np.array([0, np.inf, 1], np.float32)) == 1
    with pytest.raises(ValueError, match="outside 0..2"):
        s.sample(np.zeros(3, np.float32), [7])


# -- greedy and repetition penalty (exact) -----------------------------------------------------


def test_temperature_zero_is_argmax():
    s = Sampler(SamplerSettings(temperature=0.0, seed=0))
    rng = np.random.default_rng(1)
    for _ in range(50):
        logits = rng.normal(size=1000).astype(np.float32)
        assert s.sample(logits, []) == int(np.argmax(logits))
    # all -inf but one, and huge values: no division by zero, no overflow
    assert s.sample(np.array([-np.inf, 3e38, -np.inf], np.float32), []) == 1


def test_repetition_penalty_llama_cpp_semantics():
    greedy = dict(temperature=0.0, repetition_penalty=1.5, repeat_last_n=64)
    s = Sampler(SamplerSettings(**greedy))
    # positive logit divided: 2.0 / 1.5 = 1.33 < 1.9
    assert s.sample(np.array([2.0, 1.9], np.float32), [0]) == 1
    # negative logit multiplied: -1.0 * 1.5 = -1.5 < -1.2
    assert s.sample(np.array([-1.0, -1.2], np.float32), [0]) == 1
    # repeats in the history count once: 2.0 / 1.5, not / 1.5**3
    assert s.sample(np.array([2.0, 1.0], np.float32), [0, 0, 0]) == 0
    # only the last N tokens count
    windowed = Sampler(SamplerSettings(**{**greedy, "repeat_last_n": 2}))
    assert windowed.sample(np.array([2.0, 1.9, 0.0], np.float32), [0, 2, 2]) == 0
    assert windowed.sample(np.array([2.0, 1.9, 0.0], np.float32), [2, 2, 0]) == 1
    # penalty 1.0 and repeat_last_n 0 are off
    off = Sampler(SamplerSettings(temperature=0.0, repetition_penalty=1.0))
    assert off.sample(np.array([2.0, 1.9], np.float32), [0]) == 0
    none = Sampler(SamplerSettings(temperature=0.0, repetition_penalty=1.5, repeat_last_n=0))
    assert none.sample(np.array([2.0, 1.9], np.float32), [0]) == 0


# -- truncation (exact support) ----------------------------------------------------------------

PROBS = [0.5, 0.3, 0.15, 0.05]


def support(settings_: SamplerSettings, logits: np.ndarray, n: int = 3000) -> set[int]:
    return set(np.nonzero(frequencies(Sampler(settings_), logits, n))[0].tolist())


def test_top_k():
    logits = logits_of(PROBS)
    assert support(SamplerSettings(temperature=5.0, top_k=1, top_p=1.0, seed=1), logits) == {0}
    assert support(SamplerSettings(temperature=5.0, top_k=2, top_p=1.0, seed=1), logits) == {0, 1}
    assert support(SamplerSettings(temperature=5.0, top_k=0, top_p=1.0, seed=1), logits) == {0, 1, 2, 3}


def test_top_k_on_a_large_vocabulary_matches_full_sort():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=128256).astype(np.float32) * 3
    top40 = set(np.argsort(-logits)[:40].tolist())
    s = Sampler(SamplerSettings(temperature=3.0, top_k=40, top_p=1.0, seed=3))
    drawn = {s.sample(logits, []) for _ in range(400)}
    assert drawn <= top40 and len(drawn) > 10


def test_top_p():
    logits = logits_of(PROBS)
    base = dict(temperature=1.0, top_k=0, seed=2)
    # cumulative 0.5, 0.8, 0.95, 1.0: the token that crosses top_p is kept
    assert support(SamplerSettings(**base, top_p=0.5), logits) == {0}
    assert support(SamplerSettings(**base, top_p=0.7), logits) == {0, 1}
    assert support(SamplerSettings(**base, top_p=0.9), logits) == {0, 1, 2}
    assert support(SamplerSettings(**base, top_p=1.0), logits) == {0, 1, 2, 3}


def test_min_p():
    logits = logits_of(PROBS)
    base = dict(temperature=1.0, top_k=0, top_p=1.0, seed=4)
    assert support(SamplerSettings(**base, min_p=0.5), logits) == {0, 1}  # p >= 0.25
    assert support(SamplerSettings(**base, min_p=0.25), logits) == {0, 1, 2}  # p >= 0.125
    assert support(SamplerSettings(**base, min_p=1.0), logits) == {0}


# -- frequencies (seeded, generous bounds) -----------------------------------------------------


def assert_close(observed: np.ndarray, expected: np.ndarray, n: int) -> None:
    # 5 standard deviations of a binomial proportion, plus a little
    bound = 5 * np.sqrt(expected * (1 - expected) / n) + 2e-3
    assert np.all(np.abs(observed - expected) <= bound), (observed, expected)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.slow
def test_temperature_frequencies(temperature):
    logits = logits_of(PROBS)
    n = 20000
    observed = frequencies(Sampler(SamplerSettings(temperature=temperature, top_k=0, top_p=1.0, seed=11)), logits, n)
    scaled = np.exp(logits.astype(np.float64) / temperature)
    assert_close(observed, scaled / scaled.sum(), n)


@pytest.mark.slow
def test_top_p_frequencies_renormalise():
    logits = logits_of(PROBS)
    n = 20000
    observed = frequencies(Sampler(SamplerSettings(temperature=1.0, top_k=0, top_p=0.7, seed=5)), logits, n)
    assert_close(observed, np.array([0.5, 0.3, 0.0, 0.0]) / 0.8, n)


@pytest.mark.slow
def test_temperature_applies_after_top_p():
    # llama.cpp order: top-p picks {0, 1} on the T=1 distribution, then T=2 flattens the two.
    logits = logits_of(PROBS)
    n = 20000
    observed = frequencies(Sampler(SamplerSettings(temperature=2.0, top_k=0, top_p=0.7, seed=6)), logits, n)
    w = np.sqrt(np.array([0.5, 0.3]))
    assert_close(observed, np.concatenate([w / w.sum(), [0.0, 0.0]]), n)


def test_seed_reproducible():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=5000).astype(np.float32)
    cfg = SamplerSettings(temperature=1.0, top_k=100, top_p=0.9, seed=1234)
    a = [Sampler(cfg).sample(logits, [])]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    seq1 = [s1.sample(logits, []) for _ in range(50)]
    seq2 = [s2.sample(logits, []) for _ in range(50)]
    assert seq1 == seq2 and seq1[0] == a[0]
    other = Sampler(SamplerSettings(temperature=1.0, top_k=100, top_p=0.9, seed=4321))
    assert [other.sample(logits, []) for _ in range(50)] != seq1


def test_default_settings_are_llama_cpp_defaults():
    s = SamplerSettings()
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.repeat_last_n) == (
        0.8,
        40,
        0.95,
        0.0,
        1.0,
        64,
    )
    assert math.isclose(Sampler().settings.temperature, 0.8)


# -- stop strings ------------------------------------------------------------------------------


def test_stop_matcher_holds_back_partial_stop():
    m = StopMatcher(["<|eot_id|>", "User:"])
    assert m.push("Hello U") == ("Hello ", False)
    assert m.push("se") == ("", False)
    assert m.push("ful <") == ("Useful ", False)
    assert m.push("|eot_id|> more") == ("", True)
    assert m.push("anything") == ("", True)
    assert m.flush() == ""


def test_stop_matcher_flush_releases_text_that_never_completed():
    m = StopMatcher(["STOP"])
    assert m.push("the end ST") == ("the end ", False)
    assert m.flush() == "ST"


def test_stop_matcher_rejects_empty_stop():
    with pytest.raises(ValueError, match=r"stop_strings\[1\] must be a non-empty string"):
        StopMatcher(["a", ""])


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc<|>xy", max_size=40),
    stops=st.lists(st.text(alphabet="abc<|>", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_stop_matcher_property(text, stops, cuts):
    pieces, last = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[last:c])
        last = c
    m = StopMatcher(stops)
    emitted = ""
    for p in pieces:
        out, _ = m.push(p)
        emitted += out
        assert not any(s in emitted for s in stops)  # never shows a stop string
    emitted += m.flush()  # the end of generation settles what was held back
    first = min((text.find(s) for s in stops if s in text), default=-1)
    if first >= 0:
        assert m.stopped and emitted == text[:first]
    else:
        assert not m.stopped and emitted == text


def test_stop_matcher_waits_for_a_longer_stop_string_that_starts_earlier():
    """'<' is found in '><' but '><<' (which starts earlier) may still complete: found by hypothesis."""
    m = StopMatcher(["<", "><<"])
    assert m.push("><") == ("", False)
    assert m.push("<") == ("", True)
    m = StopMatcher(["<", "><<"])
    assert m.push("><") == ("", False)
    assert m.push("x") == (">", True)  # '><x': the longer one cannot complete; '<' at 1 wins
    m = StopMatcher(["<", "><<"])
    assert m.push("><") == ("", False)
    assert m.flush() == ">" and m.stopped  # generation ended: the match that was held stops it
