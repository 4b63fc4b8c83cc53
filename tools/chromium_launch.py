"""How the browser tests and tools/bench_browser.py run Debian's Chromium: flags that keep the browser's
own services off the network, and the proxies that record whatever still tries to leave 127.0.0.1.

Two recorders, told apart by Chromium itself rather than by guessing from URLs:
- the app's (`context_proxy`): every browser context the tests open gets it as its proxy, so any
  request of a page, its workers or its service worker for a host other than 127.0.0.1 ends there;
- the browser's (`launch_options`): the launch proxy, which only Chromium's own services use (the
  component updater, variations, Safe Browsing, ...: they run in the browser's system network
  context, outside every page context). The flags below turn those services off or point them at a
  closed local port; what remains is recorded and reported as Chromium's, never counted as the app's.
An app request can therefore never be hidden among the browser's own, whatever its URL.
"""

from __future__ import annotations

import socketserver
import threading
from typing import Any

CHROMIUM = "/usr/bin/chromium"
# The discard port on loopback: nothing listens there, so a request fails at once and nothing leaves.
CLOSED = "http://127.0.0.1:9"
# spell-check dictionaries (when text is typed) are fetched from this host in the page's context:
# the proxies let it through to the host resolver, which sends it to the closed port
CHROMIUM_OWN_HOST = "redirector.gvt1.com"
LOOPBACK_BYPASS = f"127.0.0.1,localhost,{CHROMIUM_OWN_HOST}"  # Playwright proxies loopback unless named

# A --disable-features switch replaces Playwright's own (the last one wins), so this repeats
# Playwright 1.5x's list and adds Chromium's features that call Google on their own.
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
    "OptimizationHintsFetching",
    "OptimizationGuideModelDownloading",
    "OptimizationTargetPrediction",
    "NetworkTimeServiceQuerying",
    "AimEnabled",
    "PreconnectToSearch",
    "AutofillServerCommunication",
    "CertificateTransparencyComponentUpdater",
    "Translate",
    "InterestFeedContentSuggestions",
    "CalculateNativeWinOcclusion",
    "DialMediaRouteProvider",
)

# Chromium's own services: turned off, or pointed at the closed port where no switch turns them off
NO_TRAFFIC_ARGS = [
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--no-pings",
    "--metrics-recording-only",
    # the component updater (update.googleapis.com), which --disable-component-update alone left
    # running in Chromium 156; its pings go to the same URL
    f"--component-updater=url-source={CLOSED}/component-update",
    f"--variations-server-url={CLOSED}/variations",
    f"--variations-insecure-server-url={CLOSED}/variations",
    f"--optimization-guide-service-get-hints-url={CLOSED}/hints",
    f"--optimization-guide-service-get-models-url={CLOSED}/models",
    f"--translate-script-url={CLOSED}/translate",
    f"--translate-ranker-model-url={CLOSED}/ranker",
    # sign-in and push messaging (accounts.google.com, android.clients.google.com)
    f"--gaia-url={CLOSED}",
    f"--google-base-url={CLOSED}",
    f"--gcm-checkin-url={CLOSED}/checkin",
    f"--gcm-registration-url={CLOSED}/register",
    f"--gcm-mcs-endpoint={CLOSED}/mcs",
    f"--host-resolver-rules=MAP {CHROMIUM_OWN_HOST} 127.0.0.1:9",
    "--disable-features=" + ",".join(DISABLED_FEATURES),
]
BASE_ARGS = ["--enable-unsafe-webgpu", "--no-sandbox", "--disable-quic"]  # (shared/browser-notes.md)
SWIFTSHADER_ARG = "--use-webgpu-adapter=swiftshader"


def chromium_args(swiftshader: bool = True) -> list[str]:
    """Launch flags: WebGPU (on SwiftShader unless `swiftshader` is False) and no traffic of its own."""
    return BASE_ARGS + ([SWIFTSHADER_ARG] if swiftshader else []) + NO_TRAFFIC_ARGS


class EgressRecorder(socketserver.ThreadingTCPServer):
    """A proxy that serves nothing: records each request line (e.g. `CONNECT host:443`) and refuses."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _EgressHandler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def proxy(self) -> dict[str, str]:
        """Playwright's proxy settings that send everything but loopback here."""
        return {"server": f"http://127.0.0.1:{self.server_address[1]}", "bypass": LOOPBACK_BYPASS}

    def lines(self) -> list[str]:
        with self.lock:
            return list(self.seen)

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _EgressHandler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(4096).decode("latin-1").strip()
        with self.server.lock:
            self.server.seen.append(line)
        self.wfile.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


def launch_options(browser_recorder: EgressRecorder, swiftshader: bool = True) -> dict[str, Any]:
    """Playwright launch options: Debian's Chromium, our flags, Chromium's own requests to `browser_recorder`."""
    return {"executable_path": CHROMIUM, "args": chromium_args(swiftshader), "proxy": browser_recorder.proxy}


def route_contexts_through(browser: Any, app_recorder: EgressRecorder) -> None:
    """Make every `browser.new_context()` (also pytest-playwright's) send the app's outside requests to
    `app_recorder`, unless the caller names a proxy of its own."""
    plain = browser.new_context

    def new_context(**kwargs: Any) -> Any:
        return plain(**{"proxy": app_recorder.proxy, **kwargs})

    browser.new_context = new_context
