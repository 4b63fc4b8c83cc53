"""The sampler, which takes logits and returns a token (stop strings: stops.py).

Order of operations follows llama.cpp's default chain: repetition penalty -> top-k -> top-p ->
min-p -> temperature -> draw. Top-p and min-p therefore look at the temperature-1 distribution,
and temperature only reshapes what survives them. Temperature 0 is greedy (argmax after the
penalty), never a division by zero.

Random numbers come from a counter-based stream, `uniform(seed, n)`: draw n of a seeded sampler is
a pure function of (seed, n). The GPU sampler (shaders/sample_topk.wgsl) computes the same hash, so
a seeded generation gives the same tokens whether its draws ran on the CPU or on the GPU (up to
float rounding when a draw lands within ~1e-6 of a boundary between two tokens). Equal logits are
ordered by token id (the smaller first), on both sides.

Imports only numpy and the standard library.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["GPU_PENALTY_WINDOW_MAX", "GPU_TOP_K_MAX", "Sampler", "SamplerSettings", "choose", "distribution", "uniform"]

# Largest top_k the GPU sampler handles (its per-workgroup candidate lists), and the longest
# repetition-penalty window (its ring of recent tokens); beyond them, or with top_k = 0, tokens
# are sampled on the CPU from read-back logits.
GPU_TOP_K_MAX = 64
GPU_PENALTY_WINDOW_MAX = 64


@dataclass(frozen=True)
class SamplerSettings:
    """How to pick the next token. Defaults are llama.cpp's."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off (all tokens)
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.0  # 0.0 = off; keep tokens with p >= min_p * p_max
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages repeats
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at; 0 = none, -1 = all
    seed: int | None = None  # None = fresh entropy each Sampler

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"SamplerSettings.{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str) -> int:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"SamplerSettings.{name} must be an integer, got {value!r}")
            return int(value)

        if number("temperature") < 0:
            raise ValueError(f"SamplerSettings.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if integer("top_k") < 0:
            raise ValueError(f"SamplerSettings.top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"SamplerSettings.top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0.0 <= number("min_p") <= 1.0:
            raise ValueError(f"SamplerSettings.min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"SamplerSettings.repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if integer("repeat_last_n") < -1:
            raise ValueError(
                f"SamplerSettings.repeat_last_n must be >= -1 (0 = none, -1 = all), got {self.repeat_last_n}"
            )
        if self.seed is not None:
            if integer("seed") < 0:
                raise ValueError(f"SamplerSettings.seed must be >= 0 or None, got {self.seed}")


class Sampler:
    """Draws tokens from logits with its own seeded random stream (reproducible per seed)."""

    def __init__(self, settings: SamplerSettings | None = None) -> None:
        self.settings = settings if settings is not None else SamplerSettings()
        self.reseed(self.settings.seed)

    def reseed(self, seed: int | None) -> None:
        """Restart the stream at draw 0; None picks a fresh random seed."""
        self.seed = secrets.randbits(64) if seed is None else int(seed) % (1 << 64)
        self.draws = 0  # uniforms used so far; the next one is uniform(seed, draws)

    def next_uniform(self) -> float:
        value = uniform(self.seed, self.draws)
        self.draws += 1
        return value

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token id. `logits`: float [V]; `history`: token ids so far (for the penalty)."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D array [vocab], got shape {logits.shape}")
        if np.isnan(logits).any():
            raise ValueError("logits contain NaN (the forward pass produced invalid values)")
        logits = self._penalize(logits.astype(np.float32, copy=False), history)
        top = float(np.max(logits))
        if top == -np.inf:
            raise ValueError("all logits are -inf: no token can be sampled")
        if self.settings.temperature == 0.0 or top == np.inf:
            # Greedy; also the only sensible answer when a logit is +inf (the softmax is one-hot).
            return int(np.argmax(logits))
        return choose(logits, self.settings, self.next_uniform())

    def gpu_supported(self) -> bool:
        """Can the GPU sampler take these settings (so logits need not come back to the host)?
        Greedy with a repetition penalty counts (it is top-k 1 there)."""
        s = self.settings
        return (s.temperature == 0.0 or 0 < s.top_k <= GPU_TOP_K_MAX) and (
            s.repetition_penalty == 1.0 or 0 <= s.repeat_last_n <= GPU_PENALTY_WINDOW_MAX
        )

    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's repetition penalty: each distinct token among the last N has its logit divided
        by the penalty if positive, multiplied if negative."""
        s = self.settings
        if s.repetition_penalty == 1.0 or s.repeat_last_n == 0 or len(history) == 0:
            return logits
        recent = history if s.repeat_last_n == -1 else history[-s.repeat_last_n :]
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        if ids.size and (ids[0] < 0 or ids[-1] >= logits.shape[0]):
            raise ValueError(f"history holds token ids outside 0..{logits.shape[0] - 1}")
        logits = logits.copy()
        selected = logits[ids]
        logits[ids] = np.where(selected > 0, selected / s.repetition_penalty, selected * s.repetition_penalty).astype(
            np.float32
        )
        return logits


def choose(logits: np.ndarray, settings: SamplerSettings, u: float) -> int:
    """The token that the draw `u` in [0, 1) picks from `logits` (float [V], no NaN, penalty
    already applied) under top-k -> top-p -> min-p -> temperature, by inverse CDF."""
    cand, probs = distribution(logits, settings)
    # Inverse-CDF draw: robust to the rounding that makes probs.sum() differ from 1 by an ulp.
    cum = np.cumsum(probs)
    index = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(cand[min(index, len(cand) - 1)])


def distribution(logits: np.ndarray, settings: SamplerSettings) -> tuple[np.ndarray, np.ndarray]:
    """The distribution `choose` draws from: (token ids, probabilities), in its draw order (logit
    descending, then id). `logits` as for `choose`; temperature > 0."""
    s = settings
    vocab = logits.shape[0]
    # top-k: O(V) selection; at the boundary, equal logits go to the smaller token ids
    if 0 < s.top_k < vocab:
        kth = -np.partition(-logits, s.top_k - 1)[s.top_k - 1]
        above = np.flatnonzero(logits > kth)
        cand = np.concatenate([above, np.flatnonzero(logits == kth)[: s.top_k - above.size]])
    else:
        cand = np.arange(vocab)
    order = np.lexsort((cand, -logits[cand].astype(np.float64)))  # value descending, then id
    cand = cand[order]
    cand_logits = logits[cand].astype(np.float64)

    # Probabilities at temperature 1, for top-p and min-p (llama.cpp applies temperature last).
    if s.top_p < 1.0 or s.min_p > 0.0:
        probs = _softmax(cand_logits)
        keep = len(cand)
        if s.top_p < 1.0:
            # Smallest prefix whose mass reaches top_p (the token that crosses it is kept).
            cum = np.cumsum(probs)
            keep = min(keep, int(np.searchsorted(cum, s.top_p, side="left")) + 1)
        if s.min_p > 0.0:
            keep = min(keep, int(np.count_nonzero(probs >= s.min_p * probs[0])))
        keep = max(keep, 1)
        cand = cand[:keep]
        cand_logits = cand_logits[:keep]
    return cand, _softmax(cand_logits / s.temperature)


_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    """A 32-bit integer hash (Wellons' "lowbias32"); the WGSL twin is `mix32` in sample_topk.wgsl."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def uniform(seed: int, n: int) -> float:
    """Draw `n` of the stream `seed` (64-bit): a float in [0, 1) with 24 random bits."""
    seed_lo, seed_hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _mix32(seed_lo ^ _mix32((seed_hi + 0x9E3779B9) & _MASK32))
    return (_mix32((n & _MASK32) ^ key) >> 8) * (1.0 / (1 << 24))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()
