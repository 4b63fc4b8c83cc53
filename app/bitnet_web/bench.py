"""`python -m bitnet_web bench`: load, prefill and decode speed of the engine, as one JSON report.

Without --model it benchmarks a synthetic model with the exact BitNet b1.58 2B-4T shapes and the
Llama 3 vocabulary size (random ternary weights, written once with the project's GGUF writer and
cached on disk). The bandwidth floor is measured in the same run with a read-heavy compute kernel
over a large buffer (copies under-report bandwidth on some GPUs: shared/ground-truth.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from .model.speculation import SpeculationPolicy
from .text.sampler import SamplerSettings

SHAPES = {
    # name: (dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, context_length)
    "2b4t": (2560, 30, 20, 5, 6912, 128256, 4096),
    "tiny": (256, 4, 4, 2, 768, 4096, 2048),
}


def synthetic_model(shape: str) -> Path:
    from .convert.synthetic import write_random_bitnet
    from .sources import cache_dir

    arch = os.environ.get("BITNET_WEB_SYNTHETIC_ARCH", "bitnet-b1.58")
    dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab, ctx = SHAPES[shape]
    path = Path(os.environ.get("BITNET_WEB_SYNTHETIC_DIR", cache_dir())) / f"synthetic-{shape}-{arch}.gguf"
    if not path.exists():
        print(f"writing synthetic {shape} model to {path} ...", file=sys.stderr)
        tmp = path.with_suffix(".tmp")
        write_random_bitnet(
            tmp,
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            ffn_dim=ffn_dim,
            vocab_size=vocab,
            context_length=ctx,
            seed=0,
            arch=arch,
        )
        tmp.rename(path)
    return path


BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "static" / "models" / "bitnet-pystdlib-27m-i2_s.gguf"
# Workloads where the reply repeats its input, for the bundled model (trained on the Python standard
# library): completing code with repeated structure, and restating code above in a summary comment.
SPECULATION_WORKLOADS = {
    "code": (
        "USERS = [\n"
        '    {"name": "alice", "age": 31, "email": "alice@example.com", "admin": False},\n'
        '    {"name": "bob", "age": 27, "email": "bob@example.com", "admin": False},\n'
        '    {"name": "carol", "age": 45, "email": "carol@example.com", "admin": True},\n'
        '    {"name": "dave",'
    ),
    "summary": (
        "def read_config(path, defaults=None):\n"
        "    config = dict(defaults or {})\n"
        "    with open(path, encoding='utf-8') as f:\n"
        "        for line in f:\n"
        "            line = line.strip()\n"
        "            if not line or line.startswith('#'):\n"
        "                continue\n"
        "            key, _, value = line.partition('=')\n"
        "            config[key.strip()] = value.strip()\n"
        "    return config\n\n\n"
        "# Summary: read_config(path, defaults) opens path, skips"
    ),
}
SPECULATE_KS = tuple(range(1, 9))  # draft sizes whose verify-step cost is measured


def peak_host_mb() -> float:
    import resource  # not in Pyodide: only the CPython bench reports host memory

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_read_bandwidth(device, nbytes: int = 1 << 30, repeats: int = 20) -> float:
    """GB/s of a compute kernel that reads `nbytes` once (vec4<u32> loads) and writes almost nothing."""
    from . import gpu

    nbytes = min(nbytes, device.limits.max_binding // 2 * 2)
    words = nbytes // 16
    source = device.buffer(nbytes, gpu.STORAGE_USAGE, "bandwidth source")
    sink = device.buffer(4 * 65536, gpu.STORAGE_USAGE, "bandwidth sink")
    wgsl = f"""
