"""Greedy decode speed against the number of steps queued on the GPU (BitNetModel.GREEDY_DEPTH).

    python tools/device/decode_depth.py MODEL.gguf [OUT.json]

Wall time per token, process CPU time and Python recording time, at depths 1-4, short context.
Depth 1 waits for every token before recording the next (the GPU idles while Python records).
"""

from __future__ import annotations

import json
import sys

from bitnet_web import gpu
from bitnet_web.bench import decode_greedy_benchmark
from bitnet_web.engine import Engine
from bitnet_web.model.forward import BitNetModel


def main() -> None:
    path, out = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    engine = Engine(prefill_chunk=128)
    engine.device = gpu.open_device()
    engine.load(path)
    model = engine.model
    rows = []
    for depth in (1, 2, 3, 4, 2):
        BitNetModel.GREEDY_DEPTH = depth
        model.truncate(0)
        engine._run(model.prefill(list(range(16))))
        stats = engine._run(decode_greedy_benchmark(model, 128))
        rows.append({"depth": depth, **{k: round(v, 3) for k, v in stats.items()}})
        print(
            f"depth {depth}: {stats['tok_per_s']:7.1f} tok/s  {stats['ms_per_token']:.3f} ms/token  "
            f"python encode {stats['encode_ms_per_token']:.3f} ms  process cpu {stats['cpu_ms_per_token']:.3f} ms",
            flush=True,
        )
    engine.close()
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
