"""Time the K1 kernels (norms, ternary GEMV/GEMM, LM head, argmax, embedding) on this machine's GPU.

Shapes are BitNet b1.58 2B-4T's (dim 2560, ffn 6912, 20/5 heads of 128, vocab 128256), weights are
random. Each measurement records REPS dependent dispatches of one op per submit (each writes the
buffer the next one writes, so the GPU runs them one after another, as in a decode step), queues
STEPS submits back to back, waits once, and reports the median over ROUNDS of wall time / dispatch.
GB/s counts the bytes each dispatch must read (weights + activations).

    python tools/bench_kernels.py               # the default configuration of every op
    python tools/bench_kernels.py --sweep       # also GEMV rows x workgroup and LM-head variants
    python tools/bench_kernels.py --only gemv   # ops whose name contains 'gemv'
    python tools/bench_kernels.py --only rows   # the fused linear layers and LM head over T = 1..9 rows
    python tools/bench_kernels.py --verify-steps  # a whole 2B-4T forward step over T = 1..9 rows vs T = 1
    python tools/bench_kernels.py --verify-steps --padded 8  # 9 dispatched rows with drafts of 0..8 vs d + 1 rows
    python tools/bench_kernels.py --verify-steps --model static/models/bitnet-pystdlib-27m-i2_s.gguf  # any GGUF
    python tools/bench_kernels.py --direct-sweep  # whole steps per context and direct-attention threshold
    python tools/bench_kernels.py --gemv-sweep default,16x2x4  # whole steps per fused-GEMV tiling
    python tools/bench_kernels.py --gemv-sweep default,8x4x4x32 --ablate-rows 1,7 --model FILE  # xTHREADS, T rows
    python tools/bench_kernels.py --splits-sweep 64,128 --contexts 1024,4000  # per decode-attention split cap
    python tools/bench_kernels.py --walks tiles,lanes,lanes2 --contexts 16,64,1024,4000  # decode attention walks
    python tools/bench_kernels.py --ablate none,attention,head --contexts 64,4000  # wall cost of each part
    python tools/bench_kernels.py --ablate none,combine --contexts 64,4000  # ... of the split-combine dispatch
    python tools/bench_kernels.py --dispatch-floor  # what a chain of dependent dispatches costs by itself
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "app"))

from bitnet_web import gpu  # noqa: E402
from bitnet_web.kernels import linear as linear_module  # noqa: E402
from bitnet_web.kernels.common import SMALL_T_MAX, KernelCache, StepParams  # noqa: E402
from bitnet_web.kernels.embedding import LM_HEAD_SMALL_T_ROWS, Argmax, EmbeddingLookup, F16Matrix, LMHead  # noqa: E402
from bitnet_web.kernels.linear import (  # noqa: E402
    ROWS_GEMV_ROWS,
    SMALL_T_PATH,
    SMALL_T_PATHS,
    NormTernaryLinear,
    TernaryLinear,
    TernaryMatrix,
    TernaryShapeError,
)
from bitnet_web.kernels.norm import RMSNorm, RMSNormQuant  # noqa: E402

DIM, FFN, Q_DIM, KV_DIM, VOCAB = 2560, 6912, 2560, 640, 128256


def random_codes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    # Any byte without a code-3 field: four codes from {0, 1, 2}.
    table = np.array(
        [a << 6 | b << 4 | c << 2 | d for a in range(3) for b in range(3) for c in range(3) for d in range(3)],
        dtype=np.uint8,
    )
    return table[rng.integers(0, 81, size=n * k // 4)]


class Bench:
    def __init__(self, device: gpu.Device, steps: int, rounds: int, target_s: float):
        self.device = device
        self.kernels = KernelCache(device)
        self.steps, self.rounds, self.target_s = steps, rounds, target_s
        self.sync_buffer = device.buffer(16, label="bench sync")
        self.rows: list[tuple[str, float, float | None, str]] = []

    def wait(self) -> None:
        self.device.read_sync(self.sync_buffer, 0, 4)

    def time_op(self, name: str, record, bytes_read: int | None, note: str = "") -> None:
        """record(recorder) adds one dispatch group (one op call) to a recorder."""
        # Warm up (pipelines built on first use), then calibrate: how many calls fit in target_s / steps per submit.
        recorder = self.device.begin()
        record(recorder)
        recorder.submit()
        self.wait()
        recorder = self.device.begin()
        record(recorder)
        t0 = time.perf_counter()
        recorder.submit()
        self.wait()
        once = max(time.perf_counter() - t0, 1e-6)
        reps = int(min(max(self.target_s / self.steps / once, 4), 500))
        samples = []
        for _ in range(self.rounds):
            recorders = []
            for _ in range(self.steps):
                rec = self.device.begin()
                for _ in range(reps):
                    record(rec)
                recorders.append(rec)
            self.wait()
            t0 = time.perf_counter()
            for rec in recorders:
                rec.submit()
            self.wait()
            samples.append((time.perf_counter() - t0) / (self.steps * reps))
        median = statistics.median(samples)
        gbps = bytes_read / median / 1e9 if bytes_read else None
        self.rows.append((name, median * 1e6, gbps, note))
        gb = f"{gbps:8.1f}" if gbps is not None else "       -"
        print(f"{name:<44} {median * 1e6:10.2f} us {gb} GB/s  {note}", flush=True)


def bench_attention_ops(bench: Bench, want, t_max: int, positions=(64, 1024, 4000)) -> None:
    """K2's ops at 2B-4T shapes (20 q heads, 5 KV heads, head_dim 128, context 4096): RoPE + KV append,
    attention decode (split + combine), decode with RoPE fused, and a T=t_max prefill chunk.
    GB/s counts the K/V rows read. (tools/bench_attention.py times the same ops as 30-layer chains.)"""
    from bitnet_web.kernels.attention import Attention, AttentionScratch  # noqa: PLC0415
    from bitnet_web.kernels.kv_cache import KVCache  # noqa: PLC0415
    from bitnet_web.kernels.rope import RopeKV, RopeTable  # noqa: PLC0415

    labels = [
        f"{op} pos={pos}"
        for pos in positions
        for op in ("rope_kv T=1", "attention decode", "attention decode fused rope", f"attention prefill T={t_max}")
    ]
    if not any(want(label) for label in labels):
        return
    device, k = bench.device, bench.kernels
    n_heads, n_kv, hd, context = 20, 5, 128, 4096
    rng = np.random.default_rng(1)
    step = StepParams(device)
    cache = KVCache(device, 1, n_kv, hd, context, initial_capacity=context)
    rows = rng.standard_normal((context, n_kv * hd)).astype(np.float32)
    cache.write_rows(0, 0, rows, rows)
    qkv = device.buffer(4 * t_max * (n_heads + 2 * n_kv) * hd, label="qkv")
    device.upload(qkv, 0, rng.standard_normal(t_max * (n_heads + 2 * n_kv) * hd).astype(np.float32))
    q = device.buffer(4 * t_max * n_heads * hd, label="q")
    out = device.buffer(4 * t_max * n_heads * hd, label="attn out")
    table = RopeTable(device, hd, 500000.0, context)
    scratch = AttentionScratch(device, n_heads, hd, context)
    rope = RopeKV(k, step, cache, 0, table, qkv, q, n_heads=n_heads, style="neox", max_tokens=t_max)
    plain = Attention(k, step, cache, 0, q, out, n_heads=n_heads, max_tokens=t_max, scratch=scratch)
    fused = Attention(k, step, cache, 0, q, out, n_heads=n_heads, max_tokens=t_max, scratch=scratch, rope=rope)
    kv_row = 2 * cache.row_bytes
    for pos in positions:
        step.write(1, pos, cache.capacity)
        if want(f"rope_kv T=1 pos={pos}"):
            bench.time_op(f"rope_kv T=1 pos={pos}", lambda r: rope.record(r, 1), None)
        if want(f"attention decode pos={pos}"):
            bench.time_op(
                f"attention decode pos={pos}",
                lambda r, p=pos: plain.record(r, 1, p),
                (pos + 1) * kv_row,
                "split + combine",
            )
        if want(f"attention decode fused rope pos={pos}"):
            bench.time_op(
                f"attention decode fused rope pos={pos}",
                lambda r, p=pos: fused.record(r, 1, p),
                (pos + 1) * kv_row,
                "rope fused in",
            )
        if want(f"attention prefill T={t_max} pos={pos}") and t_max > 1 and pos + t_max <= context:
            step.write(t_max, pos, cache.capacity)
            bench.time_op(f"attention prefill T={t_max} pos={pos}", lambda r: plain.record(r, t_max), None)
    step.write(1, 0, 0)
    cache.release()


def bench_verify_steps(args: argparse.Namespace) -> None:
    """A whole forward step over T = 1..SMALL_T_MAX rows (all logits, then an argmax per row: what a
    speculative verify step computes) on the synthetic 2B-4T model, against T = 1. Wall time per step
    of steps recorded beforehand and queued back to back (GPU time, no encoding), median of rounds;
    then one profiled step per T for the time per kernel."""
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415
    from bitnet_web.engine import Engine  # noqa: PLC0415

    engine = Engine()
    engine.device = gpu.open_device(profile=True)
    engine.load(args.model or synthetic_model(args.shape))
    model, device = engine.model, engine.device
    print(f"device: {device.adapter_name}; {args.model or 'synthetic ' + args.shape}, context {args.context}")
    vocab = model.config.vocab_size
    ids = device.buffer(4 * SMALL_T_MAX, label="verify ids")
    argmaxes = [Argmax(model.kernels, model.logits, ids, vocab, slot=t, row=t) for t in range(SMALL_T_MAX)]

    def record(t: int, rec=None):
        rec = model._record_step(t, all_logits=True, rec=rec, pos=args.context)
        for op in argmaxes[:t]:
            op.record(rec)
        return rec

    for path in args.paths.split(","):
        if path not in SMALL_T_PATHS:
            raise SystemExit(f"--paths: unknown small-T path {path!r}; expected some of {', '.join(SMALL_T_PATHS)}")
        for layer in model.layer_ops:
            for op in (layer.qkv, layer.wo, layer.gate_up, layer.down):
                op.small_t_path = path
        print(f"\n## small-T path {path!r} (default {SMALL_T_PATH!r})", flush=True)
        if args.padded:
            time_padded_steps(args, model, record)
        else:
            time_verify_steps(args, device, record)
    engine.close()


def time_padded_steps(args: argparse.Namespace, model, record) -> None:
    """Verify steps of k + 1 dispatched rows whose StepParams say d + 1 (a draft of d tokens: the rows
    past it exit at once) against steps of d + 1 rows, alternating, for d = 0..k: what the padding costs."""
    device, k = model.device, args.padded

    def padded(d: int):
        rec = record(k + 1)
        model.step.write(d + 1, args.context, model.kv_cache.capacity)  # the last write before the submits
        return rec

    warm = [record(1) for _ in range(50)]
    for rec in warm:
        rec.submit()
    results = {}
    for rnd in range(2):
        for d in range(k + 1):
            results[(rnd, "rows", d)] = time_steps(device, lambda d=d: record(d + 1), args.steps * 4, args.rounds)
            results[(rnd, "padded", d)] = time_steps(device, lambda d=d: padded(d), args.steps * 4, args.rounds)
    one = min(results[(r, "rows", 0)] for r in range(2))
    print(f"\n| draft d | d + 1 rows (ms) | {k + 1} rows, n_tokens d + 1 (ms) | padded / rows | rows x T=1 |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for d in range(k + 1):
        rows = [results[(r, "rows", d)] * 1e3 for r in range(2)]
        pad = [results[(r, "padded", d)] * 1e3 for r in range(2)]
        print(
            f"| {d} | {rows[0]:.3f} / {rows[1]:.3f} | {pad[0]:.3f} / {pad[1]:.3f} | "
            f"{min(pad) / min(rows):.3f} | {min(rows) / (one * 1e3):.2f} |",
            flush=True,
        )


def time_steps(device, record, n_steps: int, rounds: int) -> float:
    """Median over `rounds` of wall seconds per step: `n_steps` recorders from record() (built first),
    submitted back to back, one wait."""
    sync = device.buffer(16, label="sync")
    record().submit()  # pipelines built before timing
    device.read_sync(sync, 0, 4)
    samples = []
    for _ in range(rounds):
        recorders = [record() for _ in range(n_steps)]
        device.read_sync(sync, 0, 4)
        t0 = time.perf_counter()
        for rec in recorders:
            rec.submit()
        device.read_sync(sync, 0, 4)
        samples.append((time.perf_counter() - t0) / n_steps)
    return statistics.median(samples)


def ready_for_steps(model, contexts: list[int], warm_steps: int = 30) -> None:
    """Make a loaded model's whole steps timeable at these cached contexts: KV rows for them (and a
    3-row verify step), the verify-rows kernels (T > 1 as a verify step runs it: RoPE fused, rows as
    their decode steps), then warm-up steps so the GPU clocks up before the first timed round."""
    model.kv_cache.ensure_capacity(max(contexts) + 3)
    for layer in model.layer_ops:
        layer.attention.prepare_draft_rows()
    for rec in [model._record_step(1, all_logits=True, pos=contexts[0]) for _ in range(warm_steps)]:
        rec.submit()


def print_context_tables(results: dict, columns: list, contexts: list[int], header, rows=(1, 3)) -> None:
    """Markdown tables of a sweep over contexts, one per T in `rows`: results[(pass, column, context, T)]
    in seconds, both passes per cell; header(column) names a column."""
    for t in rows:
        print(f"\n| T = {t}: context | " + " | ".join(header(c) for c in columns) + " |")
        print("| ---: |" + " ---: |" * len(columns))
        for ctx in contexts:
            cells = [f"{results[(0, c, ctx, t)] * 1e3:.3f} / {results[(1, c, ctx, t)] * 1e3:.3f}" for c in columns]
            print(f"| {ctx} | " + " | ".join(cells) + " |")


def bench_direct_sweep(args: argparse.Namespace) -> None:
    """Whole synthetic-model steps (1 row, and 3: a verify step of drafts of 2) at several cached
    contexts, for each threshold under which decode attention runs as one dispatch per layer (one
    workgroup per KV head walks every tile) instead of split over workgroups + a combine dispatch
    (kernels/attention.py DIRECT_MAX_TILES). Wall ms per step, steps queued back to back."""
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415
    from bitnet_web.engine import Engine  # noqa: PLC0415
    from bitnet_web.kernels import attention  # noqa: PLC0415

    engine = Engine()
    engine.load(synthetic_model(args.shape))
    model, device = engine.model, engine.device
    contexts = [int(c) for c in args.contexts.split(",")]
    thresholds = [int(d) for d in args.direct_tiles.split(",")]
    tile = model.layer_ops[0].attention.tile
    default = attention.DIRECT_MAX_TILES
    print(f"device: {device.adapter_name}; synthetic {args.shape}; tile {tile} rows; default {default} tiles")
    ready_for_steps(model, contexts, warm_steps=50)
    results: dict[tuple[int, int, int], float] = {}
    for rnd in range(2):  # two passes over the grid: drift shows as a difference between them
        for direct in thresholds:
            attention.DIRECT_MAX_TILES = direct
            for ctx in contexts:
                for t in (1, 3):
                    step = lambda t=t, ctx=ctx: model._record_step(t, all_logits=True, pos=ctx)  # noqa: E731
                    s = time_steps(device, step, 32, args.rounds)
                    results[(rnd, direct, ctx, t)] = s
                    print(f"pass {rnd} direct<{direct * tile:4d} ctx {ctx:5d} T={t}: {s * 1e3:7.3f} ms", flush=True)
    attention.DIRECT_MAX_TILES = default
    engine.close()
    print_context_tables(results, thresholds, contexts, lambda d: f"direct < {d * tile}")


def bench_splits_sweep(args: argparse.Namespace) -> None:
    """Whole synthetic-model steps (1 row, and 3) at several cached contexts for each cap on the
    workgroups one KV head's decode attention is split over (kernels/attention.py MAX_SPLITS); the model
    is loaded once per cap. Wall ms per step, steps queued back to back, two passes."""
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415
    from bitnet_web.engine import Engine  # noqa: PLC0415
    from bitnet_web.kernels.attention import AttentionScratch  # noqa: PLC0415

    contexts = [int(c) for c in args.contexts.split(",")]
    caps = [int(c) for c in args.splits_sweep.split(",")]
    path = synthetic_model(args.shape)
    original_init = AttentionScratch.__init__
    results: dict[tuple[int, int, int, int], float] = {}
    for rnd in range(2):
        for cap in caps:

            def init(self, *a, cap=cap, **kw):
                original_init(self, *a, max_splits=cap, **kw)

            AttentionScratch.__init__ = init
            engine = Engine()
            try:
                engine.load(path)
                model = engine.model
                ready_for_steps(model, contexts)
                for ctx in contexts:
                    for t in (1, 3):
                        step = lambda t=t, ctx=ctx, model=model: model._record_step(t, all_logits=True, pos=ctx)  # noqa: E731
                        results[(rnd, cap, ctx, t)] = s = time_steps(engine.device, step, 32, args.rounds)
                        print(f"pass {rnd} splits <= {cap} ctx {ctx} T={t}: {s * 1e3:7.3f} ms", flush=True)
            finally:
                engine.close()
                AttentionScratch.__init__ = original_init
    print_context_tables(results, caps, contexts, lambda c: f"splits <= {c}")


def bench_walks(args: argparse.Namespace) -> None:
    """Whole synthetic-model steps (T in --ablate-rows) at several cached contexts for each walk of the
    one-token attention workgroups: `tiles` (the tile walk), `lanes` (the lane-group walk, LANE_ROWS
    rows per group and step) or `lanesR` (R rows a step); options `-dN`, `-mN`, `-cN` and `-lN` set
    DIRECT_MAX_TILES, MAX_SPLITS, SPLIT_CAP and LANES_GPU to N (e.g. lanes,lanes2-d16-c32). The model is
    loaded once per walk and pass. Wall ms per step, two passes."""
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415
    from bitnet_web.engine import Engine  # noqa: PLC0415
    from bitnet_web.kernels import attention  # noqa: PLC0415

    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(t) for t in args.ablate_rows.split(",")]
    walks = args.walks.split(",")
    path = synthetic_model(args.shape)
    option_names = {
        "d": "DIRECT_MAX_TILES",
        "m": "MAX_SPLITS",
        "c": "SPLIT_CAP",
        "l": "LANES_GPU",
    }
    names = ("USE_LANES", "LANE_ROWS", *option_names.values())
    saved = {name: getattr(attention, name) for name in names}
    results: dict[tuple[int, str, int, int], float] = {}
    for rnd in range(2):
        for walk in walks:
            name, *options = walk.split("-")
            if name != "tiles" and not name.startswith("lanes") or any(o[:1] not in option_names for o in options):
                raise SystemExit(f"--walks: unknown walk {walk!r} (tiles, lanes, lanesR, each with -dN, -mN, -cN, -lN)")
            attention.USE_LANES = name != "tiles"
            attention.LANE_ROWS = int(name[5:]) if name[5:] else saved["LANE_ROWS"]
            for option in options:
                setattr(attention, option_names[option[0]], int(option[1:]))
            engine = Engine()
            try:
                engine.load(path)
                model = engine.model
                ready_for_steps(model, contexts)
                lanes = model.layer_ops[0].attention.lanes
                for ctx in contexts:
                    for t in rows:
                        step = lambda t=t, ctx=ctx, model=model: model._record_step(t, all_logits=True, pos=ctx)  # noqa: E731
                        results[(rnd, walk, ctx, t)] = s = time_steps(engine.device, step, 32, args.rounds)
                        print(f"pass {rnd} {walk} (lanes {lanes}) ctx {ctx} T={t}: {s * 1e3:7.3f} ms", flush=True)
            finally:
                engine.close()
                for name, value in saved.items():
                    setattr(attention, name, value)
    print_context_tables(results, walks, contexts, str, rows)


FLOOR_WGSL = """
@group(0) @binding(0) var<storage, read_write> buf: array<u32>;
@compute @workgroup_size(${WG})
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    buf[gid.x] = buf[gid.x] + 1u;  // every dispatch reads what the previous one wrote: a dependent chain
}
"""


def bench_dispatch_floor(args: argparse.Namespace) -> None:
    """What a chain of dependent dispatches costs by itself: N dispatches of a kernel that only
    increments its buffer (each reads what the last wrote), per submit, several workgroup counts;
    wall us per dispatch, steps queued back to back. A decode step's dispatch count times this is the
    part of its time no kernel can remove."""
    from string import Template  # noqa: PLC0415

    device = gpu.open_device()
    n = args.floor_dispatches
    print(f"device: {device.adapter_name}; {n} dependent dispatches per submit")
    print("\n| workgroups x invocations | us / dispatch |\n| --- | ---: |")
    for workgroups, size in ((1, 64), (132, 64), (132, 256), (1056, 256)):
        pipeline = device.pipeline(Template(FLOOR_WGSL).substitute(WG=size), f"floor {size}")
        buffer = device.buffer(4 * workgroups * size, label="floor")
        group = device.bind_group(pipeline, [buffer], "floor")

        def record(pipeline=pipeline, group=group, workgroups=workgroups):
            rec = device.begin()
            for _ in range(n):
                rec.dispatch(pipeline, group, workgroups)
            return rec

        s = time_steps(device, record, 16, args.rounds)
        print(f"| {workgroups} x {size} | {s / n * 1e6:.2f} |", flush=True)


ABLATIONS = ("none", "attention", "combine", "qkv", "wo", "gate_up", "down", "gemvs", "head", "layers")


class RecorderWithout:
    """A recorder that leaves out the dispatches of one pipeline and passes everything else on."""

    def __init__(self, recorder, pipeline):
        self._recorder, self._pipeline = recorder, pipeline

    def dispatch(self, pipeline, *args, **kwargs) -> None:
        if pipeline is not self._pipeline:
            self._recorder.dispatch(pipeline, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._recorder, name)


def bench_ablation(args: argparse.Namespace) -> None:
    """Where a whole step's wall time goes: synthetic-model steps (T = 1 and 3) at --contexts with one
    part left out of the recording (its dispatches not recorded; the numbers it would write stay as
    they were), against the full step in the same pass. A part's wall cost is the difference: dispatch
    profiles sum each kernel's own GPU time, which small dependent kernels overstate. Not outputs."""
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415
    from bitnet_web.engine import Engine  # noqa: PLC0415

    contexts = [int(c) for c in args.contexts.split(",")]
    parts = args.ablate.split(",")
    unknown = [p for p in parts if p not in ABLATIONS]
    if unknown:
        raise SystemExit(f"--ablate: unknown part(s) {unknown}; expected some of {', '.join(ABLATIONS)}")
    engine = Engine()
    engine.load(args.model or synthetic_model(args.shape))
    model, device = engine.model, engine.device
    ready_for_steps(model, contexts)
    rows = [int(t) for t in args.ablate_rows.split(",")]

    def ops_of(part: str) -> list:
        layers = model.layer_ops
        if part in ("attention", "combine"):
            return [layer.attention for layer in layers]
        if part in ("qkv", "wo", "gate_up", "down"):
            return [getattr(layer, part) for layer in layers]
        if part == "gemvs":
            return [op for layer in layers for op in (layer.qkv, layer.wo, layer.gate_up, layer.down)]
        if part == "head":
            return [model.final_norm, model.lm_head]
        if part == "layers":
            return ops_of("attention") + ops_of("gemvs")
        return []

    results: dict[tuple[int, str, int, int], float] = {}
    for rnd in range(2):
        for part in parts:
            ops = ops_of(part)
            for op in ops:
                if part == "combine":  # the attention without its split-combine dispatch
                    op.record = lambda rec, *a, op=op, **kw: type(op).record(
                        op, RecorderWithout(rec, op.combine_pipeline), *a, **kw
                    )
                else:
                    op.record = lambda *a, **kw: None  # an instance attribute hides the method
            try:
                for ctx in contexts:
                    for t in rows:
                        step = lambda t=t, ctx=ctx: model._record_step(t, all_logits=True, pos=ctx)  # noqa: E731
                        results[(rnd, part, ctx, t)] = s = time_steps(device, step, 32, args.rounds)
                        print(f"pass {rnd} without {part} ctx {ctx} T={t}: {s * 1e3:7.3f} ms", flush=True)
            finally:
                for op in ops:
                    del op.record
    engine.close()
    print_context_tables(results, parts, contexts, lambda p: "full step" if p == "none" else f"without {p}", rows)


