"""Prefill on a real GPU: kernel variants timed in isolation, then inside the engine.

    python tools/device/prefill_probe.py MODEL.gguf [--out DIR] [--skip-sweep] [--smoke]

1. GEMM tilings at the four 2B-4T BitLinear shapes, T = 128 and 512: every tiling is built and
   checked against numpy first, then the GPU is kept busy for a second (NVIDIA's clock falls to
   ~345 MHz within half a second of idling and climbs back over seconds, which made the first
   sweep of device run 3 meaningless), then all are timed in interleaved rounds (minimum kept).
2. Prefill attention (attention_prefill.wgsl configurations and attention.wgsl's path) at 2B-4T
   head shapes for (T, pos) = (128, 0), (128, 384), (512, 0), (512, 1536), likewise.
3. The engine (synthetic 2B-4T model, 512-row chunks): host phases of the first prefill calls after
   load, then prefill wall time for each variant (baseline kernels, tiled attention, tiled attention
   + the fastest GEMM tiling per shape from 1.) at 128 / 512 / 1024 tokens in 128- and 512-row
   chunks, and a per-kernel GPU profile of a 512-token step of the last variant.
A table of everything is printed last; the full report goes to DIR/prefill_probe.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "app"))

from bitnet_web import gpu  # noqa: E402
from bitnet_web.engine import Engine  # noqa: E402
from bitnet_web.formats.quants import i2s_encode  # noqa: E402
from bitnet_web.kernels import attention as attention_mod  # noqa: E402
from bitnet_web.kernels import linear  # noqa: E402
from bitnet_web.kernels.attention import Attention  # noqa: E402
from bitnet_web.kernels.common import KernelCache, StepParams  # noqa: E402
from bitnet_web.kernels.kv_cache import KVCache  # noqa: E402
from bitnet_web.kernels.linear import TernaryLinear, TernaryMatrix, TernaryShapeError  # noqa: E402

TABLE: list[str] = []
REPS, ROUNDS, CONTEXT, TOKENS = 10, 4, 4096, 1  # --smoke lowers them (TOKENS divides the engine's sizes)


def note(line: str) -> None:
    print(line, flush=True)
    TABLE.append(line)


def keep_busy(device, record, seconds: float) -> None:
    """Submit `record` work back to back for `seconds` so the GPU clock is up before timing."""
    end = time.perf_counter() + seconds
    sync = device.buffer(16, label="busy sync")
    while time.perf_counter() < end:
        rec = device.begin()
        for _ in range(10):
            record(rec)
        rec.submit()
        device.read_sync(sync, 0, 4)
    device.release(sync)


def time_dispatches(device, record, reps: int, sync) -> float:
    """Microseconds per `record` call, `reps` in one submit (dependent: each writes the same output)."""
    rec = device.begin()
    for _ in range(reps):
        record(rec)
    t0 = time.perf_counter()
    rec.submit()
    device.read_sync(sync, 0, 4)
    return (time.perf_counter() - t0) / reps * 1e6


def interleaved(device, cases: dict[str, tuple], rounds: int = 5) -> dict[str, float]:
    """cases: name -> (prepare(), record(rec), reps). Min over rounds of us per call, all cases per round."""
    sync = device.buffer(16, label="sync")
    best = {name: math.inf for name in cases}
    for _ in range(rounds):
        for name, (prepare, record, reps) in cases.items():
            prepare()
            best[name] = min(best[name], time_dispatches(device, record, reps, sync))
    device.release(sync)
    return best


# 1. GEMM tilings ----------------------------------------------------------------------------------------

SHAPES = {  # name: (row counts of the fused tensors, K, epilogue)
    "qkv": ([2560, 640, 640], 2560, "store"),
    "wo": ([2560], 2560, "residual"),
    "gate_up": ([6912, 6912], 2560, "gate_relu2"),
    "down": ([2560], 6912, "residual"),
}

TILES = [  # the full 13-tiling sweep of device run 5 is in docs/performance.md; these are its leaders
    {"TX": 16, "TY": 8, "MR": 4, "MT": 4, "KB": 1},  # the default
    {"TX": 16, "TY": 8, "MR": 2, "MT": 8, "KB": 1},
    {"TX": 16, "TY": 16, "MR": 4, "MT": 4, "KB": 1},
]


def _with_tiles(base: type, tiles: dict) -> type:
    """TernaryLinear choosing its GEMM tile by matrix shape (n_rows, n_cols) from `tiles`."""

    class Tiled(base):
        def __init__(self, kernels, weights, *args, **kwargs):
            kwargs.setdefault("gemm_tile", tiles.get((weights.n_rows, weights.n_cols)))
            super().__init__(kernels, weights, *args, **kwargs)

    return Tiled


def tile_name(tile: dict) -> str:
    return f"{tile['TX']}x{tile['TY']} MR{tile['MR']} MT{tile['MT']} KB{tile['KB']}"


def gemm_sweep(device, report: dict, t_values: tuple[int, ...]) -> dict[tuple[int, int], dict]:
    """Returns the fastest tiling per (n_rows, k) by the sum of its times over t_values."""
    kernels = KernelCache(device)
    rng = np.random.default_rng(1)
    t_max = max(t_values)
    step = StepParams(device)
    ops: dict[str, dict[str, TernaryLinear]] = {}
    dims: dict[str, tuple[int, int]] = {}
    errors: dict[str, float] = {}
    for shape, (parts, k, epilogue) in SHAPES.items():
        values = [rng.integers(-1, 2, size=(n, k)).astype(np.int8) for n in parts]
        scales = [float(s) for s in rng.uniform(0.5, 2.0, len(parts))]
        matrix = TernaryMatrix.upload(
            device,
            [(i2s_encode(v, s)[: v.size // 4], s, v.shape) for v, s in zip(values, scales, strict=True)],
            shape,
            pair_rows=epilogue.startswith("gate"),
        )
        xq_i8 = rng.integers(-128, 128, size=(t_max, k)).astype(np.int8)
        xs = rng.uniform(0.001, 0.05, t_max).astype(np.float32)
        xq = device.buffer(xq_i8.nbytes, label="xq")
        device.upload(xq, 0, xq_i8.view(np.uint32))
        x_scale = device.buffer(xs.nbytes, label="xs")
        device.upload(x_scale, 0, xs)
        n = sum(parts)
        dims[shape] = (n, k)
        out_w = n // 2 if epilogue.startswith("gate") else n
        out = device.buffer(4 * t_max * out_w, label="out")
        t_chk = min(48, t_max)
        w_all = np.concatenate(values).astype(np.float64) * np.repeat(scales, parts)[:, None]
        y = (xq_i8[:t_chk].astype(np.float64) @ w_all.T) * xs[:t_chk, None]
        want = np.maximum(y[:, :out_w], 0) ** 2 * y[:, out_w:] if epilogue.startswith("gate") else y
        ops[shape] = {}
        for tile in TILES:
            name = tile_name(tile)
            try:
                op = TernaryLinear(kernels, matrix, xq, x_scale, out, step, epilogue, gemm_tile=tile)
            except TernaryShapeError as exc:
                print(f"skip {shape} {name}: {exc}", flush=True)
                continue
            device.upload(out, 0, np.zeros(t_chk * out_w, dtype=np.float32))
            step.write(t_chk, 0, 0)
            rec = device.begin()
            op.record(rec, t_chk)
            rec.submit()
            got = device.read_sync(out, 0, 4 * t_chk * out_w).view(np.float32).reshape(t_chk, out_w)
            err = float(np.abs(got - want).max() / np.abs(want).max())
            errors[f"{shape} {name}"] = err
            if err < 1e-5:
                ops[shape][name] = op
            else:
                note(f"WRONG: {shape} {name} max error {err:.2e}")
    step.write(t_max, 0, 0)
    first = ops["gate_up"][tile_name(TILES[0])]
    keep_busy(device, lambda r: first.record(r, t_max), 1.5 if REPS > 1 else 0.0)
    cases = {}
    for t in t_values:
        for shape, variants in ops.items():
            for name, op in variants.items():
                cases[(shape, t, name)] = (
                    lambda tt=t: step.write(tt, 0, 0),
                    lambda r, o=op, tt=t: o.record(r, tt),
                    REPS,
                )
    times = interleaved(device, cases, rounds=ROUNDS)
    report["gemm_us"] = {f"{s} T={t} {n}": us for (s, t, n), us in times.items()}
    report["gemm_check_errors"] = errors

    note(
        "GEMM us per dispatch (min of 4 interleaved rounds, clock held up); last column: us per token "
        "of one layer's 4 GEMMs at the largest T"
    )
    cols = [(s, t) for t in t_values for s in SHAPES]
    note(f"  {'tiling':<22}" + "".join(f"{s + ' T' + str(t):>14}" for s, t in cols) + "   us/tok")
    for tile in TILES:
        name = tile_name(tile)
        row = [times.get((s, t, name), math.nan) for s, t in cols]
        per_tok = sum(times.get((s, t_max, name), math.nan) for s in SHAPES) / t_max
        note(f"  {name:<22}" + "".join(f"{v:14.1f}" for v in row) + f"   {per_tok:6.3f}")
    best: dict[tuple[int, int], dict] = {}
    for shape in SHAPES:
        scored = {name: sum(times[(shape, t, name)] / t for t in t_values) for name in ops[shape]}
        winner = min(scored, key=scored.get)
        best[dims[shape]] = next(t for t in TILES if tile_name(t) == winner)
        note(f"  fastest for {shape}: {winner}")
    report["gemm_best"] = {f"{n}x{k}": tile for (n, k), tile in best.items()}
    return best


# 2. Prefill attention -----------------------------------------------------------------------------------

ATTENTION_CONFIGS = {  # name: Attention keyword arguments
    "legacy (attention.wgsl)": {"tiled_prefill": False},
    "tiled 32 rows, 4/thread": {"prefill_query_rows": 32, "prefill_rows_per_thread": 4},
    "tiled 32 rows, 2/thread": {"prefill_query_rows": 32, "prefill_rows_per_thread": 2},
    "tiled 16 rows, 2/thread": {"prefill_query_rows": 16, "prefill_rows_per_thread": 2},
}  # device run 5 also timed 16 rows x 4 and x 1 per thread: slower (docs/performance.md)


def attention_sweep(device, report: dict, points=((128, 0), (128, 384), (512, 0), (512, 1536))) -> str:
    kernels = KernelCache(device)
    n_heads, n_kv, hd, context = 20, 5, 128, CONTEXT
    t_max = max(t for t, _ in points)
    rng = np.random.default_rng(2)
    step = StepParams(device)
    cache = KVCache(device, 1, n_kv, hd, context, initial_capacity=context)
    rows = rng.standard_normal((context, n_kv * hd)).astype(np.float32)
    cache.write_rows(0, 0, rows, rng.standard_normal((context, n_kv * hd)).astype(np.float32))
    q = device.buffer(4 * t_max * n_heads * hd, label="q")
    device.upload(q, 0, rng.standard_normal(t_max * n_heads * hd).astype(np.float32))
    out = device.buffer(4 * t_max * n_heads * hd, label="out")
    ops = {}
    reference = None
    for name, options in ATTENTION_CONFIGS.items():
        op = Attention(kernels, step, cache, 0, q, out, n_heads=n_heads, max_tokens=t_max, **options)
        if "tiled" in name and op.tiled is None:
            print(f"skip attention {name}: does not fit", flush=True)
            continue
        step.write(t_max, 300, cache.capacity)  # agreement check between the kernels
        rec = device.begin()
        op.record(rec, t_max, 300)
        rec.submit()
        got = device.read_sync(out, 0, 4 * t_max * n_heads * hd).view(np.float32)
        if reference is None:
            reference = got
        err = float(np.abs(got - reference).max())
        if err > 1e-4:
            note(f"WRONG: attention {name} differs from the legacy kernel by {err:.2e}")
            continue
        ops[name] = op
    first = next(iter(ops.values()))
    t_last, pos_last = points[-1]
    step.write(t_last, pos_last, cache.capacity)
    keep_busy(device, lambda r: first.record(r, t_last, pos_last), 1.0 if REPS > 1 else 0.0)
    cases = {}
    for t, pos in points:
        for name, op in ops.items():
            cases[(t, pos, name)] = (
                lambda tt=t, pp=pos: step.write(tt, pp, cache.capacity),
                lambda r, o=op, tt=t, pp=pos: o.record(r, tt, pp),
                REPS,
            )
    times = interleaved(device, cases, rounds=ROUNDS)
    report["attention_us"] = {f"T={t} pos={p} {n}": us for (t, p, n), us in times.items()}
    note("prefill attention us per layer (2B-4T heads: 20 q, 5 kv, head_dim 128)")
    note(f"  {'kernel':<26}" + "".join(f"{'T' + str(t) + ' pos' + str(p):>15}" for t, p in points))
    for name in ops:
        note(f"  {name:<26}" + "".join(f"{times[(t, p, name)]:15.1f}" for t, p in points))
    winner = min(ops, key=lambda n: sum(times[(t, p, n)] / t for t, p in points))
    note(f"  fastest: {winner}")
    cache.release()
    return winner


# 3. The engine ------------------------------------------------------------------------------------------


def timed_forward(model, ids: list[int]) -> dict:
    """model.forward split into its host phases (ms)."""
    t0 = time.perf_counter()
    model.device.upload(model.token_ids, 0, np.asarray(ids, dtype=np.uint32))
    t1 = time.perf_counter()
    rec = model._record_step(len(ids), all_logits=False)
    t2 = time.perf_counter()
    rec.submit()
    t3 = time.perf_counter()
    model.cached_tokens.extend(ids)
    model.device.read_sync(model.logits, 0, 4 * model.config.vocab_size)
    t4 = time.perf_counter()
    return {
        "upload": 1e3 * (t1 - t0),
        "record": 1e3 * (t2 - t1),
        "submit": 1e3 * (t3 - t2),
        "wait": 1e3 * (t4 - t3),
        "total": 1e3 * (t4 - t0),
    }


def engine_section(path: Path, report: dict, best_tiles: dict | None, attention_winner: str | None) -> None:
    rng = np.random.default_rng(0)
    engine = Engine(prefill_chunk=512)
    engine.device = gpu.open_device(profile=True)
    t0 = time.perf_counter()
    engine.load(path)
    report["load_s"] = time.perf_counter() - t0
    model = engine.model
    vocab = engine.config.vocab_size
    ids = rng.integers(0, vocab, 1024).tolist()

    first = []
    for _ in range(4):
        model.truncate(0)
        first.append(timed_forward(model, ids[: 128 // TOKENS]))
    report["first_calls_128"] = first
    note("prefill-128 calls right after load (ms): upload / record / submit / wait / total")
    for i, p in enumerate(first):
        note(
            f"  call {i}: {p['upload']:.2f} / {p['record']:.2f} / {p['submit']:.2f} / {p['wait']:.2f} / "
            f"{p['total']:.2f}"
        )

    original = linear.TernaryLinear, attention_mod.PREFILL_QUERY_ROWS, attention_mod.PREFILL_ROWS_PER_THREAD
    variants = {"baseline (legacy attention, 16x8 MR4 MT4)": (None, (), 4)}
    if attention_winner and attention_winner.startswith("tiled"):
        options = ATTENTION_CONFIGS[attention_winner]
        rows, per_thread = (options["prefill_query_rows"],), options["prefill_rows_per_thread"]
        variants["tiled attention"] = (None, rows, per_thread)
        if best_tiles:
            variants["tiled attention + fastest GEMM tiles"] = (best_tiles, rows, per_thread)
    cases = [
        (
            f"{n // TOKENS} in {n // c} {'chunk' if n == c else 'queued chunks'} of {c // TOKENS}",
            n // TOKENS,
            c // TOKENS,
        )
        for n, c in ((128, 128), (512, 128), (512, 512), (1024, 512))
    ]
    results: dict[str, dict[str, list[float]]] = {}
    for variant, (tiles, rows, per_thread) in variants.items():
        linear.TernaryLinear = _with_tiles(original[0], tiles) if tiles else original[0]
        attention_mod.PREFILL_QUERY_ROWS, attention_mod.PREFILL_ROWS_PER_THREAD = rows, per_thread
        model._build_ops()
        warm_until = time.perf_counter() + (1.0 if REPS > 1 else 0.0)  # clocks up: a second of prefills
        while time.perf_counter() < warm_until:
            model.truncate(0)
            asyncio.run(model.prefill(ids[: 512 // TOKENS]))
        results[variant] = {}
        for label, n, chunk in cases:

            def once(n=n, chunk=chunk):
                model.truncate(0)
                asyncio.run(model.prefill(ids[:n], chunk=chunk))

            once()
            samples = []
            for _ in range(5 if REPS > 1 else 1):
                t0 = time.perf_counter()
                once()
                samples.append(1e3 * (time.perf_counter() - t0))
            results[variant][label] = samples
    model.truncate(0)
    rec = model._record_step(512 // TOKENS, all_logits=False, rec=model.device.begin_profiled())
    rec.submit()
    profile = model.device.read_profile(rec)
    linear.TernaryLinear, attention_mod.PREFILL_QUERY_ROWS, attention_mod.PREFILL_ROWS_PER_THREAD = original
    engine.close()

    report["prefill_ms"] = results
    note("engine prefill, median of 5 after a warm-up: ms -> tok/s")
    note(f"  {'variant':<44}" + "".join(f"{label:>32}" for label, _, _ in cases))
    for variant, row in results.items():
        cells = []
        for label, n, _ in cases:
            med = statistics.median(row[label])
            cells.append(f"{med:9.2f} ms {n / med * 1e3:8.0f} tok/s")
        note(f"  {variant:<44}" + "".join(f"{c:>32}" for c in cells))

    groups: dict[str, list[float]] = {}
    for label, us in profile:
        name = label.split(":")[0]
        if name == "ternary_gemm":
            fields = dict(f.split("=", 1) for f in label.split() if "=" in f)
            name += f" N={fields.get('N')} K={fields.get('K')}"
        groups.setdefault(name, []).append(us)
    report["profile_512"] = {name: [len(v), sum(v)] for name, v in groups.items()}
    note(f"GPU profile of a 512-token step ({list(variants)[-1]}): total {sum(u for _, u in profile) / 1e3:.2f} ms")
    for name, v in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
        note(f"    {name:<34} {len(v):4d} x {statistics.median(v):8.1f} = {sum(v) / 1e3:7.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--out", default=".")
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a CPU adapter check of this script)")
    args = parser.parse_args()
    t_values = (128, 512)
    if args.smoke:
        SHAPES.update({name: ([n // 16 for n in parts], 384, e) for name, (parts, k, e) in SHAPES.items()})
        del TILES[3:]
        t_values = (32, 64)
        global REPS, ROUNDS, CONTEXT, TOKENS
        REPS, ROUNDS, CONTEXT, TOKENS = 1, 1, 256, 16
    report: dict = {}
    best_tiles, attention_winner = None, None
    try:
        if not args.skip_sweep:
            device = gpu.open_device()
            print(f"workgroup storage limit {device.limits.max_compute_workgroup_storage_size}", flush=True)
            best_tiles = gemm_sweep(device, report, t_values)
            attention_winner = attention_sweep(
                device, report, ((32, 0), (64, 40)) if args.smoke else ((128, 0), (128, 384), (512, 0), (512, 1536))
            )
            device.destroy()
        if not args.skip_engine:
            engine_section(Path(args.model), report, best_tiles, attention_winner)
    finally:
        Path(args.out, "prefill_probe.json").write_text(json.dumps(report, indent=1, default=str))
        print("\n==== summary ====")
        print("\n".join(TABLE))


if __name__ == "__main__":
    main()
