"""Browser test fixtures: dist/ built once, served on 127.0.0.1, Debian Chromium with SwiftShader WebGPU.

- `dist_dir`: build.py's dist/, built once per session (reused when `build.py test` just built it).
- `site`: a server for dist/ plus /_test/ (files made by the tests), recording every request and
  able to inject faults (drop the connection after N bytes, ignore Range, answer a status).
- `egress`: the proxy of every browser context (tools/chromium_launch.py): each request of a page,
  worker or service worker for a host other than 127.0.0.1 ends there (403, target recorded). The
  session fails if anything reached it, so no test, page or worker may touch the internet.
- `browser_egress`: the launch proxy, which only Chromium's own services use. The launch flags turn
  them off; whatever still reaches it is listed at the end of the run as Chromium's, not the app's
  (it never leaves the machine, and does not fail the run).
- Chromium: /usr/bin/chromium (never `playwright install`), flags from tools/chromium_launch.py.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from browser_helpers import LOCAL_PREFIXES, READY_MODEL, app_page, app_state, load_option, notice
from shapes import SMALL_SHAPE
from site_server import SiteServer, build

from tools.chromium_launch import CHROMIUM, EgressRecorder, launch_options, route_contexts_through

_BROWSER_OWN: list[str] = []  # Chromium's own requests, reported at the end of the run


def pytest_configure(config) -> None:
    # pytest-playwright empties its --output folder at session start (default test-results/);
    # keep it to a subfolder so the screenshots saved in test-results/ by these tests survive.
    if config.getoption("--output", default=None) == "test-results":
        config.option.output = "test-results/playwright"


@pytest.fixture(scope="session")
def device(pytestconfig: pytest.Config) -> str | None:
    """pytest-playwright's device emulation (its --device option), as the plugin defines it: here it
    overrides tests/conftest.py's GPU `device` fixture, which is for the CPython tests."""
    return pytestconfig.getoption("--device")


@pytest.fixture(scope="session")
def egress():
    server = EgressRecorder()
    yield server
    server.stop()
    assert server.seen == [], f"pages or workers requested hosts outside 127.0.0.1 during the tests: {server.seen}"


@pytest.fixture(scope="session")
def browser_egress():
    server = EgressRecorder()
    yield server
    server.stop()
    _BROWSER_OWN.extend(server.lines())
    if _BROWSER_OWN and os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's terminal summary is not shown
        warnings.warn(
            f"requests Chromium made on its own (not the app's; refused by the recorder): {_BROWSER_OWN}", stacklevel=2
        )


def pytest_terminal_summary(terminalreporter) -> None:
    if _BROWSER_OWN:
        terminalreporter.section("requests Chromium made on its own (not the app's; refused by the recorder)")
        for line in _BROWSER_OWN:
            terminalreporter.write_line(line)


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
    write_random_bitnet(str(path), **SMALL_SHAPE, context_length=256, seed=1)
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
def browser_type_launch_args(browser_type_launch_args, browser_egress):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium; `python3 build.py test` does it)")
    return {**browser_type_launch_args, **launch_options(browser_egress)}


@pytest.fixture(scope="session")
def browser(browser, egress):
    """pytest-playwright's browser, whose every new context sends outside requests to `egress`."""
    route_contexts_through(browser, egress)
    return browser


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


@pytest.fixture(scope="module")
def app(browser, site):
    """The chat page (no autoload) in one browser context for the module (`app_page`)."""
    with app_page(browser, site) as page:
        yield page


@pytest.fixture
def bundled(app, site, bundled_model):
    """The app with the bundled model loaded (loads it unless it already is), in a new chat."""
    key = site.url + bundled_model["url"]
    if app.get_attribute("#app", "data-key") != key or app_state(app)["model"] not in READY_MODEL:
        assert load_option(app, key) in READY_MODEL, notice(app)
    app.click("#new-chat")
    return app
