"""Sweep K1 kernel variants at BitNet b1.58 2B-4T shapes as decode-like dependent chains, timed on the GPU.

Each measurement records one compute pass holding REPS copies of a chain (e.g. 30 layers of the
four BitLinears, every dispatch depending on the one before, as in a decode step), preceded by an
untimed warm-up pass of the same work so the clocks are up, and reads the pass's begin/end GPU
timestamps: CPU encoding and submit/wait latency stay out of the numbers. Variants are interleaved
over ROUNDS rounds; the median is printed. Weights are random (8 distinct layer sets, cycled, so
the 50 MB L2 cannot hold them).

    python tools/device/sweep_k1.py [--only SUBSTRING] [--rounds 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "app"))

from bitnet_web import gpu  # noqa: E402
from bitnet_web.gpu.native import NativeRecorder  # noqa: E402
from bitnet_web.kernels.common import KernelCache, StepParams  # noqa: E402
from bitnet_web.kernels.embedding import Argmax, F16Matrix, LMHead  # noqa: E402
from bitnet_web.kernels.linear import (  # noqa: E402
    NormTernaryLinear,
    TernaryLinear,
    TernaryMatrix,
    TernaryShapeError,
)
from bitnet_web.kernels.norm import RMSNormQuant  # noqa: E402

DIM, FFN, Q_DIM, KV_DIM, VOCAB, LAYERS = 2560, 6912, 2560, 640, 128256, 30
WEIGHT_SETS = 8


def random_codes(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    table = np.array(
        [a << 6 | b << 4 | c << 2 | d for a in range(3) for b in range(3) for c in range(3) for d in range(3)],
        dtype=np.uint8,
    )
    return table[rng.integers(0, 81, size=n * k // 4)]


class TimedRecorder(NativeRecorder):
    """A recorder whose (single) compute pass writes GPU timestamps at its beginning and end."""

    def __init__(self, device, query_set, slot: int):
        super().__init__(device)
        self._timestamps = {
            "query_set": query_set,
            "beginning_of_pass_write_index": 2 * slot,
            "end_of_pass_write_index": 2 * slot + 1,
        }

    def _open_pass(self) -> None:
        self._pass = self._encoder.begin_compute_pass(timestamp_writes=self._timestamps)
        self._raw_pass = getattr(self._pass, "_internal", None)
        self.passes += 1


class Sweep:
    SLOTS = 512

    def __init__(self, device):
        self.device = device
        self.query_set = device._device.create_query_set(type="timestamp", count=2 * self.SLOTS)
        self.resolve_buf = device.buffer(16 * self.SLOTS, 0x0200 | 0x0004, "timestamps")
        self.pending: list[tuple[str, int, int]] = []  # (name, slot, units per pass)
        self.samples: dict[str, list[float]] = {}
        self.order: list[str] = []
        self.notes: dict[str, str] = {}

    def measure(self, name: str, record, units: int, reps: int, note: str = "") -> None:
        """record(recorder) adds `units` dispatches' worth of chain; the pass holds `reps` copies."""
        if name not in self.samples:
            self.samples[name] = []
            self.order.append(name)
            self.notes[name] = note
        slot = len(self.pending)
        warm = self.device.begin()
        timed = TimedRecorder(self.device, self.query_set, slot)
        for rec in (warm, timed):
            for _ in range(reps):
                record(rec)
        warm.submit()
        timed.submit()
        self.pending.append((name, slot, units * reps))
        if len(self.pending) == self.SLOTS:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        n = len(self.pending)
        encoder = self.device._device.create_command_encoder()
        encoder.resolve_query_set(self.query_set, 0, 2 * n, self.resolve_buf.handle, 0)
        self.device._queue.submit([encoder.finish()])
        ticks = self.device.read_sync(self.resolve_buf, 0, 16 * n).view(np.uint64).astype(np.float64)
        for name, slot, units in self.pending:
            self.samples[name].append((ticks[2 * slot + 1] - ticks[2 * slot]) / 1e3 / units)
        self.pending.clear()

    def table(self) -> list[tuple[str, float, float, float, str]]:
        self.flush()
        rows = []
        for name in self.order:
            s = self.samples[name]
            rows.append((name, statistics.median(s), min(s), max(s), self.notes[name]))
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="token rows for the prefill GEMM")
    parser.add_argument("--out", default="")
    parser.add_argument("--small", action="store_true", help="tiny shapes: a smoke test for CPU adapters")
    parser.add_argument("--model", default="", help="also time whole decode steps of this GGUF: GPU vs wall")
    args = parser.parse_args()
    if args.small:
        global DIM, FFN, Q_DIM, KV_DIM, VOCAB, LAYERS
        DIM, FFN, Q_DIM, KV_DIM, VOCAB, LAYERS = 256, 768, 256, 64, 4096, 4

    device = gpu.open_device()
    print(f"device: {device.adapter_name}  features: {sorted(device.features)}", flush=True)
    sweep = Sweep(device)
    k = KernelCache(device)
    rng = np.random.default_rng(0)

    def want(name: str) -> bool:
        return args.only in name

    t_max = args.tokens

    def buf(nbytes: int, label: str, fill: np.ndarray | None = None) -> gpu.Buffer:
        b = device.buffer(nbytes, label=label)
        if fill is not None:
            device.upload(b, 0, fill)
        return b

    step = StepParams(device)
    step.write(1, 0, 0)
    step_t = StepParams(device)
    step_t.write(t_max, 0, 0)
    x = buf(4 * t_max * DIM, "x", rng.standard_normal(t_max * DIM).astype(np.float32))
    attn = buf(4 * t_max * Q_DIM, "attn out", rng.standard_normal(t_max * Q_DIM).astype(np.float32))
    hidden = buf(4 * t_max * FFN, "ffn hidden", rng.standard_normal(t_max * FFN).astype(np.float32))
    qkv_out = buf(4 * t_max * (Q_DIM + 2 * KV_DIM), "qkv")
    x_q = buf(t_max * FFN, "x_q", rng.integers(0, 2**32, t_max * FFN // 4, dtype=np.uint32))
    x_scale = buf(4 * t_max, "x_scale", np.full(t_max, 0.01, np.float32))
    norm_w = {w: buf(4 * w, f"norm {w}", rng.uniform(0.5, 1.5, w).astype(np.float32)) for w in (DIM, FFN)}

    t0 = time.perf_counter()
    shapes = {
        "qkv": ([Q_DIM, KV_DIM, KV_DIM], DIM),
        "wo": ([DIM], Q_DIM),
        "gate_up": ([FFN, FFN], DIM),
        "down": ([DIM], FFN),
    }
    sets = []
    for _ in range(WEIGHT_SETS):
        sets.append(
            {
                name: TernaryMatrix.upload(
                    device,
                    [(random_codes(rng, n, cols), 0.01, (n, cols)) for n in parts],
                    name,
                    pair_rows=name == "gate_up",
                )
                for name, (parts, cols) in shapes.items()
            }
        )
    print(f"weights: {time.perf_counter() - t0:.1f} s", flush=True)
    # (input, norm width, output, epilogue) of each BitLinear in the decode step
    wiring = {
        "qkv": (x, DIM, qkv_out, "store"),
        "wo": (attn, Q_DIM, x, "residual"),
        "gate_up": (x, DIM, hidden, "gate_relu2"),
        "down": (hidden, FFN, x, "residual"),
    }

    def fused_ops(rows: int, row_groups: int = 1) -> list[dict]:
        return [
            {
                name: NormTernaryLinear(
                    k, inp, norm_w[width], 1e-5, s[name], x_q, x_scale, out, step, ep, rows=rows, row_groups=row_groups
                )
                for name, (inp, width, out, ep) in wiring.items()
            }
            for s in sets
        ]

    def split_ops(rows: int) -> list[dict]:
        return [
            {
                name: (
                    RMSNormQuant(k, inp, norm_w[width], x_q, x_scale, step, width, 1e-5),
                    TernaryLinear(k, s[name], x_q, x_scale, out, step, ep, gemv_rows=rows),
                )
                for name, (inp, width, out, ep) in wiring.items()
            }
            for s in sets
        ]

    # Decode: whole-layer chains and single-op chains ------------------------------------------------------
    variants = {}
    if want("decode"):
        variants["split norm+gemv rows=8"] = ("split", split_ops(8))
        for rows, groups in ((16, 1), (32, 1), (8, 2), (16, 2), (8, 4), (16, 4)):
            variants[f"fused rows={rows} groups={groups}"] = ("fused", fused_ops(rows, groups))
    tiny = buf(256, "tiny")
    dep = device.pipeline(
        "@group(0) @binding(0) var<storage, read_write> b: array<u32>;\n"
        "@compute @workgroup_size(64) fn main(@builtin(local_invocation_index) i: u32) "
        "{ b[i] += 1u; }",
        "dependent tiny",
    )
    dep_bind = device.bind_group(dep, [tiny])

    def record_layer(kind, ops, names):
        def record(rec):
            for layer in range(LAYERS):
                group = ops[layer % WEIGHT_SETS]
                for name in names:
                    op = group[name]
                    if kind == "split":
                        op[0].record(rec, 1)
                        op[1].record(rec, 1)
                    else:
                        op.record(rec, 1)

        return record

    lm = None
    if want("lm_head") or want("argmax"):
        table = (rng.standard_normal((VOCAB, DIM)) * 0.02).astype(np.float16)
        lm = F16Matrix.upload(device, table, "token_embd")
        del table
        logits = buf(4 * VOCAB, "logits", rng.standard_normal(VOCAB).astype(np.float32))
        ids = buf(16, "ids")
    gemm_ops = {}
    if want("gemm"):
        tiles = {
            "16x8 MR4 MT4": {"TX": 16, "TY": 8, "MR": 4, "MT": 4},
            "16x16 MR4 MT4": {"TX": 16, "TY": 16, "MR": 4, "MT": 4},
            "32x8 MR2 MT4": {"TX": 32, "TY": 8, "MR": 2, "MT": 4},
            "16x8 MR4 MT8": {"TX": 16, "TY": 8, "MR": 4, "MT": 8},
            "8x16 MR4 MT4": {"TX": 8, "TY": 16, "MR": 4, "MT": 4},
        }
        for tname, tile in tiles.items():
            try:
                gemm_ops[tname] = {
                    name: TernaryLinear(
                        k,
                        sets[0][name],
                        x_q,
                        x_scale,
                        wiring[name][2],
                        step_t,
                        wiring[name][3],
                        gemm_tile=tile,
                    )
                    for name in shapes
                }
            except TernaryShapeError as exc:  # over this device's workgroup memory
                print(f"skipping gemm {tname}: {exc}", flush=True)
        norm_t = RMSNormQuant(k, x, norm_w[DIM], x_q, x_scale, step_t, DIM, 1e-5)

    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", flush=True)
        if want("tiny"):
            sweep.measure("tiny dependent dispatch", lambda r: r.dispatch(dep, dep_bind, 1), 1, 200, "us")
        for vname, (kind, ops) in variants.items():
            per = 2 if kind == "split" else 1
            sweep.measure(
                f"decode layer {vname}",
                record_layer(kind, ops, list(wiring)),
                LAYERS,
                3,
                f"us per layer ({4 * per} dispatches)",
            )
            for name in wiring:
                sweep.measure(
                    f"decode {name} {vname}",
                    record_layer(kind, ops, [name]),
                    LAYERS,
                    5,
                    f"us per op ({per} dispatches)",
                )
        if lm is not None and want("lm_head"):
            for rows, wg in ((8, 160), (4, 64), (4, 160), (8, 64), (8, 320), (16, 160), (4, 320), (2, 320)):
                op = LMHead(k, lm, x, logits, step, rows_per_workgroup=rows, workgroup_size=wg)
                sweep.measure(
                    f"lm_head rows={rows} wg={wg}", lambda r, op=op: op.record(r, 1), 1, 10, "us per dispatch (657 MB)"
                )
        if lm is not None and want("argmax"):
            for per in (4, 16):
                op = Argmax(k, logits, ids, VOCAB, per_thread=per)
                sweep.measure(
                    f"argmax per_thread={per}", lambda r, op=op: op.record(r), 1, 50, "us per argmax (2 dispatches)"
                )
        for tname, ops in gemm_ops.items():
            for name, op in ops.items():
                sweep.measure(
                    f"gemm {name} T={t_max} {tname}", lambda r, op=op: op.record(r, t_max), 1, 10, "us per dispatch"
                )
        if gemm_ops and rnd == 0:
            sweep.measure(f"rmsnorm_quant {DIM} T={t_max}", lambda r: norm_t.record(r, t_max), 1, 50, "us")
        sweep.flush()

    if args.model:
        model_steps(device, sweep, args.model, args.rounds)
    rows = sweep.table()
    print("\n| variant | median us | min | max | unit |\n| --- | ---: | ---: | ---: | --- |")
    for name, med, lo, hi, note in rows:
        print(f"| {name} | {med:.2f} | {lo:.2f} | {hi:.2f} | {note} |")
    if args.out:
        keys = ("name", "median_us", "min_us", "max_us", "unit")
        Path(args.out).write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in rows], indent=1))


