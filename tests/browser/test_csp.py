"""Content-Security-Policy: the chat page, the widget page, the engine worker and the service worker
run under a policy that allows code only from the site itself (no inline script or handler, no
string eval once the app runs), fetch only from the site and the model hosts, and still run Pyodide.

- Served by build.py (header + <meta>): the chat page loads a model, answers, goes offline-ready
  (service worker precache under its own policy) with zero violations in the page and the worker.
- Positive controls, so a policy that is absent or too loose fails: an injected inline handler does
  not run, a string timer does not run in the page (PyScript needed 'unsafe-eval' to start; the app
  then adds a stricter policy) nor in the worker, and the worker cannot fetch another host.
- A static host sends no header: the <meta> tag alone still protects the page.
- The widget page starts its engine under the same policy with zero violations.
"""

from __future__ import annotations

import functools
import http.server
import re
import urllib.request

import pytest
from browser_helpers import (
    GREEDY_FORM,
    LOCAL_PREFIXES,
    NO_AUTOLOAD,
    SYSTEM,
    engine_worker,
    load_custom,
    needs_engine,
    notice,
    open_app,
    send_and_wait,
    set_settings,
    wait_offline_ready,
)
from site_server import SiteHandler, SiteServer, build

pytestmark = pytest.mark.browser

COLLECT_VIOLATIONS = """
window.__csp = [];
document.addEventListener('securitypolicyviolation',
  (e) => window.__csp.push(`${e.effectiveDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`));
"""


def violations(page) -> dict[str, list[str]]:
    console = [line for line in page.bitnet_log if re.search("Content.Security.Policy", line)]
    worker = engine_worker(page).evaluate("() => self.cspViolations")
    return {"page": page.evaluate("() => window.__csp"), "worker": worker, "console": console}


def new_page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    page.bitnet_log = []
    page.bitnet_outside = []
    page.on("console", lambda m: page.bitnet_log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: page.bitnet_log.append(f"pageerror: {e}"))
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else page.bitnet_outside.append(r.url))
    page.add_init_script(COLLECT_VIOLATIONS)
    page.set_default_timeout(120_000)
    return context, page


@pytest.fixture
def fresh(browser):
    context, page = new_page(browser)
    yield page
    context.close()
    if page.bitnet_log:
        print("\n".join(page.bitnet_log[-60:]))
    assert page.bitnet_outside == [], f"requests left 127.0.0.1: {page.bitnet_outside}"


def assert_page_policy_enforced(page) -> None:
    """An injected inline handler and a string timer must not run (policy present, no 'unsafe-inline',
    no 'unsafe-eval' left once the app runs). Both are page-origin actions, unlike Playwright's own
    evaluate, which the DevTools protocol exempts from the eval check."""
    page.evaluate("""() => { const d = document.createElement('div');
        d.innerHTML = '<img src="data:," onerror="window.__inline = 1">';
        document.body.append(d); setTimeout('window.__timer = 1', 0); }""")
    page.wait_for_timeout(500)
    assert page.evaluate("() => [window.__inline, window.__timer]") == [None, None]
    blocked = " ".join(page.evaluate("() => window.__csp"))
    assert "script-src-attr" in blocked and "eval" in blocked, blocked


def test_policy_headers_and_meta_tags(site):
    assert "'unsafe-eval'" not in build.CSP_APP and "unsafe-inline" not in build.CSP_APP
    assert "'wasm-unsafe-eval'" in build.CSP_APP
    assert build.CSP_PAGE.replace(" 'unsafe-eval'", "") == build.CSP_APP
    for path, policy in (
        ("", build.CSP_PAGE),
        ("index.html", build.CSP_PAGE),
        ("widget/", build.CSP_PAGE),
        ("engine-worker.js", build.CSP_APP),
        ("sw.js", build.CSP_APP),
    ):
        with urllib.request.urlopen(site.url + path) as response:
            assert response.headers["Content-Security-Policy"] == policy, path
            body = response.read().decode()
        if not path.endswith(".js"):
            metas = re.findall(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', body)
            assert metas == [policy], path
    with urllib.request.urlopen(site.url + "models/models.json") as response:  # data: no policy needed
        assert response.headers["Content-Security-Policy"] is None


@needs_engine
def test_chat_page_loads_and_chats_with_zero_violations(fresh, site, tiny_model, test_files):
    page = fresh
    (test_files / "csp-tiny.gguf").write_bytes(tiny_model)
    open_app(page, site.url + NO_AUTOLOAD)
    assert load_custom(page, site.url + "_test/csp-tiny.gguf") == "loaded", notice(page)
    set_settings(page, {**GREEDY_FORM, "max_tokens": "3"}, SYSTEM)
    reply = send_and_wait(page, "hello")
    assert reply["state"] == "done" and reply["pieces"] >= 1
    wait_offline_ready(page)  # the service worker precached the site under its own policy
    assert violations(page) == {"page": [], "worker": [], "console": []}

    assert_page_policy_enforced(page)
    worker = engine_worker(page)
    worker.evaluate("() => { setTimeout('self.__timer = 1', 0); }")
    page.wait_for_timeout(300)
    assert worker.evaluate("() => self.__timer") is None
    # another host (not a model host): refused by the policy before any request is made (the
    # session's egress recorder would otherwise see it)
    outcome = worker.evaluate("""async () => { try { await fetch('https://example.com/model.gguf');
        return 'fetched'; } catch (e) { return e.name; } }""")
    assert outcome == "TypeError"
    assert worker.evaluate("() => self.cspViolations") == [
        "script-src blocked eval",
        "connect-src blocked https://example.com/model.gguf",
    ]
    page.wait_for_function("""() => [...document.querySelectorAll('#progress-text')]
        .some((n) => n.textContent.includes('connect-src blocked'))""")  # reported to the page

    # a custom model URL on a host the policy does not list: the failure says why
    assert load_custom(page, "https://example.com/model.gguf") == "error"
    n = notice(page)
    assert n["visible"] and "Content-Security-Policy" in n["text"] and "https://example.com/model.gguf" in n["text"], n


class HeaderlessHandler(SiteHandler):
    """A static host: the same files, no Content-Security-Policy header."""

    def end_headers(self) -> None:
        http.server.SimpleHTTPRequestHandler.end_headers(self)


def test_meta_tag_alone_protects_the_page_on_a_static_host(fresh, dist_dir, test_files):
    server = SiteServer(dist_dir, test_files)
    server.RequestHandlerClass = functools.partial(HeaderlessHandler, directory=str(dist_dir))
    try:
        with urllib.request.urlopen(server.url) as response:
            assert response.headers["Content-Security-Policy"] is None
        open_app(fresh, server.url + NO_AUTOLOAD)
        assert fresh.get_attribute("#app", "data-engine") in ("ready", "missing")
        assert fresh.evaluate("() => window.__csp") == []
        assert_page_policy_enforced(fresh)
    finally:
        server.stop()


def test_widget_page_starts_with_zero_violations(fresh, site):
    page = fresh
    page.goto(site.url + "widget/")
    # the shared worker answered and the default model is loading (or loaded): the page, PyScript
    # and the worker's start all ran under the policy
    page.wait_for_function(
        """() => { const t = document.getElementById('tldr');
        return t && t.dataset.state && t.dataset.state !== 'starting'
               || (t && /Loading|Model:/.test(t.textContent)); }""",
        timeout=180_000,
    )
    assert violations(page) == {"page": [], "worker": [], "console": []}
    assert_page_policy_enforced(page)