def bench_gemv_sweep(args: argparse.Namespace) -> None:
    """Whole synthetic-model steps over T = 1, 3, 5 rows for several tilings of the fused norm + GEMV
    kernel (`ternary_gemv_norm.wgsl`): weight rows per row group at every T, and row groups per workgroup
    for matrices under / over 8192 rows (kernels/linear.py norm_gemv_rows,
    norm_gemv_row_groups), as ROWSxGROUPSxGROUPS_BIG; or only the decode kernel's rows for each
    2B-4T matrix, dQKV/WO/GATE_UP/DOWN (verify rows and row groups as they are), or only the verify
    rows, vQKV/WO/GATE_UP/DOWN; "default" runs the
    defaults. The model is loaded once per tiling, passes alternate. Ops timed alone mislead here
    (docs/performance.md, session 12): the step is the judge."""
    from bitnet_web import engine as engine_module  # noqa: PLC0415
    from bitnet_web.bench import synthetic_model  # noqa: PLC0415

    configs = args.gemv_sweep.split(",")
    path = args.model or synthetic_model(args.shape)
    rows_list = [int(t) for t in args.ablate_rows.split(",")]
    original_init, original_groups = NormTernaryLinear.__init__, linear_module.norm_gemv_row_groups
    results: dict[tuple[int, str, int], float] = {}
    for rnd in range(2):
        for name in configs:
            if name[0] in "dv" and name != "default":  # decode / verify rows per matrix (weights: 5th argument)
                qkv, wo, gate_up, down = (int(v) for v in name[1:].split("/"))

                by_shape = {(3840, 2560): qkv, (2560, 2560): wo, (13824, 2560): gate_up}
                which = "rows" if name[0] == "d" else "verify_rows"

                def init(self, *a, by_shape=by_shape, down=down, which=which, **kw):
                    original_init(self, *a, **{which: by_shape.get((a[4].n_rows, a[4].n_cols), down)}, **kw)

                NormTernaryLinear.__init__ = init
            elif name != "default":  # ROWSxGROUPSxGROUPS_BIG, or with xGW: threads per row group
                rows, small, big, *gw = (int(v) for v in name.split("x"))

                def init(self, *a, rows=rows, gw=gw, **kw):
                    sized = {"workgroup_size": gw[0]} if gw else {}
                    original_init(self, *a, rows=rows, verify_rows=rows, **sized, **kw)

                NormTernaryLinear.__init__ = init
                linear_module.norm_gemv_row_groups = lambda n, *_, small=small, big=big: big if n >= 8192 else small
            engine = engine_module.Engine()
            try:
                try:
                    engine.load(path)
                except (TernaryShapeError, engine_module.EngineError) as exc:  # a tiling the kernel does not take
                    print(f"{name}: skipped, {exc}", flush=True)
                    continue
                model = engine.model
                first = model.layer_ops[0]
                workgroups = [op.groups for op in (first.qkv, first.wo, first.gate_up, first.down)]
                print(f"{name}: workgroups qkv/wo/gate_up/down at T = 1 {workgroups}", flush=True)
                ready_for_steps(model, [args.context])
                for t in rows_list:
                    step = lambda t=t, model=model: model._record_step(t, all_logits=True, pos=args.context)  # noqa: E731
                    results[(rnd, name, t)] = s = time_steps(engine.device, step, 32, args.rounds)
                    print(f"pass {rnd} {name} T={t}: {s * 1e3:7.3f} ms", flush=True)
            finally:
                engine.close()
                NormTernaryLinear.__init__, linear_module.norm_gemv_row_groups = original_init, original_groups
    heads = " | ".join(f"T = {t}" for t in rows_list)
    print(f"\n| rows x groups (< / >= 8192 rows) | {heads} | (ms / step, context {args.context})")
    print("| --- |" + " ---: |" * len(rows_list))
    for name in configs:
        if (0, name, rows_list[0]) not in results:
            continue  # skipped: its line above says why
        cells = [f"{results[(0, name, t)] * 1e3:.3f} / {results[(1, name, t)] * 1e3:.3f}" for t in rows_list]
        print(f"| {name} | " + " | ".join(cells) + " |")