def model_steps(device, sweep: Sweep, path: str, rounds: int) -> None:
    """GPU time of one greedy decode step of the real model (pass timestamps around 10 steps) next
    to the engine's wall time per token: the difference is time the GPU waits for the host."""
    import asyncio

    from bitnet_web.bench import decode_greedy_benchmark
    from bitnet_web.engine import Engine

    engine = Engine(prefill_chunk=128)
    engine.device = device
    engine.load(Path(path))
    model = engine.model
    loop = asyncio.new_event_loop()
    rng = np.random.default_rng(1)
    loop.run_until_complete(model.prefill(rng.integers(0, engine.config.vocab_size, 16).tolist()))

    def step(rec):
        model._record_step(1, all_logits=False, rec=rec)
        model.argmax.record(rec)

    for _ in range(rounds):
        sweep.measure("model decode step (GPU only)", step, 1, 10, f"us per step, pos {model.n_cached}")
    sweep.flush()
    walls = [loop.run_until_complete(decode_greedy_benchmark(model, 64))["ms_per_token"] * 1e3 for _ in range(rounds)]
    sweep.samples["model decode step (engine wall)"] = walls
    sweep.order.append("model decode step (engine wall)")
    sweep.notes["model decode step (engine wall)"] = "us per token, decode_greedy_benchmark(64)"


if __name__ == "__main__":
    main()
