"""The chat page in Chromium (SwiftShader WebGPU), each test in a fresh browser context: first
visit, reload from IndexedDB, offline with the server stopped, no WebGPU, two tabs.

References: the model file on disk (parsed by CPython, hashed with hashlib), the test server's
request log, IndexedDB read directly by the test (not through the app), the CPython engine.
"""

from __future__ import annotations

import hashlib

import pytest
from browser_helpers import (
    GREEDY_FORM,
    NO_AUTOLOAD,
    READY_MODEL,
    SYSTEM,
    app_state,
    cpython_turn,
    engine_importable,
    idb_entry,
    model_info,
    notice,
    open_app,
    screenshot,
    send_and_wait,
    set_settings,
    wait_offline_ready,
    wait_settled,
)
from site_server import SiteServer

from bitnet_web.formats.gguf_reader import open_gguf
from bitnet_web.web.shared.settings import parse_form

pytestmark = pytest.mark.browser


def test_first_visit_then_reload_from_indexeddb_then_offline(watch_page, dist_dir, test_files, bundled_model):
    """A person's first visit downloads the bundled model; a reload takes it from IndexedDB without
    fetching it again; with the server stopped, a reload still starts and answers (service worker)."""
    page = watch_page
    server = SiteServer(dist_dir, test_files)  # this test stops its server
    model_path = "/" + bundled_model["url"]
    key = server.url + bundled_model["url"]
    try:
        open_app(page, server.url)
        assert app_state(page)["engine"] in ("ready", "missing")
        first = wait_settled(page)
        assert first in READY_MODEL, notice(page)
        assert app_state(page)["source"] == "network"

        gguf = open_gguf(str(bundled_model["path"]))
        info = model_info(page)
        assert info["Architecture"] == gguf.architecture
        n_params = sum(t.n_elements for t in gguf.tensors.values())
        assert info["Parameters"] == (f"{n_params / 1e6:.2f}M" if n_params >= 1e6 else f"{n_params / 1e3:.2f}K")
        assert info["Vocabulary"] == f"{len(gguf.metadata['tokenizer.ggml.tokens']):,}"
        entry = idb_entry(page, key)
        assert entry is not None and entry["meta"]["complete"] is True
        assert entry["size"] == bundled_model["path"].stat().st_size
        assert entry["sha256"] == hashlib.sha256(bundled_model["path"].read_bytes()).hexdigest()
        screenshot(page, "chat-loaded")

        wait_offline_ready(page)  # the service worker's precache has fetched its copy too
        served_before = len(server.requests_for(model_path))
        seen = []
        page.on("request", lambda r: seen.append(r.url) if r.url.endswith(model_path) else None)
        page.reload()
        assert wait_settled(page) == first
        assert app_state(page)["source"] == "cache"
        assert seen == [], "the page or its worker fetched the model again"
        assert len(server.requests_for(model_path)) == served_before
    finally:
        server.stop()

    page.reload()
    page.wait_for_function(
        "() => ['ready', 'missing'].includes(document.getElementById('app').dataset.engine)", timeout=180_000
    )
    assert wait_settled(page) == first
    assert app_state(page)["source"] == "cache"
    if engine_importable() and first == "loaded":
        set_settings(page, GREEDY_FORM, SYSTEM)
        reply = send_and_wait(page, "class Stack:\n")
        assert reply["state"] == "done"
        assert reply["text"] == cpython_turn(
            bundled_model["path"], SYSTEM, [], "class Stack:\n", parse_form(GREEDY_FORM)
        )
    screenshot(page, "chat-offline")


def test_no_webgpu_shows_a_failure_page(watch_page, site):
    page = watch_page
    page.add_init_script("Object.defineProperty(Navigator.prototype, 'gpu', {get: () => undefined});")
    page.goto(site.url)
    page.wait_for_selector("#failure:not([hidden])")
    text = page.inner_text("#failure")
    assert "no WebGPU" in text and "chrome://flags" in text and "Chrome or Edge" in text
    assert page.is_hidden("#app")
    screenshot(page, "failure-no-webgpu")


def test_two_tabs_loading_one_model_download_it_once(context, site, tiny_model, test_files):
    data = tiny_model
    (test_files / "twotabs.gguf").write_bytes(data)
    url = site.url + "_test/twotabs.gguf"
    site.add_fault("/_test/twotabs.gguf", delay_s=4)  # the first download is still running when tab 2 asks
    tabs = [context.new_page(), context.new_page()]
    for tab in tabs:
        tab.set_default_timeout(120_000)
        open_app(tab, site.url + NO_AUTOLOAD)
        tab.select_option("#model-select", "custom")
        tab.fill("#custom-url", url)
    # both Load clicks before either download can finish; each tab then waits for its own load
    before = [int(tab.get_attribute("#app", "data-loads") or 0) for tab in tabs]
    for tab in tabs:
        tab.click("#load")
    for tab, n in zip(tabs, before, strict=True):
        tab.wait_for_function(f"() => Number(document.getElementById('app').dataset.loads) > {n}")
        assert wait_settled(tab) in READY_MODEL, notice(tab)
    assert sorted(app_state(tab)["source"] for tab in tabs) == ["cache", "network"]
    assert len(site.requests_for("/_test/twotabs.gguf")) == 1
    entry = idb_entry(tabs[0], url)
    assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()
