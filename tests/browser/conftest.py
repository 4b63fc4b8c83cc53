"""Browser test fixtures: dist/ built once, served on 127.0.0.1, Debian Chromium with SwiftShader WebGPU.

- `dist_dir`: build.py's dist/, built once per session (reused when `build.py test` just built it).
- `site`: a server for dist/ plus /_test/ (files made by the tests), recording every request and
  able to inject faults (drop the connection after N bytes, ignore Range, answer a status).
- `egress`: an HTTP proxy the browser must use for every non-loopback request. It answers 403 and
  records the target; the session fails if anything reached it, so no test (and no page, worker or
  service worker) may touch the internet.
- Chromium: /usr/bin/chromium (never `playwright install`), flags from shared/browser-notes.md.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import LOCAL_PREFIXES
from site_server import EgressRecorder, SiteServer, build

CHROMIUM = "/usr/bin/chromium"
# A --disable-features switch replaces Playwright's own (the last one wins), so this repeats
# Playwright 1.5x's list and adds AutofillServerCommunication (content-autofill.googleapis.com form
# queries). OptimizationHints, NetworkTimeServiceQuerying, AimEnabled and PreconnectToSearch keep
# Chromium from calling Google at startup.
CHROMIUM_OWN_HOST = "redirector.gvt1.com"
DISABLED_FEATURES = (
    "AvoidUnnecessaryBeforeUnloadCheckSync",
    "DestroyProfileOnBrowserClose",
    "HttpsUpgrades",
    "HttpsFirstBalancedModeAutoEnable",
    "LensOverlay",
    "MediaRouter",
    "PaintHolding",
    "ThirdPartyStoragePartitioning",
    "AvoidCorsURLLoaderRestartOnRedirect",
    "OptimizationHints",
    "NetworkTimeServiceQuerying",
    "AimEnabled",
    "PreconnectToSearch",
    "AutofillServerCommunication",
)
CHROMIUM_ARGS = [
    "--enable-unsafe-webgpu",
    "--use-webgpu-adapter=swiftshader",
    "--no-sandbox",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
    # Chromium's own sign-in and push-messaging calls (accounts.google.com,
    # android.clients.google.com), made even with the flags above: pointed at a closed
    # local port, so the egress recorder can demand zero outside requests.
    "--gaia-url=http://127.0.0.1:9",
    "--gcm-checkin-url=http://127.0.0.1:9/checkin",
    "--gcm-registration-url=http://127.0.0.1:9/register",
    "--gcm-mcs-endpoint=http://127.0.0.1:9/mcs",
    # spell-check dictionaries (redirector.gvt1.com) when text is typed: that host
    # bypasses the recorder and resolves to the same closed port
    f"--host-resolver-rules=MAP {CHROMIUM_OWN_HOST} 127.0.0.1:9",
    "--disable-features=" + ",".join(DISABLED_FEATURES),
]


def pytest_configure(config) -> None:
    # pytest-playwright empties its --output folder at session start (default test-results/);
    # keep it to a subfolder so the screenshots saved in test-results/ by these tests survive.
    if config.getoption("--output", default=None) == "test-results":
        config.option.output = "test-results/playwright"


@pytest.fixture(scope="session")
def egress():
    server = EgressRecorder()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    assert server.seen == [], f"requests left 127.0.0.1 during the browser tests: {server.seen}"


@pytest.fixture(scope="session")
def dist_dir() -> Path:
    # BITNET_WEB_DIST: a dist folder of one's own, for several test runs side by side
    dist = Path(os.environ.get("BITNET_WEB_DIST") or build.DIST)
    if not (os.environ.get("BITNET_WEB_DIST_BUILT") == "1" and (dist / "sw.js").exists()):
        build.build(dist)
    return dist


@pytest.fixture(scope="session")
def test_files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("site-test-files")


@pytest.fixture(scope="session")
def site(dist_dir, test_files):
    server = SiteServer(dist_dir, test_files)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(test_files) -> bytes:
    """A small random BitNet GGUF (fast for the engine on SwiftShader) for the download tests."""
    from bitnet_web.convert.synthetic import write_random_bitnet

    path = test_files / "tiny.gguf"
    write_random_bitnet(
        str(path), dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300, context_length=256, seed=1
    )
    return path.read_bytes()


@pytest.fixture(scope="session")
def bundled_model(dist_dir) -> dict[str, Any]:
    import json

    manifest = json.loads((dist_dir / "models" / "models.json").read_text())
    entry = next(m for m in manifest["models"] if m["id"] == manifest["default"])
    return {**entry, "path": dist_dir / entry["url"]}


# ------------------------------------------------------------------------------------------------
# Chromium through pytest-playwright
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args, egress):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; `python3 build.py test` does it)")
    return {
        **browser_type_launch_args,
        "executable_path": CHROMIUM,
        "args": CHROMIUM_ARGS,
        # Playwright sends loopback through the proxy unless the bypass names it
        "proxy": {
            "server": f"http://127.0.0.1:{egress.server_address[1]}",
            "bypass": f"127.0.0.1,localhost,{CHROMIUM_OWN_HOST}",
        },
    }


@pytest.fixture(scope="session")
def browser_context_args(browser_context_args):
    return {**browser_context_args, "viewport": {"width": 1280, "height": 860}}


@pytest.fixture
def watch_page(page):
    """The page, with console lines and uncaught exceptions collected (printed on failure); fails
    the test if the page or its workers requested anything but 127.0.0.1."""
    log: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    page.set_default_timeout(120_000)
    page.bitnet_log = log
    yield page
    if log:
        print("\n".join(log[-80:]))
    assert outside == [], f"the page or its workers requested URLs outside 127.0.0.1: {outside}"
