"""Greedy decode speed of the native engine against its decode batching (BitNetModel.DECODE_BATCHING).

    python tools/device/decode_batching.py MODEL.gguf [OUT.json]

Wall time per token, process CPU time and Python recording time for (steps per submit, submits in
flight) pairs, short context, median of 3 runs of 128 tokens each. (1, 1) waits for every token
before recording the next (the GPU idles while Python records); (1, 2) is the native default.
"""

from __future__ import annotations

import json
import statistics
import sys

from bitnet_web import gpu
from bitnet_web.bench import decode_greedy_benchmark
from bitnet_web.engine import Engine
from bitnet_web.model.forward import BitNetModel

BATCHINGS = [(1, 1), (1, 2), (1, 3), (8, 3), (4, 2), (8, 2), (1, 2)]


def main() -> None:
    path, out = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    engine = Engine(prefill_chunk=128)
    engine.device = gpu.open_device()
    engine.load(path)
    model = engine.model
    rows = []
    for batching in BATCHINGS:
        BitNetModel.DECODE_BATCHING = batching
        runs = []
        for _ in range(3):
            model.truncate(0)
            engine._run(model.prefill(list(range(16))))
            runs.append(engine._run(decode_greedy_benchmark(model, 128)))
        stats = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append(
            {
                "batching": batching,
                "tok_per_s_runs": [round(r["tok_per_s"], 1) for r in runs],
                **{k: round(v, 3) for k, v in stats.items()},
            }
        )
        print(
            f"batching {batching}: {stats['tok_per_s']:7.1f} tok/s  {stats['ms_per_token']:.3f} ms/token  "
            f"python encode {stats['encode_ms_per_token']:.3f} ms  process cpu {stats['cpu_ms_per_token']:.3f} ms",
            flush=True,
        )
    BitNetModel.DECODE_BATCHING = None
    engine.close()
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
