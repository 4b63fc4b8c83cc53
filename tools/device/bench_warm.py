"""`python -m bitnet_web bench` with the GPU clock brought up first, and a chosen prefill chunk.

    python tools/device/bench_warm.py [--chunk 512] [--warm 1.5] -- [bench arguments]

Why: NVIDIA's driver idles the H100 at 345 MHz and climbs back to 1980 MHz only after about a
second of steady work (device runs 3 and 5, docs/performance.md). The bench measures prefill right
after loading, when the GPU has just idled: its prefill-128 figure (~2,100 tok/s) is the cold-clock
speed, not a per-call overhead. This wrapper runs back-to-back prefills for `--warm` seconds before
the bench's own measurements, and builds the engine with `--chunk` rows per prefill chunk (the bench
itself uses 128), without changing bench.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "app"))

from bitnet_web import bench, cli  # noqa: E402
from bitnet_web import engine as engine_module  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunk", type=int, default=128, help="rows per prefill chunk (Engine prefill_chunk)")
    parser.add_argument("--warm", type=float, default=1.5, help="seconds of prefills before measuring")
    parser.add_argument("bench_args", nargs="*", help="arguments for `bitnet_web bench` (after --)")
    args = parser.parse_args()

    base_engine = engine_module.Engine

    class ChunkEngine(base_engine):
        def __init__(self, *a, **k):
            k["prefill_chunk"] = args.chunk
            super().__init__(*a, **k)

    engine_module.Engine = ChunkEngine
    measure = bench.measure_async

    async def warmed(engine, quick: bool = False) -> dict:
        model = engine.model
        ids = [(7 * i) % engine.config.vocab_size for i in range(min(512, model.max_tokens))]
        end = time.perf_counter() + args.warm
        while time.perf_counter() < end:
            model.truncate(0)
            await model.prefill(ids)
        model.truncate(0)
        report = await measure(engine, quick)
        report["prefill_chunk"] = args.chunk
        report["warm_s"] = args.warm
        return report

    bench.measure_async = warmed
    return cli.main(["bench", *args.bench_args])


if __name__ == "__main__":
    raise SystemExit(main())
