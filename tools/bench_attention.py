"""Time RoPE+KV append and attention on the GPU at several context lengths (2B-4T shapes by default).

Each measurement encodes `reps` steps of `layers` layers into one command buffer (layers chained
through shared q/out buffers, so every dispatch waits for the previous one as in the model), then
times only submit + completion; encoding cost is printed apart. Prints medians of `trials` runs,
per layer, in microseconds.

    python tools/bench_attention.py                 # H100-sized run
    python tools/bench_attention.py --quick         # seconds on lavapipe
    python tools/bench_attention.py --kv-dtype f16,f32 --max-splits 64,256   # one table per combination
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "app"))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from bitnet_web import gpu  # noqa: E402
from bitnet_web.kernels.attention import MAX_SPLITS, Attention, AttentionScratch  # noqa: E402
from bitnet_web.kernels.common import KernelCache, StepParams  # noqa: E402
from bitnet_web.kernels.kv_cache import KVCache  # noqa: E402
from bitnet_web.kernels.rope import RopeKV, RopeTable  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--kv-heads", type=int, default=5)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--positions", default="64,256,1024,2048,4000")
    parser.add_argument("--prefill-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for a CPU adapter")
    parser.add_argument("--kv-dtype", default="f16", help="KV cache element types, comma-separated (f16, f32)")
    parser.add_argument("--max-splits", default=str(MAX_SPLITS), help="decode split counts, comma-separated")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.context, args.positions, args.prefill_tokens = 2, 512, "16,300", 16
        args.reps, args.trials = 2, 2

    device = gpu.open_device()
    print(f"adapter: {device.adapter_name}, features: {sorted(device.features)}")
    kernels = KernelCache(device)
    for dtype in args.kv_dtype.split(","):
        for max_splits in [int(n) for n in args.max_splits.split(",")]:
            run(args, device, kernels, dtype, max_splits)


def run(args: argparse.Namespace, device: gpu.Device, kernels: KernelCache, dtype: str, max_splits: int) -> None:
    params = StepParams(device)
    n_heads, n_kv, hd = args.heads, args.kv_heads, args.head_dim
    max_tokens = args.prefill_tokens
    cache = KVCache(device, args.layers, n_kv, hd, args.context, initial_capacity=args.context, dtype=dtype)
    table = RopeTable(device, hd, 500000.0, args.context)
    scratch = AttentionScratch(device, n_heads, hd, args.context, max_splits=max_splits)
    rng = np.random.default_rng(0)
    qkv = device.buffer(max_tokens * (n_heads + 2 * n_kv) * hd * 4, gpu.STORAGE_USAGE, "qkv")
    device.upload(qkv, 0, rng.standard_normal(max_tokens * (n_heads + 2 * n_kv) * hd).astype(np.float32))
    q = device.buffer(max_tokens * n_heads * hd * 4, gpu.STORAGE_USAGE, "q")
    out = device.buffer(max_tokens * n_heads * hd * 4, gpu.STORAGE_USAGE, "out")
    row = rng.standard_normal((args.context, n_kv * hd)).astype(np.float32)
    for layer in range(args.layers):
        cache.write_rows(layer, 0, row, row)
    ropes = [
        RopeKV(kernels, params, cache, i, table, qkv, q, n_heads=n_heads, style="neox", max_tokens=max_tokens)
        for i in range(args.layers)
    ]
    attns = [
        Attention(kernels, params, cache, i, q, out, n_heads=n_heads, max_tokens=max_tokens, scratch=scratch)
        for i in range(args.layers)
    ]
    fused = [
        Attention(
            kernels, params, cache, i, q, out, n_heads=n_heads, max_tokens=max_tokens, scratch=scratch, rope=ropes[i]
        )
        for i in range(args.layers)
    ]

    def timed(n_tokens: int, pos: int, ops: str) -> tuple[float, float, int]:
        params.write(n_tokens, pos, cache.capacity)
        gpu_times, enc_times = [], []
        dispatches = 0
        for _ in range(args.trials + 1):  # first run warms pipelines and clocks
            t0 = time.perf_counter()
            recorder = device.begin()
            for _ in range(args.reps):
                for layer in range(args.layers):
                    if "rope" in ops:
                        ropes[layer].record(recorder, n_tokens)
                    if "attn" in ops:
                        attns[layer].record(recorder, n_tokens, pos)
                    if "fused" in ops:
                        fused[layer].record(recorder, n_tokens, pos)
            t1 = time.perf_counter()
            recorder.submit()
            device.read_sync(out, 0, 16)
            t2 = time.perf_counter()
            gpu_times.append(t2 - t1)
            enc_times.append(t1 - t0)
            dispatches = recorder.dispatches
        per = args.reps * args.layers
        return (
            statistics.median(gpu_times[1:]) / per * 1e6,
            statistics.median(enc_times[1:]) / per * 1e6,
            dispatches // per,
        )

    # Baseline: submit + read of nothing, to subtract from short runs by eye.
    t0 = time.perf_counter()
    for _ in range(5):
        device.begin().submit()
        device.read_sync(out, 0, 16)
    print(
        f"empty submit + 16-byte read: {(time.perf_counter() - t0) / 5 * 1e6:.0f} us "
        f"(spread over {args.reps * args.layers} layers per measurement)"
    )
    print(
        f"shapes: {n_heads} q heads, {n_kv} kv heads, head_dim {hd}; {dtype} KV cache, max_splits {max_splits}; "
        f"{args.layers} layers x {args.reps} steps per measurement; us per layer (GPU submit..done | CPU encode)"
    )
    print(f"| {'step':<22} | {'pos':>5} | {'disp/layer':>10} | {'GPU us/layer':>12} | {'encode us/layer':>15} |")
    print(f"| {'-' * 22} | {'-' * 5}:| {'-' * 10}:| {'-' * 12}:| {'-' * 15}:|")
    for pos in [int(p) for p in args.positions.split(",")]:
        for label, n_tokens, ops in (
            ("decode rope+kv", 1, "rope"),
            ("decode attention", 1, "attn"),
            ("decode rope+attention", 1, "rope attn"),
            ("decode fused rope+attn", 1, "fused"),
            (f"prefill {args.prefill_tokens} attention", args.prefill_tokens, "attn"),
        ):
            if pos + n_tokens > args.context:
                continue
            gpu_us, enc_us, disp = timed(n_tokens, pos, ops)
            print(f"| {label:<22} | {pos:>5} | {disp:>10} | {gpu_us:>12.1f} | {enc_us:>15.1f} |")
    cache.release()
    for buffer in (qkv, q, out, table.buffer, scratch.acc, scratch.stats, params.buffer):
        device.release(buffer)


if __name__ == "__main__":
    main()
