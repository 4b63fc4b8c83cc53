"""Run the engine benchmark inside headless Chromium (Pyodide + WebGPU) and print its JSON report.

    .venv/bin/python tools/bench_browser.py                  # bundled model, quick settings
    .venv/bin/python tools/bench_browser.py --full --model URL
    .venv/bin/python tools/bench_browser.py --page load.html --model URL   # IndexedDB load, per phase

Builds dist/ (build.py), serves it on 127.0.0.1, opens dist/bench/ in Debian's Chromium with the
WebGPU flags from shared/browser-notes.md (SwiftShader here; a real GPU where Chromium has one:
drop --use-webgpu-adapter=swiftshader with --gpu). Figures on SwiftShader are relative only.
Chromium is launched as the browser tests launch it (tools/chromium_launch.py): its own services
stay off the network, and any request it still makes on its own is printed (stderr) apart from the
page's requests outside 127.0.0.1 (a --model URL on another host is the page's, and is let through).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import build  # noqa: E402
from tools.chromium_launch import EgressRecorder, launch_options  # noqa: E402

LOCAL_PREFIXES = ("http://127.0.0.1:", "data:", "blob:")


def python_time_summary(report: dict) -> str:
    """Python ms per decoded token, recording vs the rest, from the bench page's extra measurements."""

    def row(what: str, value: str) -> str:
        return f"  {what + ':':<58} {value}"

    replay = "on" if report.get("recorded_program_replay") else "off"
    lines = [
        f"Python ms per decoded token ({report.get('dispatches_per_token')} dispatches per step):",
        row(
            f"recording, decode loop, mean (measure_async, replay {replay})",
            f"{report.get('decode_short_python_encode_ms_per_token', float('nan')):.3f}",
        ),
    ]
    loop = report.get("decode_loop_record_ms") or {}
    for key in ("replay", "direct") if "error" not in loop else ():
        if key in loop:
            lines.append(
                row(
                    f"recording, decode loop (GPU busy), {key}",
                    f"{loop[key]['median']:.3f} median / {loop[key]['mean']:.3f} mean of {loop[key]['steps']} steps",
                )
            )
    split = report.get("python_per_token_idle_gpu") or {}
    for key, what in (
        ("record_ms_replay", "recording, GPU idle, replay"),
        ("record_ms_direct", "recording, GPU idle, direct (one FFI call per command)"),
        ("submit_and_readback_ms", "the rest: submit + 4-byte readback"),
    ):
        if key in split:
            lines.append(row(what, f"{split[key]['min']:.3f} min / {split[key]['median']:.3f} median"))
    for name, part in (("decode loop", loop), ("idle split", split)):
        if "error" in part:
            lines.append(f"  {name} not measured: {part['error']}")
    if "programs_built_reused" in report:
        built, reused = report["programs_built_reused"]
        lines.append(f"  recorded programs built / reused during measure_async: {built} / {reused}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model URL (default: the bundled model)")
    parser.add_argument("--page", default="", help="page under dist/bench/ (default: the engine benchmark)")
    parser.add_argument("--full", action="store_true", help="512-token prefill, 1k context, 128 tokens")
    parser.add_argument("--gpu", action="store_true", help="use Chromium's default adapter, not SwiftShader")
    parser.add_argument(
        "--no-replay",
        action="store_true",
        help="encode every GPU step from Python (no recorded-program replay), for comparison",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the report")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument(
        "--dist",
        type=Path,
        default=Path(os.environ.get("BITNET_WEB_DIST") or build.DIST),
        help="dist folder to build and serve (default: $BITNET_WEB_DIST, else dist/)",
    )
    args = parser.parse_args()
    if not args.no_build:
        build.build(args.dist)
    server = build.make_server(args.dist, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/bench/{args.page}"
    query = []
    if args.model:
        query.append(f"model={args.model}")
    if args.full:
        query.append("full=1")
    if args.no_replay:
        query.append("replay=0")
    if query:
        url += ("&" if "?" in url else "?") + "&".join(query)
    from playwright.sync_api import sync_playwright

    chromium_own = EgressRecorder()
    outside: list[str] = []
    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="bench-profile-") as profile:
        # An on-disk profile, as a user's browser has: a fresh context is incognito-like, and keeps
        # IndexedDB in memory, where a 1.2 GB model fails to read back ("Failed to read large
        # IndexedDB value"). The page's requests go direct: the model may be on another host (--model
        # URL); a local one uses the launch proxy's loopback bypass ("direct://" fails on loopback).
        options = launch_options(chromium_own, swiftshader=not args.gpu)
        remote = bool(args.model) and args.model.startswith(("http://", "https://"))
        if remote and not args.model.startswith(LOCAL_PREFIXES):
            options["proxy"] = {"server": "direct://"}
        context = p.chromium.launch_persistent_context(profile, **options)
        context.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
        page = context.new_page()
        page.goto(url)
        page.wait_for_function("window.benchResult !== undefined", timeout=args.timeout * 1000)
        report = json.loads(page.evaluate("window.benchResult"))
        context.close()
    chromium_own.stop()
    for what, lines in (
        ("the page requested outside 127.0.0.1", outside),
        ("Chromium requested on its own (refused, not the page's)", chromium_own.lines()),
    ):
        if lines:
            print(f"{what}:\n  " + "\n  ".join(lines), file=sys.stderr)
    server.shutdown()
    print(json.dumps(report, indent=2))
    if "error" not in report and not args.page:
        print(python_time_summary(report), file=sys.stderr)
    return 1 if "error" in report else 0


if __name__ == "__main__":
    raise SystemExit(main())
