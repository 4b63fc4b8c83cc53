"""CPU time of Chromium's processes per page phase: proc_sample.py's samples against a page's phases.

    python3 tools/device/cpu_by_phase.py PROCS.jsonl PAGE.json [PAGE.json ...] > cpu.json

Phases come from overhead.html's results (each carries "epoch_ms": [start, end]) and decode.html's
"phases" ([name, epoch ms] in order). For each phase: wall seconds, and per process type the CPU
seconds per wall second (1.0 = one core busy all the time), with the GPU process's and renderer's
busiest threads.
"""

from __future__ import annotations

import bisect
import json
import os
import sys

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def phases_of(report: dict) -> list[tuple[str, float, float]]:
    out = []

    def from_results(prefix: str, block: dict) -> None:
        for r in block.get("results", []):
            keys = ("D", "Q", "K", "kernel", "bg", "wait")
            name = f"{prefix}{r.get('group')} " + " ".join(f"{k}={r[k]}" for k in keys if k in r)
            out.append((name, r["epoch_ms"][0] / 1e3, r["epoch_ms"][1] / 1e3))

    for key in ("page", "worker"):
        if isinstance(report.get(key), dict):
            from_results(f"{key}: ", report[key])
    if isinstance(report.get("pyodide"), dict) and "epoch_ms" in report["pyodide"]:
        out.append(("pyodide suite", report["pyodide"]["epoch_ms"][0] / 1e3, report["pyodide"]["epoch_ms"][1] / 1e3))
    marks = report.get("phases") or []
    for (name, t0), (_, t1) in zip(marks, marks[1:], strict=False):
        out.append((f"{report.get('model', '').rsplit('/', 1)[-1]}: {name}", t0 / 1e3, t1 / 1e3))
    return out


def main() -> int:
    samples = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    times = [s["t"] for s in samples]
    result = []
    for page in sys.argv[2:]:
        try:
            report = json.load(open(page))
        except (OSError, ValueError):
            continue
        for name, t0, t1 in phases_of(report):
            i, j = bisect.bisect_left(times, t0), bisect.bisect_right(times, t1) - 1
            if j <= i:
                continue
            a, b = samples[i], samples[j]
            wall = b["t"] - a["t"]
            by_type: dict[str, float] = {}
            threads: dict[str, float] = {}
            for pid, (kind, ticks, tids) in b["p"].items():
                before = a["p"].get(pid)
                if before is None:
                    continue
                by_type[kind] = by_type.get(kind, 0.0) + (ticks - before[1]) / TICK / wall
                if kind in ("gpu-process", "renderer"):
                    for tid, (tname, tticks) in tids.items():
                        prev = before[2].get(tid)
                        if prev is not None and tticks > prev[1]:
                            key = f"{kind}/{tname}"
                            threads[key] = threads.get(key, 0.0) + (tticks - prev[1]) / TICK / wall
            top = dict(sorted(((k, round(v, 3)) for k, v in threads.items()), key=lambda kv: -kv[1])[:6])
            result.append(
                {
                    "phase": name,
                    "wall_s": round(wall, 2),
                    "cpu_per_wall": {k: round(v, 3) for k, v in sorted(by_type.items())},
                    "top_threads": top,
                }
            )
    json.dump(result, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
