"""The chat page driven through one long session (one browser context for this module, as a person
would use it): bad URLs, dropped downloads, the cache manager, untrusted metadata, the keyboard,
phone width, and with the engine: greedy replies equal to CPython's, history, Stop.

Every test starts from whatever the previous one left and first puts the app in the state it
needs, so they also show that the app stays usable after each failure.
"""

from __future__ import annotations

import hashlib
import re

import pytest
from browser_helpers import (
    GREEDY_FORM,
    READY_MODEL,
    SYSTEM,
    app_state,
    cpython_turn,
    idb_entry,
    last_reply,
    load_custom,
    model_info,
    needs_engine,
    notice,
    screenshot,
    send_and_wait,
    set_settings,
)
from shapes import SMALL_SHAPE

from bitnet_web.web.shared.settings import parse_form

pytestmark = pytest.mark.browser


def test_non_gguf_url_is_reported(app, site):
    assert load_custom(app, site.url + "index.html") == "error"
    n = notice(app)
    assert n["kind"] == "not_gguf", n
    assert "HTML page" in n["text"] and "GGUF" in n["text"]
    assert idb_entry(app, site.url + "index.html") is None


def test_http_error_is_reported(app, site):
    assert load_custom(app, site.url + "_test/missing.gguf") == "error"
    n = notice(app)
    assert n["kind"] == "download" and "HTTP 404" in n["text"], n
    assert idb_entry(app, site.url + "_test/missing.gguf") is None, "a failed download left a cache entry"