@group(0) @binding(0) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<u32>;
@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {{
    var acc = vec4<u32>(0u);
    let stride = nwg.x * 256u;
    for (var i = gid.x; i < {words}u; i += stride) {{ acc ^= src[i]; }}
    if (acc.x == 0xdeadbeefu) {{ dst[gid.x % 65536u] = acc.y; }}
}}"""
    pipeline = device.pipeline(wgsl, "bandwidth probe")
    group = device.bind_group(pipeline, [source, sink])
    workgroups = min(65535, max(1, words // 256 // 8))

    def run(n: int) -> float:
        start = time.perf_counter()
        recorder = device.begin()
        for _ in range(n):
            recorder.dispatch(pipeline, group, workgroups)
        recorder.submit()
        device.read_sync(sink, 0, 4)
        return time.perf_counter() - start

    run(2)
    elapsed = min(run(repeats) for _ in range(3))
    device.release(source)
    device.release(sink)
    return nbytes * repeats / elapsed / 1e9


def profile_summary(timings: list[tuple[str, float]]) -> dict:
    """Total GPU us per token, and per kernel (shader name), from per-dispatch timestamps."""
    per_kernel: dict[str, list[float]] = {}
    for label, us in timings:
        per_kernel.setdefault(label.split(":")[0], []).append(us)
    return {
        "total_us": round(sum(us for _, us in timings), 1),
        "kernels": {
            name: {"count": len(v), "total_us": round(sum(v), 1), "median_us": round(float(np.median(v)), 2)}
            for name, v in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))
        },
    }


async def decode_greedy_benchmark(model, n_tokens: int) -> dict:
    """Decode `n_tokens` greedily from the current context; wall and Python CPU time per token."""
    first = model.cached_tokens[-1] if model.cached_tokens else 0
    model.truncate(model.n_cached - 1 if model.cached_tokens else 0)
    stream = model.decode_greedy(first)
    for _ in range(model.decode_batching()[0]):  # warm: the first submit's steps (read back at once)
        await stream.__anext__()
    model.encode_seconds = 0.0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for _ in range(n_tokens):
        await stream.__anext__()
    wall, cpu = max(time.perf_counter() - wall0, 1e-9), time.process_time() - cpu0
    await stream.aclose()
    return {
        "tok_per_s": n_tokens / wall,
        "ms_per_token": 1e3 * wall / n_tokens,
        "cpu_ms_per_token": 1e3 * cpu / n_tokens,
        "encode_ms_per_token": 1e3 * model.encode_seconds / n_tokens,
        "dispatches_per_token": model.last_dispatches,
        "passes_per_token": model.last_passes,
    }


async def verify_step_costs(model, ks: tuple[int, ...], n_steps: int, prompt: list[int]) -> dict:
    """Wall time of a speculative verify step (k + 1 rows, queued like decode steps) for each k, per
    plain decode step at the same context: what a verify step must win back in accepted tokens."""

    async def ms_per_step(k: int) -> float:  # k = 0: plain decode steps
        model.truncate(0)
        await model.prefill(prompt[:-1])
        stream = model.decode_speculative(prompt[-1], k) if k else model.decode_greedy(prompt[-1])
        try:
            await stream.__anext__()  # warm: the first submit, read back at once
            first, tokens, t0 = model.verify_steps, 0, time.perf_counter()
            while True:
                await stream.__anext__()
                tokens += 1
                steps = model.verify_steps - first if k else tokens  # verify steps count as they are read
                if steps >= n_steps:
                    return 1e3 * (time.perf_counter() - t0) / steps
        finally:
            await stream.aclose()

    decode_ms = await ms_per_step(0)
    costs = {k: await ms_per_step(k) for k in ks}
    return {
        "decode_step_ms": decode_ms,
        "verify_step_ms": {str(k): ms for k, ms in costs.items()},
        "verify_cost_relative": {str(k): ms / decode_ms for k, ms in costs.items()},
    }


async def repeating_context(engine, n_reply: int = 64) -> list[int]:
    """The code workload's prompt and its greedy reply of `n_reply` tokens: a text that repeats itself,
    so verify steps after it draft in full (the bench page's verify costs and kernel profiles)."""

    code, greedy = engine.encode_prompt(SPECULATION_WORKLOADS["code"]), SamplerSettings(temperature=0.0)
    engine.model.truncate(0)
    async for _ in engine.generate_tokens_async(code, greedy, max_tokens=n_reply, speculate=0):
        pass
    return code + list(engine.generated_tokens)


async def speculation_workloads(engine, ks: tuple[int, ...], n_tokens: int, runs: int) -> dict:
    """Acceptance and end-to-end greedy tokens/s with and without drafts on SPECULATION_WORKLOADS: each
    k with a draft verified at every step (no SpeculationPolicy), and "default", the engine's default
    draft size and policy. `tok_per_s`: from the first token to the last (decode_tok_per_s);
    `reply_tok_per_s`: tokens over the whole call, the prompt included (what a change of when the
    first token arrives cannot skew)."""
    from .engine import SPECULATE_DEFAULT

    greedy = SamplerSettings(temperature=0.0)
    report = {}
    policy = engine.speculation_policy
    try:
        for name, text in SPECULATION_WORKLOADS.items():
            ids = engine.encode_prompt(text)
            rows, plain = {}, None
            for k in (0, *ks, SPECULATE_DEFAULT):
                rates, reply_rates = [], []
                engine.speculation_policy = policy if k == SPECULATE_DEFAULT else None
                for _ in range(runs + 1):  # the first run warms pipelines and the cache's size
                    engine.model.truncate(0)
                    t0 = time.perf_counter()
                    async for _ in engine.generate_tokens_async(ids, greedy, max_tokens=n_tokens, speculate=k):
                        pass
                    reply_rates.append(engine.last_stats.n_generated / (time.perf_counter() - t0))
                    rates.append(engine.last_stats.decode_tok_per_s)
                stats, tokens = engine.last_stats, list(engine.generated_tokens)
                plain = tokens if k == 0 else plain
                row = {
                    "tok_per_s": float(np.median(rates[1:])),
                    "reply_tok_per_s": float(np.median(reply_rates[1:])),
                    "tokens": stats.n_generated,
                }
                if k == SPECULATE_DEFAULT:
                    row.update(speculate=stats.speculate, plain_steps=stats.plain_steps)
                if k:
                    steps = max(stats.verify_steps, 1)
                    row.update(
                        verify_steps=stats.verify_steps,
                        launched_steps=stats.launched_steps,
                        draft_proposed=stats.draft_proposed,
                        draft_accepted=stats.draft_accepted,
                        acceptance=stats.draft_accepted / max(stats.draft_proposed, 1),
                        tokens_per_verify_step=(steps + stats.draft_accepted) / steps,
                        draft_length_counts=stats.draft_length_counts,
                        speedup=row["tok_per_s"] / rows["0"]["tok_per_s"],
                        reply_speedup=row["reply_tok_per_s"] / rows["0"]["reply_tok_per_s"],
                        identical_to_plain=tokens == plain,
                    )
                rows["default" if k == SPECULATE_DEFAULT else str(k)] = row
            report[name] = {"prompt_tokens": len(ids), "by_speculate": rows}
    finally:
        engine.speculation_policy = policy
    return report


async def speculation_policy_bench(engine, prompt_ids: list[int], n_tokens: int, runs: int) -> dict:
    """Tokens/s of sampled and greedy replies with plain steps (speculate 0), with verify steps of the
    default draft size at every step (no SpeculationPolicy: what drafting cost before the policy), with
    the engine's default (the policy on), and with draft-off steps only (a policy that never drafts:
    what the policy's plain steps cost against plain decoding). `sampled_t1`: temperature 1, where a random-weight
    model's reply does not repeat, so drafts are rejected: the loss the policy must avoid. `greedy`:
    the synthetic model's greedy reply repeats itself, so drafts pay. `sampled_top1`: the same tokens
    drawn through the sampled path (top-k 1), i.e. the speculative sampling kernels where drafts pay."""
    from .engine import SPECULATE_DEFAULT
    from .kernels.speculative import SPECULATE_GPU

    workloads = {
        "sampled_t1": SamplerSettings(temperature=1.0, top_k=40, top_p=1.0, seed=5),
        "greedy": SamplerSettings(temperature=0.0),
        "sampled_top1": SamplerSettings(temperature=1.0, top_k=1, seed=5),
    }
    saved = engine.speculation_policy
    modes = {
        "plain": (0, None),
        "every_step": (SPECULATE_GPU, None),
        "policy": (SPECULATE_DEFAULT, saved),
        "draft_off": (SPECULATE_GPU, NoDrafts),
    }
    report: dict = {"prompt_tokens": len(prompt_ids), "max_tokens": n_tokens}
    try:
        for name, settings in workloads.items():
            rows: dict = {}
            for mode, (speculate, policy) in modes.items():
                engine.speculation_policy = policy
                rates = []
                for _ in range(runs + 1):  # the first run warms pipelines
                    engine.model.truncate(0)
                    async for _ in engine.generate_tokens_async(prompt_ids, settings, n_tokens, speculate=speculate):
                        pass
                    rates.append(engine.last_stats.decode_tok_per_s)
                stats = engine.last_stats
                rows[mode] = {
                    "tok_per_s": float(np.median(rates[1:])),
                    "tok_per_s_runs": [round(r, 1) for r in rates[1:]],
                    "speculate": stats.speculate,
                    "tokens": stats.n_generated,
                    "verify_steps": stats.verify_steps,
                    "plain_steps": stats.plain_steps,
                    "draft_proposed": stats.draft_proposed,
                    "draft_accepted": stats.draft_accepted,
                    "same_tokens_as_plain": list(engine.generated_tokens) == rows.get("plain", {}).get("ids"),
                    "ids": list(engine.generated_tokens),
                }
            plain_rate = rows["plain"]["tok_per_s"]
            for mode in modes:  # None when the plain reply ended at once (an end-of-text token first)
                rows[mode]["speedup"] = rows[mode]["tok_per_s"] / plain_rate if plain_rate > 0 else None
            for row in rows.values():
                del row["ids"]
            rows["plain"]["same_tokens_as_plain"] = True
            report[name] = rows
    finally:
        engine.speculation_policy = saved
    return report


class NoDrafts(SpeculationPolicy):
    """A policy that never drafts: every step of a speculative reply is a draft-off step."""

    def start(self, history: Sequence[int]) -> None:
        super().start(history)
        self.speculating = False

    def push(self, token: int, verified: bool = False) -> None:
        self.pushed += 1

    def verify_step(self, n_emitted: int, draft_len: int | None = None) -> None:
        pass


def speculation_summary(costs: dict, workloads: dict) -> dict:
    """Expected speed-up of drafting with k on the cost model's GPU and shape: tokens per verify step
    (from the workload runs) over the mean verify step's cost relative to a decode step. A step with a
    draft of d tokens costs what a step of d + 1 rows costs (`verify_cost_relative[d]`, 1 at d = 0;
    interpolated between the draft sizes measured) plus SpeculationPolicy.PADDED_ROW_COST for each of the
    k - d rows past its draft. An estimate."""
    relative = costs["verify_cost_relative"]
    sizes = sorted(int(d) for d in relative)
    measured = [0, *sizes], [1.0, *(relative[str(d)] for d in sizes)]

    def step_cost(d: int, k: int) -> float:
        return float(np.interp(d, *measured)) + SpeculationPolicy.PADDED_ROW_COST * (k - d)

    out = {}
    for name, workload in workloads.items():
        out[name] = {}
        for k, row in workload["by_speculate"].items():
            if k == "0" or k not in relative:
                continue
            counts = row.get("draft_length_counts") or []
            if sum(counts):
                mean_cost = sum(n * step_cost(d, int(k)) for d, n in enumerate(counts) if n) / sum(counts)
            else:  # no per-length counts: every step priced as a full draft
                mean_cost = relative[k]
            out[name][k] = row["tokens_per_verify_step"] / mean_cost
    return out


async def replies_after_pauses(engine, rounds: int, idle_s: float = 5.0, n_tokens: int = 128) -> dict:
    """ms per greedy reply of `n_tokens` to a short prompt, plain and with drafts of 6: right after
    another reply, after `idle_s` of an idle GPU, and after as long idle then a warm-up
    (Engine.warm_up_async) and 0.3 s, `rounds` times each. What an idle GPU's lowered clocks cost a
    reply, and what the chat page's warm-up while the person types wins back (model/warm_up.py).
    Also each warm-up's own figures ("warm_ups")."""
    ids = engine.encode_prompt("def parse_args(argv):\n")
    greedy = SamplerSettings(temperature=0.0)

    async def reply_ms(k: int) -> float:
        t0 = time.perf_counter()
        async for _ in engine.generate_tokens_async(ids, greedy, max_tokens=n_tokens, speculate=k):
            pass
        return round(1e3 * (time.perf_counter() - t0), 1)

    report: dict = {"idle_s": idle_s, "warm_ups": []}
    for k in (0, 6):
        row = report.setdefault(f"speculate_{k}", {"after_a_reply": [], "after_idle": [], "after_idle_and_warm_up": []})
        for _ in range(rounds):
            await reply_ms(k)
            row["after_a_reply"].append(await reply_ms(k))
            await asyncio.sleep(idle_s)
            row["after_idle"].append(await reply_ms(k))
            await asyncio.sleep(idle_s)
            report["warm_ups"].append(await engine.warm_up_async())
            await asyncio.sleep(0.3)
            row["after_idle_and_warm_up"].append(await reply_ms(k))
    return report


async def profile_decode_step(model, sampled: bool = False) -> list[tuple[str, float]]:
    """GPU microseconds per dispatch of one decode step, greedy or (after decode_sampled set the
    sampler up) sampled, on a device with `profiling` (NativeDevice(profile=True): timestamps between
    the dispatches of one pass; the browser's: each dispatch's own time). The step is not kept: the
    cache is left as it was."""
    rec = model._record_step(1, all_logits=False, rec=model.device.begin_profiled())
    (model.gpu_sampler if sampled else model.argmax).record(rec)
    rec.submit()
    return await model.device.read_profile_async(rec)


async def profile_verify_step(model, k: int, last_token: int) -> list[tuple[str, float]]:
    """GPU microseconds per dispatch of one speculative verify step with drafts of up to `k` tokens, as
    the decode loop records it (draft, k + 1 rows, greedy acceptance, log), after the cached text with
    `last_token` as its input: its draft is what prompt lookup finds there (full after a text that
    repeats itself). Its rows lie past `n_cached`: the cache is left as it was."""
    ops = model._speculation_ops(k)
    model.kv_cache.ensure_capacity(model.n_cached + k + 1)  # start() below hands its capacity to the GPU
    ops.buffers.start(model.cached_tokens + [last_token], model.kv_cache.capacity)
    staging = model.device.staging(16 * (k + 3), "profiled verify step log")
    try:
        rec = model._record_verify_steps(
            k, 1, k + 1, staging, model.n_cached, ops.greedy, rec=model.device.begin_profiled()
        )
        rec.submit()
        return await model.device.read_profile_async(rec)
    finally:
        model.device.release(staging)


class _Progress:
    """Progress lines for a long benchmark: each step as it starts, and once the first decode speed
    is known, an estimate of the time left (a CPU adapter takes many minutes)."""

    def __init__(self, log: Callable[[str], None] | None, steps: list[tuple[str, int, int]]) -> None:
        self.log = log
        self.steps = steps  # (label, prefill tokens, decode tokens) still to run
        self.prefill_s_per_token: float | None = None
        self.decode_s_per_token: float | None = None
        self.start = time.perf_counter()

    def step(self, label: str) -> None:
        left = self.steps
        while left and left[0][0] != label:
            left.pop(0)
        if self.log is None:
            return
        text = f"bench: {label}"
        if self.decode_s_per_token is not None and self.prefill_s_per_token is not None:
            seconds = sum(p * self.prefill_s_per_token + d * self.decode_s_per_token for _, p, d in left)
            text += f" (about {_duration(seconds)} left)"
        self.log(text)


def _duration(seconds: float) -> str:
    return f"{max(1.0, seconds):.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


async def measure_async(
    engine, quick: bool = False, log: Callable[[str], None] | None = None, runs: int | None = None
) -> dict:
    """Prefill and decode speeds of a loaded engine (CPython and browser alike); `log` gets progress lines.
    Each figure is the median of `runs` measurements (default 3; 1 with `quick`), the runs listed beside it."""

    model, device = engine.model, engine.device
    runs = runs or (1 if quick else 3)
    n_decode = 16 if quick else 128
    prefills = (128,) if quick else (128, 512)
    vocab, context = engine.config.vocab_size, engine.config.context_length
    # decode speeds at these cache fills (prompts are clipped to leave room for the decoded tokens)
    contexts = {"short": 16} if quick else {"short": 16, "1k": 1024}
    if not quick and context >= 4096:
        contexts["4k"] = 4096
    steps = [("warm-up", 128 * (3 if quick else 10), 0)]
    steps += [(f"prefill {n} tokens", (1 + runs) * n, 0) for n in prefills]
    steps += [
        (f"decode {n_decode} tokens at context {label}", runs * ctx, runs * n_decode) for label, ctx in contexts.items()
    ]
    steps += [
        (f"generate {n_decode} tokens ({label})", 16 * n, n * n_decode)
        for label, n in (("greedy", runs), ("sampled", runs), ("sampled_cpu", 1))
    ]
    steps += [("verify steps", 16 * 9, 16 * 9 if quick else 32 * 9 * 2)]
    steps += [("speculation policy", 16 * 9 * (runs + 1), 9 * (runs + 1) * n_decode)]
    progress = _Progress(log, steps)
    report: dict = {"device": device.adapter_name, "gpu_bytes_allocated": device.bytes_allocated, "runs": runs}
    report["decode_tokens_per_run"] = n_decode
    report["decode_batching"] = list(model.decode_batching())
    rng = np.random.default_rng(0)

    def prompt_length(n: int) -> int:
        return min(n, context - 200)

    def prompt(n: int) -> list[int]:
        return rng.integers(0, vocab, size=prompt_length(n)).tolist()

    def keep(key: str, values: list[float]) -> None:
        report[key] = float(np.median(values))
        if len(values) > 1:
            report[key + "_runs"] = [round(v, 2) for v in values]

    # An idle GPU runs at a low clock for about a second after a pause (the H100: 345 MHz, then
    # 1980 MHz): without this warm-up the first prefill figures measure the clock ramp, not the kernels.
    progress.step("warm-up")
    warm_until = time.perf_counter() + (0.3 if quick else 1.5)
    warm_ids = prompt(128)  # drawn once: the prompts after it do not depend on how many warm-ups ran
    while time.perf_counter() < warm_until:
        model.truncate(0)
        t0 = time.perf_counter()
        await model.prefill(warm_ids)
        progress.prefill_s_per_token = (time.perf_counter() - t0) / 128
    # Two decode steps give the speed for the estimate before the long measurements start.
    progress.decode_s_per_token = (await decode_greedy_benchmark(model, 2))["ms_per_token"] / 1000
    for n in prefills:
        progress.step(f"prefill {n} tokens")
        ids = prompt(n)
        model.truncate(0)
        await model.prefill(ids)  # warm-up: pipelines, KV growth
        rates = []
        for _ in range(runs):
            model.truncate(0)
            t0 = time.perf_counter()
            await model.prefill(ids)
            rates.append(len(ids) / (time.perf_counter() - t0))
        keep(f"prefill_{len(ids)}_tok_per_s", rates)
        progress.prefill_s_per_token = 1 / float(np.median(rates))

    for label, ctx in contexts.items():
        progress.step(f"decode {n_decode} tokens at context {label}")
        all_stats = []
        for _ in range(runs):
            model.truncate(0)
            await model.prefill(prompt(ctx))
            all_stats.append(await decode_greedy_benchmark(model, n_decode))
        for key, name in (
            ("tok_per_s", "tok_per_s"),
            ("ms_per_token", "ms_per_token"),
            ("cpu_ms_per_token", "process_cpu_ms_per_token"),
            ("encode_ms_per_token", "python_encode_ms_per_token"),
        ):
            keep(f"decode_{label}_{name}", [stats[key] for stats in all_stats])
        report[f"decode_{label}_context_tokens"] = prompt_length(ctx)
        progress.decode_s_per_token = report[f"decode_{label}_ms_per_token"] / 1000
        report["dispatches_per_token"] = all_stats[-1]["dispatches_per_token"]
        report["passes_per_token"] = all_stats[-1]["passes_per_token"]
        if getattr(device, "profiling", False):
            report[f"gpu_profile_{label}"] = profile_summary(await profile_decode_step(model))

    # End to end through Engine.generate: tokenizer streaming, stop checks and sampling included.
    ids = prompt(16)
    sampled = SamplerSettings(temperature=0.8, top_k=40, top_p=0.95, seed=1)
    for label, settings, on_gpu in (
        ("greedy", SamplerSettings(temperature=0.0), True),
        ("sampled", sampled, True),  # drawn on the GPU
        ("sampled_cpu", sampled, False),
    ):  # logits read back each token
        progress.step(f"generate {n_decode} tokens ({label})")
        rates, reply_rates, ttfts = [], [], []
        for _ in range(1 if label == "sampled_cpu" else runs):
            model.truncate(0)
            engine.gpu_sampling = on_gpu
            t0 = time.perf_counter()
            try:
                # no drafts: these figures stay comparable across versions (speculation is measured below)
                async for _ in engine.generate_tokens_async(ids, settings, max_tokens=n_decode, speculate=0):
                    pass
            finally:
                engine.gpu_sampling = True
            reply_rates.append(engine.last_stats.n_generated / (time.perf_counter() - t0))
            rates.append(engine.last_stats.decode_tok_per_s)
            ttfts.append(1e3 * engine.last_stats.ttft_s)
        stats = engine.last_stats
        keep(f"engine_{label}_decode_tok_per_s", rates)  # from the first token on
        keep(f"engine_{label}_reply_tok_per_s", reply_rates)  # the whole call: the 16-token prompt included
        keep(f"engine_{label}_ttft_ms", ttfts)
        report[f"engine_{label}_tokens"] = stats.n_generated
        report[f"engine_{label}_token_choice"] = stats.token_choice
    if getattr(device, "profiling", False):
        report["gpu_profile_sampler"] = profile_summary(await profile_decode_step(model, sampled=True))
    report["bytes_read_per_token"] = model.decode_bytes_per_token  # a greedy decode step's (the screened head)
    progress.step("verify steps")
    ks = (1, 4) if quick else SPECULATE_KS
    report["speculation_costs"] = await verify_step_costs(model, ks, 4 if quick else 32, prompt(16))
    progress.step("speculation policy")
    report["speculation_policy"] = await speculation_policy_bench(engine, prompt(16), n_decode, runs)
    return report


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_bench(
    model_path: Path,
    quick: bool,
    int8_head: bool = False,
    log: Callable[[str], None] | None = None,
    workload_model: Path | None = None,
    pauses: int = 0,
    screened_head: bool | None = None,
) -> dict:
    """The engine benchmark of `model_path`; with `workload_model` (the bundled model) also the
    speculative-decoding workloads and the expected speed-up they imply on `model_path`; with `pauses`,
    that many rounds of `replies_after_pauses`."""
    from . import gpu
    from .engine import Engine

    engine = Engine(int8_head=int8_head, screened_head=screened_head)  # the default prefill chunk (512 rows)
    engine.device = gpu.open_device(profile=True)
    if log is not None:
        log(f"bench: adapter {engine.device.adapter_name}")
        if engine.device.is_cpu:
            log(
                "bench: warning: this is a CPU (software) adapter; the benchmark is meant for a GPU and takes "
                "many minutes here (--quick and a small --model shorten it)"
            )
        log(f"bench: loading {model_path}")
    baseline_mb = peak_host_mb()
    t0 = time.perf_counter()
    engine.load(model_path)
    report: dict = {
        "model": str(model_path),
        "int8_head": int8_head,
        "screened_head": engine.info["screened_head"],
        "file_size": model_path.stat().st_size,
        "load_s": time.perf_counter() - t0,
        "peak_host_mb_after_load": peak_host_mb(),
    }
    report.update(engine._run(measure_async(engine, quick, log)))
    if pauses:
        if log is not None:
            log(f"bench: replies after pauses ({pauses} rounds, ~{22 * pauses} s)")
        report["replies_after_pauses_ms"] = engine._run(replies_after_pauses(engine, pauses))
    if log is not None:
        log("bench: read bandwidth")
    report["peak_host_mb"] = peak_host_mb()
    report["host_mb_before_load"] = baseline_mb
    report["host_peak_growth_over_file"] = (report["peak_host_mb"] - baseline_mb) * 1048576 / report["file_size"]
    bandwidth = measure_read_bandwidth(engine.device)
    report["read_bandwidth_gb_s"] = bandwidth
    floor_tok_s = bandwidth * 1e9 / report["bytes_read_per_token"]
    report["bandwidth_floor_tok_per_s"] = floor_tok_s
    report["fraction_of_floor"] = report["decode_short_tok_per_s"] / floor_tok_s
    for label in ("1k", "4k"):
        if f"decode_{label}_tok_per_s" in report:
            report[f"decode_{label}_fraction_of_short"] = (
                report[f"decode_{label}_tok_per_s"] / report["decode_short_tok_per_s"]
            )
    engine.close()
    if workload_model is not None:
        report["speculation_workloads"] = workload_bench(workload_model, quick, log)
        report["speculation_expected_speedup"] = speculation_summary(
            report["speculation_costs"], report["speculation_workloads"]["workloads"]
        )
    if log is not None:
        log_speculation(report, log)
    return report


def workload_bench(path: Path, quick: bool, log: Callable[[str], None] | None) -> dict:
    """Speculative decoding's acceptance on a model whose replies repeat their input (the bundled one):
    random-weight models do not, so acceptance comes from here and costs from the benchmarked model."""
    from . import gpu
    from .engine import Engine

    if log is not None:
        log(f"bench: speculation workloads on {path}")
    engine = Engine()
    engine.device = gpu.open_device()
    try:
        engine.load(path)
        ks = (1, 4) if quick else SPECULATE_KS
        workloads = engine._run(speculation_workloads(engine, ks, 32 if quick else 128, 1 if quick else 3))
        costs = engine._run(verify_step_costs(engine.model, ks, 4 if quick else 32, engine.encode_prompt("x = 1\n")))
        return {"model": str(path), "workloads": workloads, "costs": costs}
    finally:
        engine.close()


def log_speculation(report: dict, log: Callable[[str], None]) -> None:
    """The speculative-decoding figures as a few readable lines (the JSON has them all)."""
    costs = report["speculation_costs"]["verify_cost_relative"]
    log("bench: verify step cost / decode step: " + ", ".join(f"k={k} {v:.2f}x" for k, v in costs.items()))
    for name, rows in report["speculation_policy"].items():
        if isinstance(rows, dict):
            log(
                f"bench: speculation policy, {name}: "
                + "; ".join(
                    f"{mode} {row['tok_per_s']:.0f} tok/s ({row['speedup']:.2f}x, k={row['speculate']}, "
                    f"{row['verify_steps']} verify steps, {row['plain_steps']} plain tokens"
                    f"{'' if row['same_tokens_as_plain'] or name == 'sampled_t1' else ', DIFFERENT'})"
                    for mode, row in rows.items()
                )
            )
    bundled = report.get("speculation_workloads")
    if bundled is None:
        return
    for name, workload in bundled["workloads"].items():
        rows = workload["by_speculate"]
        parts = [f"plain {rows['0']['tok_per_s']:.0f} tok/s"]
        for k, row in rows.items():
            if k != "0":
                parts.append(
                    f"k={k}: {row['tok_per_s']:.0f} tok/s ({row['speedup']:.2f}x), "
                    f"{row['draft_accepted']}/{row['draft_proposed']} drafted accepted, "
                    f"{row['tokens_per_verify_step']:.2f} tok/step{'' if row['identical_to_plain'] else ' DIFFERENT'}"
                )
        log(f"bench: bundled model, {name}: " + "; ".join(parts))
    for name, by_k in report.get("speculation_expected_speedup", {}).items():
        log(
            f"bench: expected speed-up on this model ({name} acceptance x this model's verify cost): "
            + ", ".join(f"k={k} {v:.2f}x" for k, v in by_k.items())
        )


def main(args: argparse.Namespace) -> int:
    from .outfiles import check_output, write_text

    if args.out:
        check_output(args.out, [args.model] if args.model else [], "--out")
    path = Path(args.model) if args.model else synthetic_model(args.synthetic)
    workloads = getattr(args, "workload_model", None)
    workloads = Path(workloads) if workloads else (BUNDLED_MODEL if BUNDLED_MODEL.is_file() else None)
    if workloads is not None and getattr(args, "workload_model", None) == "":
        workloads = None
    report = run_bench(
        path,
        args.quick,
        getattr(args, "int8_head", False),
        log=_log,
        workload_model=workloads,
        pauses=getattr(args, "pauses", 0),
        screened_head=False if getattr(args, "no_screened_head", False) else None,  # None: the engine decides
    )
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        write_text(args.out, text + "\n")
    return 0