def time_verify_steps(args: argparse.Namespace, device, record) -> None:
    from bitnet_web.bench import profile_summary  # noqa: PLC0415

    sync = device.buffer(16, label="sync")
    results = {}
    warm = [record(1) for _ in range(50)]  # GPU clocks up before the first timed round
    for rec in warm:
        rec.submit()
    device.read_sync(sync, 0, 4)
    for t in range(1, SMALL_T_MAX + 1):
        results[t] = time_steps(device, lambda t=t: record(t), args.steps * 4, args.rounds)
        profile = None
        if device.profiling:
            rec = record(t, device.begin_profiled())
            rec.submit()
            profile = profile_summary(device.read_profile(rec))
        ratio = results[t] / results[1]
        print(f"verify step T={t}: {results[t] * 1e3:7.3f} ms  {ratio:5.2f}x T=1", flush=True)
        if profile:
            kernels = ", ".join(
                f"{name} {v['count']}x{v['median_us']:.1f}us={v['total_us']:.0f}"
                for name, v in list(profile["kernels"].items())[:8]
            )
            print(f"    GPU {profile['total_us']:.0f} us: {kernels}", flush=True)
    print("\n| T | ms / step | x T=1 |\n| ---: | ---: | ---: |")
    for t, seconds in results.items():
        print(f"| {t} | {seconds * 1e3:.3f} | {seconds / results[1]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="submits queued back to back per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds; the median is reported")
    parser.add_argument("--target", type=float, default=0.05, help="seconds of GPU work per round")
    parser.add_argument("--tokens", type=int, default=64, help="token rows for the prefill (GEMM) rows")
    parser.add_argument("--sweep", action="store_true", help="also try GEMV and LM-head tilings")
    parser.add_argument("--only", default="", help="run only ops whose name contains this")
    parser.add_argument("--no-lm-head", action="store_true", help="skip the 657 MB LM head (slow on CPU adapters)")
    parser.add_argument("--verify-steps", action="store_true", help="time whole 2B-4T forward steps over T = 1..9")
    parser.add_argument("--context", type=int, default=64, help="cached tokens before a --verify-steps step")
    parser.add_argument(
        "--padded", type=int, default=0, help="--verify-steps: steps of K + 1 rows with drafts of 0..K (K given)"
    )
    parser.add_argument("--shape", default="2b4t", help="synthetic model shape of --verify-steps (2b4t, tiny)")
    parser.add_argument("--model", default="", help="--verify-steps: this GGUF instead of a synthetic model")
    parser.add_argument(
        "--paths", default=SMALL_T_PATH, help=f"--verify-steps: small-T paths to time, comma-separated {SMALL_T_PATHS}"
    )
    parser.add_argument("--direct-sweep", action="store_true", help="time whole steps per direct-attention threshold")
    parser.add_argument("--contexts", default="48,64,96,128,192,256,384,512", help="--direct-sweep: cached contexts")
    parser.add_argument("--direct-tiles", default="4,8,16,32", help="--direct-sweep: DIRECT_MAX_TILES values")
    parser.add_argument(
        "--gemv-sweep", default="", help="whole steps per fused-GEMV tiling ROWSxGROUPSxGROUPS_BIG, comma-separated"
    )
    parser.add_argument(
        "--splits-sweep", default="", help="whole steps per MAX_SPLITS cap (e.g. 32,64,128), --contexts"
    )
    parser.add_argument(
        "--walks", default="", help="whole steps per decode-attention walk (tiles, lanes, lanesR), --contexts"
    )
    parser.add_argument(
        "--ablate", default="", help=f"whole steps with parts left out, --contexts; some of {','.join(ABLATIONS)}"
    )
    parser.add_argument("--ablate-rows", default="1,3", help="--ablate, --gemv-sweep: token rows of the steps (T)")
    parser.add_argument("--dispatch-floor", action="store_true", help="time chains of trivial dependent dispatches")
    parser.add_argument("--floor-dispatches", type=int, default=185, help="--dispatch-floor: dispatches per submit")
    args = parser.parse_args()
    if args.dispatch_floor:
        bench_dispatch_floor(args)
        return
    if args.ablate:
        bench_ablation(args)
        return
    if args.splits_sweep:
        bench_splits_sweep(args)
        return
    if args.walks:
        bench_walks(args)
        return
    if args.gemv_sweep:
        bench_gemv_sweep(args)
        return
    if args.direct_sweep:
        bench_direct_sweep(args)
        return
    if args.verify_steps:
        bench_verify_steps(args)
        return

    device = gpu.open_device()
    print(
        f"device: {device.adapter_name}  features: {sorted(device.features)}  "
        f"binding limit: {device.limits.max_binding >> 20} MiB"
    )
    bench = Bench(device, args.steps, args.rounds, args.target)
    k, rng = bench.kernels, np.random.default_rng(0)
    t_max = max(args.tokens, 1)

    def buf(nbytes: int, label: str) -> gpu.Buffer:
        return device.buffer(nbytes, label=label)

    def want(name: str) -> bool:
        return args.only in name

    step = StepParams(device)
    buf_rows = max(t_max, SMALL_T_MAX)  # token rows the buffers hold (the "rows" ops go up to SMALL_T_MAX)
    x = buf(4 * buf_rows * FFN, "x")
    device.upload(x, 0, rng.standard_normal(buf_rows * FFN).astype(np.float32))
    x_q, x_scale = buf(buf_rows * FFN, "x_q"), buf(4 * buf_rows, "x_scale")
    device.upload(x_q, 0, rng.integers(0, 2**32, buf_rows * FFN // 4, dtype=np.uint32))
    device.upload(x_scale, 0, np.full(buf_rows, 0.01, np.float32))
    norm_w = buf(4 * FFN, "norm w")
    device.upload(norm_w, 0, np.ones(FFN, np.float32))
    out = buf(4 * buf_rows * 2 * FFN, "out")

    # Norms --------------------------------------------------------------------------------------
    step.write(1, 0, 0)
    for width in (DIM, FFN):
        if want(f"rmsnorm_quant {width}"):
            op = RMSNormQuant(k, x, norm_w, x_q, x_scale, step, width, 1e-5)
            bench.time_op(f"rmsnorm_quant {width} T=1", lambda r, op=op: op.record(r, 1), 4 * width * 2)
    if want("rmsnorm f32"):
        op = RMSNorm(k, x, norm_w, out, step, DIM, 1e-5)
        bench.time_op(f"rmsnorm f32 {DIM} last row", lambda r, op=op: op.record(r, 1, last_only=True), 8 * DIM)

    # Ternary linear -------------------------------------------------------------------------------
    shapes = [
        ("qkv", [Q_DIM, KV_DIM, KV_DIM], DIM, "store"),
        ("wo", [DIM], Q_DIM, "residual"),
        ("gate_up", [FFN, FFN], DIM, "gate_relu2"),
        ("down", [DIM], FFN, "residual"),
    ]
    for name, parts, cols, epilogue in shapes:
        if not (want(f"gemv {name}") or want(f"gemm {name}") or want(f"rows {name}")):
            continue
        matrix = TernaryMatrix.upload(
            device,
            [(random_codes(rng, n, cols), 0.5, (n, cols)) for n in parts],
            name,
            pair_rows=epilogue.startswith("gate"),
        )
        weight_bytes = matrix.n_rows * cols // 4 + 4 * matrix.n_rows
        variants = [(None, None)]
        if args.sweep:
            variants += [(rows, wg) for rows in (4, 8, 16) for wg in (32, 64, 128, 256) if wg >= rows]
        for rows, wg in variants:
            kwargs = {} if rows is None else {"gemv_rows": rows, "gemv_workgroup_size": wg}
            op = TernaryLinear(k, matrix, x_q, x_scale, out, step, epilogue, **kwargs)
            if want(f"gemv {name}"):
                step.write(1, 0, 0)
                label = "default" if rows is None else f"rows={rows} wg={wg}"
                bench.time_op(
                    f"gemv {name} {matrix.n_rows}x{cols} {epilogue}",
                    lambda r, op=op: op.record(r, 1),
                    weight_bytes + cols,
                    label,
                )
        if want(f"gemv {name}"):
            # Separate norm + GEMV (two dependent dispatches) against the fused kernel.
            step.write(1, 0, 0)
            norm = RMSNormQuant(k, x, norm_w, x_q, x_scale, step, cols, 1e-5)
            op = TernaryLinear(k, matrix, x_q, x_scale, out, step, epilogue)
            bench.time_op(
                f"norm+gemv {name} (2 dispatches)",
                lambda r, norm=norm, op=op: (norm.record(r, 1), op.record(r, 1)),
                weight_bytes + 8 * cols,
            )
            fused_rows = [None] + ([4, 8, 16] if args.sweep else [])
            for rows in fused_rows:
                kwargs = {} if rows is None else {"rows": rows}
                fused = NormTernaryLinear(k, x, norm_w, 1e-5, matrix, x_q, x_scale, out, step, epilogue, **kwargs)
                bench.time_op(
                    f"gemv+norm fused {name}",
                    lambda r, op=fused: op.record(r, 1),
                    weight_bytes + 8 * cols,
                    "default" if rows is None else f"rows={rows}",
                )
        if want(f"gemm {name}") and t_max > 1:
            op = TernaryLinear(k, matrix, x_q, x_scale, out, step, epilogue)
            step.write(t_max, 0, 0)
            bench.time_op(
                f"gemm {name} {matrix.n_rows}x{cols} T={t_max}",
                lambda r, op=op: op.record(r, t_max),
                weight_bytes + cols * t_max,
            )
            step.write(1, 0, 0)
        for t in range(1, SMALL_T_MAX + 1):
            # The small-T paths of NormTernaryLinear.record (SMALL_T_PATHS) and, with --sweep, other
            # ternary_gemv_rows tilings and the tiled GEMM that ran before issue 15.
            if not want(f"rows {name} T={t}"):
                continue
            op = NormTernaryLinear(k, x, norm_w, 1e-5, matrix, x_q, x_scale, out, step, epilogue)
            step.write(t, 0, 0)
            bytes_read = weight_bytes + 4 * cols * t
            bench.time_op(f"rows {name} T={t}", lambda r, op=op, t=t: op.record_fused(r, t), bytes_read, "fused")
            if t > 1:
                bench.time_op(
                    f"rows {name} T={t}",
                    lambda r, op=op, t=t: op.record_split(r, t),
                    bytes_read,
                    "split: norm once + gemv per row",
                )
            bench.time_op(
                f"rows {name} T={t}",
                lambda r, op=op, t=t: op.record_rows(r, t),
                bytes_read,
                f"rows: norm once + gemv_rows ROWS={ROWS_GEMV_ROWS}",
            )
            for rows, wg in ((4, None), (16, None), (8, 32)) if args.sweep else ():
                linear = TernaryLinear(
                    k, matrix, x_q, x_scale, out, step, epilogue, rows_gemv_rows=rows, gemv_workgroup_size=wg
                )
                bench.time_op(
                    f"rows {name} T={t}",
                    lambda r, op=op, linear=linear, t=t: (op.norm.record(r, t), linear.record_rows(r, t)),
                    bytes_read,
                    f"rows: norm once + gemv_rows ROWS={rows}" + (f" WG={wg}" if wg else ""),
                )
            if t > 1 and args.sweep:
                bench.time_op(
                    f"rows {name} T={t}",
                    lambda r, op=op, t=t: (op.norm.record(r, t), op.linear.record(r, t)),
                    bytes_read,
                    "norm + tiled GEMM",
                )
            step.write(1, 0, 0)
        matrix.release(device)

    # Embedding, LM head, argmax ---------------------------------------------------------------------
    if not args.no_lm_head and (want("lm_head") or want("embedding") or want("lm_head rows T=2")):
        table = (rng.standard_normal((VOCAB, DIM)) * 0.02).astype(np.float16)
        matrix = F16Matrix.upload(device, table, "token_embd")
        del table
        logits = (
            buf(4 * buf_rows * VOCAB, "logits")
            if 4 * buf_rows * VOCAB <= device.limits.max_binding
            else buf(4 * VOCAB, "logits")
        )
        ids = buf(4 * t_max, "ids")
        device.upload(ids, 0, rng.integers(0, VOCAB, t_max, dtype=np.uint32))
        step.write(1, 0, 0)
        note = f"{len(matrix.shards)} shard(s)"
        if want("embedding"):
            op = EmbeddingLookup(k, matrix, ids, x, step)
            bench.time_op("embedding T=1", lambda r, op=op: op.record(r, 1), 2 * DIM, note)
        if want("lm_head"):
            variants = [(None, None)] + (
                [(r, w) for r in (1, 2, 4, 8) for w in (32, 64, 128, 256) if VOCAB / r <= 65535] if args.sweep else []
            )
            for rows, wg in variants:
                kwargs = {} if rows is None else {"rows_per_workgroup": rows, "workgroup_size": wg}
                op = LMHead(k, matrix, x, logits, step, **kwargs)
                label = "default" if rows is None else f"rows={rows} wg={wg}"
                bench.time_op(
                    f"lm_head {VOCAB}x{DIM} f16 T=1",
                    lambda r, op=op: op.record(r, 1),
                    2 * VOCAB * DIM + 4 * DIM,
                    f"{note} {label}",
                )
        for t in range(2, SMALL_T_MAX + 1):
            if not want(f"lm_head rows T={t}") or 4 * t * VOCAB > logits.nbytes:
                continue
            step.write(t, 0, 0)
            for rows in [LM_HEAD_SMALL_T_ROWS] + ([2, 8] if args.sweep else []):
                op = LMHead(k, matrix, x, logits, step, small_t_rows=rows)
                bench.time_op(
                    f"lm_head rows T={t}",
                    lambda r, op=op, t=t: op.record(r, t),
                    2 * VOCAB * DIM + 4 * DIM * t,
                    f"{note} one pass, rows={rows}",
                )
            step.write(1, 0, 0)
        matrix.release(device)
        if want("argmax"):
            op = Argmax(k, logits, ids, VOCAB)
            bench.time_op(f"argmax {VOCAB}", lambda r, op=op: op.record(r), 4 * VOCAB)
    elif want("argmax"):
        logits = buf(4 * VOCAB, "logits")
        op = Argmax(k, logits, buf(16, "ids"), VOCAB)
        bench.time_op(f"argmax {VOCAB}", lambda r, op=op: op.record(r), 4 * VOCAB)

    # Attention (K2) ---------------------------------------------------------------------------------
    bench_attention_ops(bench, want, t_max)

    print("\n| op | us / dispatch | GB/s | note |\n| --- | ---: | ---: | --- |")
    for name, us, gbps, note in bench.rows:
        print(f"| {name} | {us:.2f} | {'-' if gbps is None else f'{gbps:.0f}'} | {note} |")


if __name__ == "__main__":
    main()
