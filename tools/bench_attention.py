"""Time RoPE+KV append and attention on the GPU at several context lengths (2B-4T shapes by default).

Each measurement encodes `reps` steps of `layers` layers into one command buffer (layers chained
through shared q/out buffers, so every dispatch waits for the previous one as in the model), then
times only submit + completion; encoding cost is printed apart. Prints medians of `trials` runs,
per layer, in microseconds.

    python tools/bench_attention.py                 # H100-sized run
    python tools/bench_attention.py --quick         # seconds on lavapipe
    python tools/bench_attention.py --kv-dtype f16,f32 --max-splits 64,256   # one table per combination
    python tools/bench_attention.py --steps fused,split,combine \
        --variants "default;chunk=32,ks=2,splits=128;gv=2,direct=64"   # decode kernel variants

A variant is a list of options of attention_decode.wgsl: chunk=N (key rows per chunk), gv=N (queries per
value invocation), ks=N (K row parts per score invocation), splits=N (max splits), direct=N (largest
context decoded without split); "default" is the module's defaults.
Steps "split" and "combine" time the fused decode's two dispatches alone (at positions where it splits).
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
    parser.add_argument("--variants", default="default", help="decode variants, ';'-separated (see above)")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"steps to time, comma-separated ({', '.join(STEPS)})")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.context, args.positions, args.prefill_tokens = 2, 512, "16,300", 16
        args.reps, args.trials = 2, 2

    device = gpu.open_device()
    print(f"adapter: {device.adapter_name}, features: {sorted(device.features)}")
    kernels = KernelCache(device)
    steps = args.steps.split(",")
    if unknown := set(steps) - set(STEPS):
        parser.error(f"unknown steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    variants = [parse_variant(text) for text in args.variants.split(";")]
    for dtype in args.kv_dtype.split(","):
        # one filled cache per element type, shared by every variant (the fused steps rewrite row pos only)
        cache = KVCache(device, args.layers, args.kv_heads, args.head_dim, args.context, args.context, dtype=dtype)
        row = np.random.default_rng(0).standard_normal((args.context, args.kv_heads * args.head_dim))
        for layer in range(args.layers):
            cache.write_rows(layer, 0, row.astype(np.float32), row.astype(np.float32))
        for max_splits in [int(n) for n in args.max_splits.split(",")]:
            for variant in variants:
                run(args, device, kernels, cache, max_splits, variant, steps)
        cache.release()


# step label -> (tokens: 1 or the prefill size, ops recorded per layer)
STEPS = {
    "rope": ("decode rope+kv", 1, "rope"),
    "attn": ("decode attention", 1, "attn"),
    "rope+attn": ("decode rope+attention", 1, "rope attn"),
    "fused": ("decode fused rope+attn", 1, "fused"),
    "split": ("fused split kernel", 1, "split"),
    "combine": ("combine", 1, "combine"),
    "prefill": ("prefill attention", 0, "attn"),
}
VARIANT_OPTIONS = {
    "chunk": "decode_chunk",
    "gv": "decode_queries_per_thread",
    "ks": "decode_key_parts",
    "direct": "direct_max_rows",
    "splits": "max_splits",
}


def parse_variant(text: str) -> dict:
    """'chunk=64,splits=32' -> Attention keyword arguments (and max_splits for the scratch)."""
    options: dict = {}
    for word in text.strip().split(","):
        if word in ("", "default"):
            continue
        key, _, value = word.partition("=")
        if key not in VARIANT_OPTIONS or not value:
            raise SystemExit(f"bad variant option {word!r} in {text!r}; options: {', '.join(VARIANT_OPTIONS)}")
        options[VARIANT_OPTIONS[key]] = int(value)
    return options


def run(
    args: argparse.Namespace,
    device: gpu.Device,
    kernels: KernelCache,
    cache: KVCache,
    max_splits: int,
    variant: dict,
    steps: list[str],
) -> None:
    variant = dict(variant)
    max_splits = variant.pop("max_splits", max_splits)
    params = StepParams(device)
    n_heads, n_kv, hd = args.heads, args.kv_heads, args.head_dim
    max_tokens = args.prefill_tokens
    dtype = cache.dtype
    table = RopeTable(device, hd, 500000.0, args.context)
    scratch = AttentionScratch(device, n_heads, hd, args.context, max_splits=max_splits)
    rng = np.random.default_rng(0)
    qkv = device.buffer(max_tokens * (n_heads + 2 * n_kv) * hd * 4, gpu.STORAGE_USAGE, "qkv")
    device.upload(qkv, 0, rng.standard_normal(max_tokens * (n_heads + 2 * n_kv) * hd).astype(np.float32))
    q = device.buffer(max_tokens * n_heads * hd * 4, gpu.STORAGE_USAGE, "q")
    out = device.buffer(max_tokens * n_heads * hd * 4, gpu.STORAGE_USAGE, "out")
    ropes = [
        RopeKV(kernels, params, cache, i, table, qkv, q, n_heads=n_heads, style="neox", max_tokens=max_tokens)
        for i in range(args.layers)
    ]
    shared = dict(n_heads=n_heads, max_tokens=max_tokens, scratch=scratch, **variant)
    attns = [Attention(kernels, params, cache, i, q, out, **shared) for i in range(args.layers)]
    fused = [Attention(kernels, params, cache, i, q, out, rope=ropes[i], **shared) for i in range(args.layers)]

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
                    if "split" in ops or "combine" in ops:
                        record_part(recorder, fused[layer], ops, pos)
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
        f"variant {variant or 'default'}; "
        f"{args.layers} layers x {args.reps} steps per measurement; us per layer (GPU submit..done | CPU encode)"
    )
    print(f"| {'step':<22} | {'pos':>5} | {'disp/layer':>10} | {'GPU us/layer':>12} | {'encode us/layer':>15} |")
    print(f"| {'-' * 22} | {'-' * 5}:| {'-' * 10}:| {'-' * 12}:| {'-' * 15}:|")
    for pos in [int(p) for p in args.positions.split(",")]:
        for step in steps:
            label, n_tokens, ops = STEPS[step]
            if not n_tokens:
                label, n_tokens = f"prefill {args.prefill_tokens} attention", args.prefill_tokens
            if pos + n_tokens > args.context or (step in ("split", "combine") and pos + 1 <= fused[0].direct_max_rows):
                continue
            gpu_us, enc_us, disp = timed(n_tokens, pos, ops)
            print(f"| {label:<22} | {pos:>5} | {disp:>10} | {gpu_us:>12.1f} | {enc_us:>15.1f} |")
    for buffer in (qkv, q, out, table.buffer, scratch.acc, scratch.stats, params.buffer):
        device.release(buffer)


def record_part(recorder: gpu.Recorder, attention: Attention, ops: str, pos: int) -> None:
    """One of the split decode's two dispatches (as Attention.record dispatches them at `pos`)."""
    chunks = -(-(pos + 1) // attention.decode_chunk)
    splits = min(attention.scratch.max_splits, 1 << (chunks - 1).bit_length())
    if "split" in ops:
        recorder.dispatch(attention.rope_split_pipeline, attention.rope_split_group, splits, attention.n_kv_heads, 1)
    else:
        recorder.dispatch(attention.combine_pipeline, attention.combine_group, attention.n_heads, 1)


if __name__ == "__main__":
    main()
