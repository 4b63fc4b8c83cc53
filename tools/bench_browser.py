"""Run the engine benchmark inside headless Chromium (Pyodide + WebGPU) and print its JSON report.

    .venv/bin/python tools/bench_browser.py                  # bundled model, quick settings
    .venv/bin/python tools/bench_browser.py --full --model URL

Builds dist/ (build.py), serves it on 127.0.0.1, opens dist/bench/ in Debian's Chromium with the
WebGPU flags from shared/browser-notes.md (SwiftShader here; a real GPU where Chromium has one:
drop --use-webgpu-adapter=swiftshader with --gpu). Figures on SwiftShader are relative only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import build  # noqa: E402

CHROMIUM_ARGS = ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--no-sandbox",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--no-first-run", "--disable-quic"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model URL (default: the bundled model)")
    parser.add_argument("--full", action="store_true", help="512-token prefill, 1k context, 128 tokens")
    parser.add_argument("--gpu", action="store_true", help="use Chromium's default adapter, not SwiftShader")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the report")
    parser.add_argument("--no-build", action="store_true")
    args = parser.parse_args()
    if not args.no_build:
        build.build()
    server = build.make_server(build.DIST, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/bench/"
    query = []
    if args.model:
        query.append(f"model={args.model}")
    if args.full:
        query.append("full=1")
    if query:
        url += "?" + "&".join(query)
    from playwright.sync_api import sync_playwright

    flags = [a for a in CHROMIUM_ARGS if not (args.gpu and "swiftshader" in a)]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
        page = browser.new_page()
        page.goto(url)
        page.wait_for_function("window.benchResult !== undefined", timeout=args.timeout * 1000)
        report = json.loads(page.evaluate("window.benchResult"))
        browser.close()
    server.shutdown()
    print(json.dumps(report, indent=2))
    return 1 if "error" in report else 0


if __name__ == "__main__":
    raise SystemExit(main())
