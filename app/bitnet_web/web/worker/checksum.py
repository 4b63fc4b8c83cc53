"""The checksum a stored chunk is checked against when a cached model is read back.

SHA-256 (WebCrypto) was most of a cached model's load: 1.2 GB read back in 3.1 s with it and 1.25 s
without on the H100 machine's Chromium (docs/performance.md). Reading back guards against storage
damage, not against an attacker (the bytes came from the same origin's own storage), so a checksum
that numpy computes in one pass over the bytes already copied into wasm memory does: any changed
byte changes `s1`, and blocks moved or swapped change `s2`.

    words  the chunk as little-endian uint64 (the last 0..7 bytes separately, as `tail`)
    s1     sum of the words, mod 2^64
    s2     sum over blocks b = 0, 1, ... of BLOCK_WORDS words of (b + 1) * (block b's sum), mod 2^64
           (the words past the last whole block count as one more block)
"""

from __future__ import annotations

from typing import Any

import numpy as np

BLOCK_WORDS = 4096  # 32 KB
_MOD = 1 << 64


def chunk_checksum(data: Any) -> str:
    """The checksum of a chunk's bytes (bytes, a memoryview or a uint8 array) as a string:
    s1 and s2 in hex, the byte count, and the tail bytes."""
    raw = np.frombuffer(data, dtype=np.uint8)
    n_words = len(raw) // 8
    words = raw[: n_words * 8].view("<u8")
    whole = n_words // BLOCK_WORDS * BLOCK_WORDS
    block_sums = [int(v) for v in words[:whole].reshape(-1, BLOCK_WORDS).sum(axis=1, dtype=np.uint64)]
    if whole < n_words:
        block_sums.append(int(words[whole:].sum(dtype=np.uint64)))
    s1 = sum(block_sums) % _MOD
    s2 = sum((b + 1) * v for b, v in enumerate(block_sums)) % _MOD
    return f"{s1:016x}{s2:016x}:{len(raw)}:{bytes(raw[n_words * 8 :]).hex()}"
