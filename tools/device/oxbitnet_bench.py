"""Decode speed of oxbitnet (0xBitNet's Python binding) on a GGUF: (n_long - n_short) / (t_long - t_short).

Generating 16 and 144 tokens after the same ~60-token prompt and taking the difference removes
load, prefill and first-token costs, leaving steady decode. Greedy (top_k=1).
"""

import json
import sys
import time

from oxbitnet import BitNet

path, out = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
model = BitNet.load_sync(path)
load_s = time.perf_counter() - t0
prompt = "The quick brown fox jumps over the lazy dog. " * 1 + "Once upon a time,"
runs = {}
for n in (16, 144, 16, 144):
    t0 = time.perf_counter()
    tokens = model.generate_tokens_sync(prompt, max_tokens=n, temperature=1.0, top_k=1)
    runs.setdefault(n, []).append((time.perf_counter() - t0, len(tokens)))
(ts, ns), (tl, nl) = min(runs[16]), min(runs[144])
report = {
    "load_s": load_s,
    "short": [ts, ns],
    "long": [tl, nl],
    "decode_tok_per_s": (nl - ns) / (tl - ts) if tl > ts and nl > ns else None,
}
print(json.dumps(report))
open(out, "w").write(json.dumps(report, indent=2))
