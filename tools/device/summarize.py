"""Print the numbers of one browser_h100.sh call, compactly (the device tool returns only the output's tail).

python3 tools/device/summarize.py RESULTS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def overhead(report: dict) -> None:
    for where in ("page", "worker"):
        block = report.get(where)
        if not isinstance(block, dict):
            continue
        print(
            f"overhead {where} (timestamps {block.get('timestamps')}): ms/step | GPU busy us | gap us median/mean "
            "| host encode ms"
        )
        for r in block.get("results", []):
            cfg = " ".join(f"{k}={r[k]}" for k in ("D", "Q", "K", "kernel", "bg", "wait") if k in r)
            print(
                f"  {r['group']:10} {cfg:48} {r['ms_per_step']:.3f} | {fmt(r.get('gpu_busy_us_median'))} | "
                f"{fmt(r.get('gpu_gap_us_median'))}/{fmt(r.get('gpu_gap_us_mean'))} | "
                f"{r['host_encode_submit_ms_per_step']:.3f}"
            )
    if isinstance(report.get("pyodide"), dict):
        print("  pyodide:", {k: v for k, v in report["pyodide"].items() if k != "epoch_ms"})


def decode(name: str, report: dict) -> None:
    print(f"{name}: load {fmt(report.get('load_s'))} s")
    for key, value in report.items():
        if key.startswith("decode_batching_"):
            runs = value["runs"]
            print(
                f"  {key}: median {value['median_tok_per_s']:.1f} tok/s, same tokens as 1x2: "
                f"{value.get('same_tokens_as_first', value.get('same_tokens_as_1x2'))}; runs "
                + ", ".join(
                    f"{r['tok_per_s']:.0f} (await {r['await_read_ms_per_token']:.3f} ms, encode "
                    f"{r['encode_ms_per_token']:.3f} ms)"
                    for r in runs
                )
            )
        elif key.startswith("submit_only_"):
            print(
                f"  {key}: "
                + ", ".join(
                    f"{r['ms_per_step']:.3f} ms/step (python {r['python_submit_ms_per_step']:.3f})" for r in value
                )
            )
    print("  timestamps:", report.get("timestamps"))


def bench(name: str, report: dict) -> None:
    wanted = (
        "load_s",
        "file_size",
        "peak_host_mb",
        "host_peak_growth_over_file",
        "device",
        "decode_batching",
        "store_s",
        "read_s",
        "upload_s",
        "ready_s",
        "ready_s_runs",
        "ready_s_by_read_ahead",
        "read_s_by_read_ahead",
        "read_progress_s",
        "read_wait_s",
        "read_copy_s",
        "file_hash_s",
        "engine_started_s",
        "parse_s",
        "open_device_s",
        "write_buffer_s",
        "upload_waited_for_read_s",
        "engine_load_async_s",
        "kernels_s",
        "read_only_s",
        "heap_start",
        "heap_after_store",
        "heap_after_read",
        "heap_peak",
        "heap_peak_over_file",
        "heap_growth_over_file",
        "js_heap_after_load",
    )
    keys = [k for k in report if k.endswith(("tok_per_s", "tok_per_s_runs")) or k in wanted]
    print(f"{name}: " + "; ".join(f"{k} {fmt(report[k])}" for k in keys))


def main() -> int:
    root = Path(sys.argv[1])
    for path in sorted(root.glob("*.json")):
        report = load(path)
        if not isinstance(report, (dict, list)):
            print(f"{path.name}: unreadable")
            continue
        if isinstance(report, dict) and "error" in report:
            print(f"{path.name}: ERROR {report['error'][:300]}")
        elif path.stem == "overhead":
            overhead(report)
        elif path.stem.startswith("decode_"):
            decode(path.stem, report)
        elif path.stem == "cpu_by_phase":
            print("CPU per wall second (gpu-process / renderer / browser) and top threads:")
            for p in report:
                c = p["cpu_per_wall"]
                print(
                    f"  {p['phase'][:70]:70} {c.get('gpu-process', 0):.2f} / {c.get('renderer', 0):.2f} / "
                    f"{c.get('browser', 0):.2f}  {p['top_threads']}"
                )
        else:
            bench(path.stem, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
