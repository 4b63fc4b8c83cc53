"""A longer fuzz run of the GGUF reader and the tokenizer: the strategies and properties of
tests/test_fuzz_gguf.py and tests/test_fuzz_tokenizer.py, with random (not derandomized) seeds, in
batches until the time or case budget is spent.

    .venv/bin/python tools/fuzz_long.py --minutes 30            # all categories, round robin
    .venv/bin/python tools/fuzz_long.py --cases 20000 --only gguf:splice gguf:field_overwrite
    .venv/bin/python tools/fuzz_long.py --minutes 5 --seed 1234  # reproducible sequence of batches

Prints, per category, the cases run and their outcomes (parsed / error class), the slowest input and
the largest tracemalloc peak seen. A failing property is shrunk by hypothesis, reported, and its input
written to --out (a .gguf file for GGUF categories, a .txt repr for tokenizer ones); the run goes on
with the other categories and the exit status is 1.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "app"), str(ROOT / "tests")]

import test_fuzz_gguf as fg  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def gguf_categories() -> dict[str, tuple[st.SearchStrategy, object]]:
    """category -> (strategy of Case, check(case) -> outcome)."""
    cats = {f"gguf:{name}": (strategy, None) for name, strategy in fg.MUTATIONS.items()}
    cats["gguf:chained"] = (fg.chained_mutations(), None)
    cats["gguf:lying_length"] = (fg.lying_lengths().map(lambda cf: cf[0]), None)
    return cats


def tokenizer_categories() -> dict[str, tuple[st.SearchStrategy, object]]:
    import test_fuzz_tokenizer as ft

    tok, hf = ft.load_llama3(), ft.load_hf()
    byte_token = ft.find_byte_tokens(tok)
    interesting = ft.find_interesting_ids(tok, byte_token)
    long_text = st.lists(st.sampled_from(ft.STRESS_PIECES), max_size=200).map("".join)
    return {
        "tokenizer:unicode": (st.one_of(ft.unicode_text, long_text), lambda text: ft.check_round_trip(tok, hf, text)),
        "tokenizer:bytes": (ft.BYTES_DECODED, lambda case: ft.check_bytes(tok, *case)),
        "tokenizer:byte_tokens": (st.binary(max_size=256), lambda data: ft.check_byte_tokens(tok, byte_token, data)),
        "tokenizer:stream": (
            st.tuples(ft.id_sequences(tok, interesting, 64), st.booleans()),
            lambda case: ft.check_stream(tok, *case),
        ),
    }


def run_batch(category: str, strategy, check, n: int, seed: int, counts: Counter, out: Path) -> bool:
    """`n` cases of one category; False (after reporting) if a property failed."""
    last: list[object] = [None]

    @settings(max_examples=n, database=None, deadline=None, derandomize=False, suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(case=strategy)
    def batch(case):
        last[0] = case
        if check is None:
            outcome = fg.run_case(category, case.data, case.label)
        else:
            check(case)
            outcome = "ok"
        counts[(category, outcome)] += 1

    try:
        batch()
        return True
    except Exception as e:  # a falsified property (hypothesis re-raises the shrunk failure)
        out.mkdir(parents=True, exist_ok=True)
        name = category.replace(":", "-")
        case = last[0]
        if isinstance(case, fg.Case):
            path = out / f"{name}.gguf"
            path.write_bytes(case.data)
        else:
            path = out / f"{name}.txt"
            path.write_text(repr(case), encoding="utf-8")
        print(f"\nFAILED {category} (hypothesis seed {seed}); input saved to {path}")
        print("".join(traceback.format_exception_only(type(e), e))[-3000:])
        return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="time budget (default 10)")
    parser.add_argument("--cases", type=int, default=None, help="stop after this many cases in total")
    parser.add_argument("--batch", type=int, default=200, help="cases per hypothesis run (default 200)")
    parser.add_argument("--seed", type=int, default=None, help="seed for the sequence of batch seeds")
    parser.add_argument("--only", nargs="*", default=None, help="categories to run (default: all)")
    parser.add_argument("--no-tokenizer", action="store_true", help="GGUF categories only")
    parser.add_argument("--out", type=Path, default=Path("fuzz-failures"), help="where failing inputs go")
    args = parser.parse_args()

    from bitnet_web.text.bpe import _llama3_regex

    _llama3_regex()  # compiled once, outside the per-input bounds
    fg.seeds()
    categories = gguf_categories()
    if not args.no_tokenizer:
        categories.update(tokenizer_categories())
    if args.only:
        unknown = set(args.only) - set(categories)
        if unknown:
            parser.error(f"unknown categories {sorted(unknown)}; known: {', '.join(categories)}")
        categories = {k: v for k, v in categories.items() if k in args.only}

    rng = random.Random(args.seed)
    counts: Counter = Counter()
    failed: set[str] = set()
    deadline = time.monotonic() + args.minutes * 60
    start = time.monotonic()
    total = 0
    while time.monotonic() < deadline and (args.cases is None or total < args.cases):
        active = [c for c in categories if c not in failed]
        if not active:
            break
        for category in active:
            if time.monotonic() >= deadline or (args.cases is not None and total >= args.cases):
                break
            strategy, check = categories[category]
            n = args.batch if args.cases is None else min(args.batch, args.cases - total)
            if not run_batch(category, strategy, check, n, rng.getrandbits(64), counts, args.out):
                failed.add(category)
            total = sum(counts.values())
        print(f"{total} cases in {time.monotonic() - start:.0f} s", flush=True)

    elapsed = time.monotonic() - start
    print(f"\n\n{total} cases in {elapsed:.0f} s ({total / max(elapsed, 1e-9):.0f}/s)")
    for category in categories:
        outcomes = {o: n for (c, o), n in sorted(counts.items()) if c == category}
        status = "FAILED" if category in failed else "ok"
        print(f"  {category:28s} {sum(outcomes.values()):7d}  {status:6s} {outcomes}")
    print("parsed GGUF files, downstream:", dict(sorted(fg.DOWNSTREAM.items())))
    print(
        f"slowest GGUF input {fg.WORST['seconds'] * 1000:.1f} ms CPU, largest tracemalloc peak "
        f"{fg.WORST['peak_bytes'] / 2**20:.2f} MiB "
        f"(limits {fg.HANG_LIMIT_S} s, {fg.MEMORY_LIMIT >> 20} MiB)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
