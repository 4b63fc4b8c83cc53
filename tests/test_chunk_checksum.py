"""web/worker/checksum.py: the checksum a cached chunk is checked against when a model is read back
from browser storage. Compared with a plain-Python computation of its definition (int.from_bytes per
word), and the damage it must catch: any changed byte, moved blocks, a shorter chunk."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web.web.worker.checksum import BLOCK_WORDS, chunk_checksum

MOD = 1 << 64


def reference_checksum(data: bytes) -> str:
    n_words = len(data) // 8
    words = [int.from_bytes(data[8 * i : 8 * i + 8], "little") for i in range(n_words)]
    blocks = [sum(words[i : i + BLOCK_WORDS]) for i in range(0, n_words, BLOCK_WORDS)]
    s1 = sum(blocks) % MOD
    s2 = sum((b + 1) * v for b, v in enumerate(blocks)) % MOD
    return f"{s1:016x}{s2:016x}:{len(data)}:{data[n_words * 8 :].hex()}"


SIZES = [0, 5, 8, 8 * BLOCK_WORDS, 8 * BLOCK_WORDS + 3, 3 * 8 * BLOCK_WORDS + 8 * 17 + 6]


@pytest.mark.parametrize("size", SIZES)
def test_equals_its_definition(size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    want = reference_checksum(data)
    assert chunk_checksum(data) == want
    assert chunk_checksum(memoryview(bytearray(data))) == want  # as read_into passes wasm memory
    assert chunk_checksum(np.frombuffer(data, dtype=np.uint8)) == want


def test_all_ones_words_wrap_modulo_2_64() -> None:
    data = b"\xff" * (8 * (2 * BLOCK_WORDS + 5))
    assert chunk_checksum(data) == reference_checksum(data)


def test_any_changed_byte_changes_it() -> None:
    size = 2 * 8 * BLOCK_WORDS + 8 * 9 + 3
    rng = np.random.default_rng(1)
    data = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    good = chunk_checksum(data)
    for at in [0, 7, 8, size // 2, 8 * BLOCK_WORDS, size - 4, size - 1, *rng.integers(0, size, 40)]:
        for flip in (0x01, 0x80, 0xFF):
            damaged = bytearray(data)
            damaged[at] ^= flip
            assert chunk_checksum(damaged) != good, (at, flip)


def test_moved_blocks_and_lost_bytes_change_it() -> None:
    block = 8 * BLOCK_WORDS
    data = np.random.default_rng(2).integers(0, 256, 4 * block, dtype=np.uint8).tobytes()
    good = chunk_checksum(data)
    swapped = data[block : 2 * block] + data[:block] + data[2 * block :]
    assert chunk_checksum(swapped) != good
    assert chunk_checksum(data[:-8]) != good  # a whole word gone
    assert chunk_checksum(data[:-1]) != good
    zeroed = data[:block] + bytes(block) + data[2 * block :]  # a range wiped
    assert chunk_checksum(zeroed) != good