def test_truncated_gguf_is_reported_and_nothing_is_cached(app, site, bundled_model, test_files):
    data = bundled_model["path"].read_bytes()
    (test_files / "truncated.gguf").write_bytes(data[: len(data) * 6 // 10])
    assert load_custom(app, site.url + "_test/truncated.gguf") == "error"
    n = notice(app)
    assert n["visible"] and n["kind"] == "bad_model", n
    assert re.search(r"truncat|past the end|beyond|ends", n["text"], re.I), n["text"]
    assert "truncated.gguf: " in n["text"], "the message does not say which file"
    assert idb_entry(app, site.url + "_test/truncated.gguf") is None, "a damaged file was left in the cache"
    screenshot(app, "chat-truncated-error")


def test_dropped_download_resumes_with_range(app, site, tiny_model, test_files):
    data = tiny_model
    (test_files / "resume.gguf").write_bytes(data)
    drop_at = len(data) * 4 // 10
    site.add_fault("/_test/resume.gguf", drop_after=drop_at)
    assert load_custom(app, site.url + "_test/resume.gguf") in READY_MODEL, notice(app)
    requests = site.requests_for("/_test/resume.gguf")
    assert requests[0]["range"] is None
    resumed = [r for r in requests[1:] if r["range"]]
    assert resumed, f"no Range request after the drop: {requests}"
    first_byte = int(re.fullmatch(r"bytes=(\d+)-", resumed[0]["range"]).group(1))
    assert 0 < first_byte <= drop_at
    assert resumed[0]["if_range"], "a resume must say which version it continues (If-Range)"
    entry = idb_entry(app, site.url + "_test/resume.gguf")
    assert entry["meta"]["complete"] is True
    assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_server_ignoring_range_restarts_from_zero(app, site, tiny_model, test_files):
    data = tiny_model
    (test_files / "norange.gguf").write_bytes(data)
    site.add_fault("/_test/norange.gguf", drop_after=len(data) // 2)
    site.add_fault("/_test/norange.gguf", ignore_range=True)
    assert load_custom(app, site.url + "_test/norange.gguf") in READY_MODEL, notice(app)
    requests = site.requests_for("/_test/norange.gguf")
    assert len(requests) == 2 and requests[1]["range"], requests  # asked to resume, got the whole file
    entry = idb_entry(app, site.url + "_test/norange.gguf")
    assert entry["size"] == len(data) and entry["sha256"] == hashlib.sha256(data).hexdigest()


def test_quota_shortfall_is_reported_before_downloading(app, site, egress, tiny_model, test_files):
    (test_files / "before-quota.gguf").write_bytes(tiny_model)
    before = load_custom(app, site.url + "_test/before-quota.gguf")
    assert before in READY_MODEL, notice(app)
    app.evaluate(
        "() => { window.__estimate = navigator.storage.estimate.bind(navigator.storage);"
        " navigator.storage.estimate = async () => ({quota: 50e6, usage: 1e6}); }"
    )
    try:
        app.select_option(
            "#model-select",
            "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T-gguf/resolve/main/ggml-model-i2_s.gguf",
        )
        app.click("#load")
        app.wait_for_selector("#notice[data-kind='quota']")
        assert "storage" in app.inner_text("#notice")
        assert not [s for s in egress.seen if "huggingface" in s]
        if before == "loaded":  # it is still the model in use, and every line says so by name (not
            # the last load's "Downloaded from the network and loaded." under the refused entry)
            assert app_state(app)["model"] == "loaded"
            for where in ("#notice", "#progress-text", "#status"):
                text = app.inner_text(where)
                assert "before-quota.gguf is still loaded" in text, (where, text)
        else:  # fetched and checked, but no engine to run it: nothing usable was loaded
            assert app_state(app)["model"] == "error"
        screenshot(app, "failure-quota")
    finally:
        app.evaluate("() => { navigator.storage.estimate = window.__estimate; }")


def test_model_metadata_is_shown_as_text(app, site, test_files):
    from bitnet_web.convert.synthetic import random_bitnet_writer
    from bitnet_web.formats.ggml import Keys

    hostile = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
    writer = random_bitnet_writer(str(test_files / "hostile.gguf"), **SMALL_SHAPE, context_length=256)
    writer.metadata[Keys.NAME] = hostile
    writer.write()
    assert load_custom(app, site.url + "_test/hostile.gguf") in (*READY_MODEL, "error")
    assert model_info(app)["Name"] == hostile
    assert app.evaluate("() => window.__pwned") is None
    assert app.locator("#model-info img, #model-info script").count() == 0


def test_cache_manager_lists_and_deletes(app, site):
    key = site.url + "_test/resume.gguf"
    if idb_entry(app, key) is None:
        pytest.skip("needs the file cached by test_dropped_download_resumes_with_range")
    app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    item = app.locator(f"#cache-list li[data-key='{key}']")
    item.wait_for()
    assert item.get_attribute("data-complete") == "1"
    screenshot(app, "chat-storage")
    item.locator("button").click()
    app.wait_for_selector(f"#cache-list li[data-key='{key}']", state="detached")
    assert idb_entry(app, key) is None


def test_enter_sends_and_shift_enter_adds_a_line(bundled):
    page = bundled
    set_settings(page, {**GREEDY_FORM, "max_tokens": "1"}, SYSTEM)  # the keys matter here, not the reply
    page.click("#prompt")
    page.keyboard.type("line one")
    page.keyboard.press("Shift+Enter")
    page.keyboard.type("line two")
    assert page.input_value("#prompt") == "line one\nline two"
    assert page.locator(".msg.user").count() == 0
    page.keyboard.press("Enter")
    page.locator(".msg.user").first.wait_for()
    assert page.locator(".msg.user .text").first.text_content() == "line one\nline two"
    assert page.input_value("#prompt") == ""
    page.wait_for_function(
        """() => { const t = document.querySelector('.msg.assistant .text');
        return t && t.dataset.state !== 'streaming'; }""",
        timeout=300_000,
    )
    if app_state(page)["model"] == "header":  # no engine: the reply says so instead of answering
        assert last_reply(page)["state"] == "error"
        assert "engine" in last_reply(page)["text"]


def test_phone_width_layout(bundled):
    page = bundled
    page.set_viewport_size({"width": 390, "height": 844})
    try:
        overflow = page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"the page scrolls sideways by {overflow}px at phone width"
        for selector in ("#prompt", "#send", "#stop", "#model-select"):
            box = page.locator(selector).bounding_box()
            assert box and box["x"] >= 0 and box["x"] + box["width"] <= 390, selector
        # the panels' notes share one text size (the Storage summary was once larger than the rest)
        sizes = page.evaluate(
            """() => Object.fromEntries(['#progress-text', '#system-note', '#storage-summary'].map(
                (s) => [s, getComputedStyle(document.querySelector(s)).fontSize]))"""
        )
        assert len(set(sizes.values())) == 1, sizes
        opened = page.evaluate(
            """() => [...document.querySelectorAll('.side details:not([open])')].map((d) => (d.open = true, d.id))"""
        )
        screenshot(page, "chat-phone")
        page.evaluate("(ids) => ids.forEach((id) => { document.getElementById(id).open = false; })", opened)
    finally:
        page.set_viewport_size({"width": 1280, "height": 860})


# ------------------------------------------------------------------------------------------------
# With the engine
# ------------------------------------------------------------------------------------------------


@needs_engine
def test_bundled_model_reply_equals_cpython_greedy_output(bundled, bundled_model):
    page = bundled
    assert app_state(page)["model"] == "loaded", notice(page)
    set_settings(page, GREEDY_FORM, SYSTEM)
    prompt = "def fibonacci(n):\n"
    reply = send_and_wait(page, prompt)
    assert reply["state"] == "done"
    assert reply["text"] == cpython_turn(bundled_model["path"], SYSTEM, [], prompt, parse_form(GREEDY_FORM))
    assert reply["pieces"] > 1, "the reply arrived in one piece: not streamed"
    assert "tok/s" in reply["stats"] and "first token" in reply["stats"]
    screenshot(page, "chat-reply")


@needs_engine
def test_seeded_sampled_reply_equals_cpython(bundled, bundled_model):
    """Temperature, top-k, top-p and a repetition penalty with a seed: drawn on the GPU in the page
    (WGSL through the browser's WebGPU) and in CPython (wgpu-py): the same counter-based stream gives
    the same reply, which the app's default settings would not if either side ignored the seed."""
    page = bundled
    form = {
        "temperature": "0.9",
        "top_k": "40",
        "top_p": "0.95",
        "max_tokens": "8",
        "repetition_penalty": "1.3",
        "seed": "1234",
    }
    set_settings(page, form, SYSTEM)
    prompt = "class Config:\n"
    reply = send_and_wait(page, prompt)
    assert reply["state"] == "done"
    settings = parse_form(form)
    assert reply["text"] == cpython_turn(bundled_model["path"], SYSTEM, [], prompt, settings)
    other = cpython_turn(bundled_model["path"], SYSTEM, [], prompt, {**settings, "seed": 99})
    greedy = cpython_turn(bundled_model["path"], SYSTEM, [], prompt, parse_form(GREEDY_FORM))
    assert reply["text"] != other or reply["text"] != greedy  # the draw mattered


@needs_engine
def test_second_turn_uses_the_history(bundled, bundled_model):
    page = bundled
    set_settings(page, GREEDY_FORM, SYSTEM)
    settings = parse_form(GREEDY_FORM)
    first = send_and_wait(page, "import os\n")
    second = send_and_wait(page, "\ndef main():\n")
    assert first["text"] == cpython_turn(bundled_model["path"], SYSTEM, [], "import os\n", settings)
    history = [{"role": "user", "content": "import os\n"}, {"role": "assistant", "content": first["text"]}]
    assert second["text"] == cpython_turn(bundled_model["path"], SYSTEM, history, "\ndef main():\n", settings)
    # the reference without the history differs, so the equality above shows the history was used
    assert second["text"] != cpython_turn(bundled_model["path"], SYSTEM, [], "\ndef main():\n", settings)


@needs_engine
@pytest.mark.alone  # pieces in flight at the click: see test_long_page_session.py
def test_stop_ends_the_reply_within_a_token(bundled):
    page = bundled
    set_settings(page, {**GREEDY_FORM, "max_tokens": "600"}, SYSTEM)
    page.fill("#prompt", "Write a very long text.")
    page.press("#prompt", "Enter")
    page.wait_for_function(
        """() => { const t = document.querySelector('.msg.assistant .text');
        return t && Number(t.dataset.pieces || 0) >= 2; }""",
        timeout=300_000,
    )
    at_click = page.evaluate("""() => { const t = document.querySelector('.msg.assistant .text');
        document.getElementById('stop').click(); return Number(t.dataset.pieces); }""")
    page.wait_for_function("() => document.querySelector('.msg.assistant .text').dataset.state !== 'streaming'")
    reply = last_reply(page)
    assert reply["state"] == "aborted"
    assert reply["pieces"] - at_click <= 2, f"{reply['pieces'] - at_click} pieces arrived after Stop"
    assert "stopped" in reply["stats"]
    assert page.is_enabled("#prompt")  # usable again
