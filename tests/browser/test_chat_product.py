"""The chat page as a product (issue 16), with the bundled model (512-token context, completion mode):
a failed or cancelled load keeps the working model, completion mode keeps the most recent text
that fits, a too-long message stays in the box, the status line says the reply's phase and Stop, a
failure and New chat leave no stale status or stats, the Model panel's wording and layout (item 10).

One browser context for the module: each test starts from the state the previous one left.
"""

from __future__ import annotations

import re

import pytest
from browser_helpers import (
    GREEDY_FORM,
    app_state,
    gpu_counts,
    install_gpu_counters,
    last_reply,
    load_custom,
    load_option,
    model_info,
    needs_engine,
    notice,
    screenshot,
    send_and_wait,
    set_settings,
    set_test_hooks,
    start_load,
    wait_for_new_reply,
    wait_settled,
    worker_python,
)

pytestmark = [pytest.mark.browser, needs_engine]

# Python source the bundled model knows; about 3 characters a token in its 4096-entry vocabulary
CODE = (
    "def read_config(path):\n"
    '    """Read a key = value file into a dict."""\n'
    "    result = {}\n"
    "    with open(path) as f:\n"
    "        for line in f:\n"
    "            key, _, value = line.partition('=')\n"
    "            result[key.strip()] = value.strip()\n"
    "    return result\n\n"
)


def usable(page, key: str) -> None:
    """The bundled model is the loaded one and the chat can be used."""
    assert app_state(page)["model"] == "loaded"
    assert page.get_attribute("#app", "data-key") == key
    assert page.is_enabled("#prompt") and page.is_enabled("#load")
    assert model_info(page)["Name"] == "bitnet-pystdlib-27m-i2_s", model_info(page)


def test_failed_loads_keep_the_working_model(bundled, site, bundled_model, test_files):
    page, key = bundled, site.url + bundled_model["url"]
    set_settings(page, {**GREEDY_FORM, "max_tokens": "2"})
    data = bundled_model["path"].read_bytes()
    (test_files / "cut.gguf").write_bytes(data[: len(data) // 2])
    failures = {
        site.url + "_test/missing.gguf": "HTTP 404",
        site.url + "index.html": "HTML",
        site.url + "_test/cut.gguf": "",
        "https://example.com/model.gguf": "example.com is not a host",  # refused before any request
    }
    for url, cause in failures.items():
        assert load_custom(page, url) == "error", url
        n = notice(page)
        assert n["visible"] and cause in n["text"] and "still loaded" in n["text"], (url, n)
        assert re.search(r"[.!?] \([^()]* is still loaded and ready\.\)", n["text"]), n["text"]  # a sentence each
        if cause == "HTTP 404":  # the advice starts with the likely cause, not the network
            assert "Check the URL" in n["text"], n["text"]
        usable(page, key)
        assert "still loaded" in page.text_content("#progress-text")
        assert "still loaded" in page.text_content("#status")
    assert "huggingface.co" in page.text_content("#custom-hosts")
    screenshot(page, "chat-failed-load-keeps-model")
    page.fill("#prompt", "import os\n")
    assert page.is_enabled("#send")
    reply = send_and_wait(page, "import os\n")
    assert reply["state"] == "done" and reply["pieces"] > 0, reply


def test_cancel_in_parse_and_upload_keeps_the_working_model(bundled, site, bundled_model, tiny_model):
    page, key = bundled, site.url + bundled_model["url"]
    set_settings(page, {**GREEDY_FORM, "max_tokens": "2"})
    install_gpu_counters(page)
    alive = gpu_counts(page)["bytes"]
    tiny = site.url + "_test/tiny.gguf"
    # Cancel pressed while the file is parsed (the parse phase is held open by a test hook)
    set_test_hooks(page, parseDelayMs=4000)
    page.select_option("#model-select", "custom")
    page.fill("#custom-url", tiny)
    page.click("#load")
    page.wait_for_selector("#progress[data-phase='parse']", state="attached", timeout=120_000)
    assert "Checking the model file" in page.text_content("#progress-text")
    screenshot(page, "chat-load-parse-phase")
    page.click("#cancel-load")
    page.wait_for_function("() => document.getElementById('app').dataset.load === 'cancelled'", timeout=60_000)
    usable(page, key)
    assert notice(page)["kind"] == "cancelled"
    # Cancel at an upload step: what was uploaded is released, the old model stays
    set_test_hooks(page, cancelAtUploadStep=1)
    assert start_load(page, lambda: page.click("#load")) == "error"
    assert page.get_attribute("#app", "data-load") == "cancelled"
    usable(page, key)
    assert gpu_counts(page)["bytes"] == alive, "a cancelled upload left GPU buffers behind"
    set_test_hooks(page)
    reply = send_and_wait(page, "import sys\n")
    assert reply["state"] == "done" and reply["pieces"] > 0, reply


def test_completion_keeps_the_recent_text_and_notes_cuts(bundled):
    page = bundled
    set_settings(page, {**GREEDY_FORM, "max_tokens": "4"})
    # each turn ~300 tokens: the second no longer fits the 512-token context with the first
    for turn in range(3):
        reply = send_and_wait(page, CODE * 3)
        assert reply["state"] == "done", (turn, reply)
        cut = page.locator(".msg.assistant .text").last.get_attribute("data-cut")
        assert cut in ("max_tokens", "context_full"), cut
        assert "cut" in page.locator(".msg.assistant .text .cut").last.text_content()
    assert "left out to fit the context" in reply["stats"], reply["stats"]
    assert page.locator(".msg.exchange pre.code").count() == 3
    screenshot(page, "chat-completion-trimmed")


def test_typing_warms_the_gpu_up_and_the_reply_is_unchanged(bundled):
    """While the person types, the page asks the worker to raise the GPU's clocks (model/warm_up.py), at
    most once a second and not within a second of a reply: on this CPU adapter the worker declines and
    says why; with ?warmup=1 it runs them, and a reply sent while one runs is the same reply; Settings
    turns them off and on again."""
    page = bundled
    set_settings(page, {**GREEDY_FORM, "max_tokens": "6"})
    prompt = "def main():\n"
    warm_ups = "() => document.getElementById('app').dataset.warmUps"
    page.wait_for_timeout(1100)  # a second after any earlier reply
    reference = send_and_wait(page, prompt)
    page.wait_for_function(
        "() => document.getElementById('app').dataset.warmUp === 'a CPU adapter has no clocks to raise'"
    )
    page.click("#new-chat")
    page.evaluate("() => history.replaceState(null, '', '?autoload=0&warmup=1')")
    try:
        page.wait_for_timeout(1100)
        page.type("#prompt", "def ma")  # six input events well within a second: one warm-up
        page.wait_for_function(f"() => ({warm_ups})() === '1'")
        assert page.get_attribute("#app", "data-warm-up") == "ran"
        page.wait_for_timeout(1100)
        page.type("#prompt", "in")  # a second later: another one, and Enter while it runs
        page.fill("#prompt", prompt)
        page.press("#prompt", "Enter")
        page.wait_for_function(
            "() => { const r = document.querySelectorAll('.msg.assistant .text');"
            " return r.length && r[r.length - 1].dataset.state === 'done'; }",
            timeout=120_000,
        )
        assert last_reply(page)["text"] == reference["text"]
        page.wait_for_function(f"() => ({warm_ups})() === '2'")
        page.type("#prompt", "xy")  # right after a reply the GPU is busy enough: none
        page.wait_for_timeout(1200)
        assert page.get_attribute("#app", "data-warm-ups") == "2"
        page.type("#prompt", "z")  # over a second later: one more
        page.wait_for_function(f"() => ({warm_ups})() === '3'")
        page.evaluate("() => { document.getElementById('settings-panel').open = true; }")
        page.uncheck("#setting-warm-up")  # Settings turns them off
        page.wait_for_timeout(1100)
        page.type("#prompt", "ab")
        page.wait_for_timeout(1200)
        assert page.get_attribute("#app", "data-warm-ups") == "3"
        page.check("#setting-warm-up")
        page.type("#prompt", "c")
        page.wait_for_function(f"() => ({warm_ups})() === '4'")
    finally:
        page.evaluate("() => history.replaceState(null, '', '?autoload=0')")
        page.fill("#prompt", "")
        if not page.is_checked("#setting-warm-up"):
            page.check("#setting-warm-up")


def test_too_long_message_stays_in_the_box(bundled):
    page = bundled
    set_settings(page, {**GREEDY_FORM, "max_tokens": "4"})
    long_text = CODE * 12  # well over 512 tokens on its own
    reply = send_and_wait(page, long_text)
    assert reply["state"] == "error" and "too long" in reply["text"], reply
    assert page.input_value("#prompt") == long_text
    assert page.locator(".msg.user").count() == 0, "a refused message is not shown as sent"
    in_view = page.evaluate("""() => { const r = [...document.querySelectorAll('.msg.assistant .text')].pop();
        const box = document.getElementById('messages').getBoundingClientRect(), b = r.getBoundingClientRect();
        return b.bottom > box.top && b.top < box.bottom; }""")
    assert in_view, "the error bubble is not scrolled into view"
    screenshot(page, "chat-too-long")


def test_stop_and_new_chat_leave_no_stale_status_or_stats(bundled, bundled_model):
    page = bundled
    ready = f"{bundled_model['name']} is ready."
    assert page.text_content("#status") == ready
    page.evaluate(RECORD_TEXTS, ["status"])
    set_settings(page, {**GREEDY_FORM, "max_tokens": "200"})
    n_before = page.locator(".msg.assistant").count()
    page.fill("#prompt", "class Stack:\n")
    page.press("#prompt", "Enter")
    wait_for_new_reply(page, n_before)
    screenshot(page, "chat-writing-status")
    page.click("#stop")
    page.wait_for_function("() => document.getElementById('app').dataset.busy === '0'", timeout=120_000)
    assert last_reply(page)["state"] == "aborted"
    # the status line said each phase of the reply as it came, then the model is ready again
    shown = seen_texts(page, "status", "")
    assert shown == ["Reading the prompt…", "Writing the reply…", "Stopping after the current token…", ready], shown
    assert page.get_attribute("#app", "data-phase") == ""
    # New chat in the middle of a reply: its bubble and its stats go
    page.fill("#prompt", "def main():\n")
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.getElementById('app').dataset.busy === '1'")
    page.click("#new-chat")
    page.wait_for_function("() => document.getElementById('app').dataset.busy === '0'", timeout=120_000)
    page.wait_for_timeout(300)  # the discarded reply's last events have arrived
    assert page.locator(".msg").count() == 0
    assert page.text_content("#stats") == ""
    shown = seen_texts(page, "status", "")[4:]
    assert shown[0] == "Reading the prompt…" and shown[-2:] == ["Stopping the reply of the cleared chat…", ready], shown
    # a reply that fails (a message too long for the context) ends in the ready state too
    set_settings(page, {**GREEDY_FORM, "max_tokens": "1"})
    failed = send_and_wait(page, CODE * 12)
    assert failed["state"] == "error", failed
    assert page.text_content("#status") == ready and page.get_attribute("#app", "data-phase") == ""
    reply = send_and_wait(page, "import re\n")
    assert reply["state"] == "done" and reply["stats"].startswith("1 token,"), reply
    assert page.text_content("#status") == ready and page.get_attribute("#app", "data-phase") == ""


def test_settings_show_defaults_ranges_and_the_field_in_error(bundled):
    page = bundled
    set_settings(page, {**GREEDY_FORM, "seed": "-1"})
    page.fill("#setting-max-tokens", "")
    assert page.get_attribute("#setting-max-tokens", "placeholder") == "256"
    assert page.get_attribute("#setting-seed", "max") == "4294967295"
    page.fill("#prompt", "x = 1\n")
    page.press("#prompt", "Enter")
    # send() runs after the key event returns (asyncio.ensure_future): wait for its verdict
    page.wait_for_function(
        "() => (document.getElementById('settings-error').textContent || '').includes('0 to 4294967295')"
    )
    assert page.get_attribute("#setting-seed", "aria-invalid") == "true"
    assert page.input_value("#prompt") == "x = 1\n", "a message not sent stays in the box"
    assert page.is_disabled("#system-prompt") and "no chat format" in page.text_content("#system-note")
    screenshot(page, "chat-settings-error")
    # correcting the value clears the error as it is typed; the next bad value takes its place
    page.fill("#setting-top-p", "7")
    page.wait_for_function("() => document.getElementById('settings-error').textContent.startsWith('Top-p')")
    assert page.get_attribute("#setting-top-p", "aria-invalid") == "true"
    assert page.get_attribute("#setting-seed", "aria-invalid") is None
    page.fill("#setting-top-p", "1")
    page.fill("#setting-seed", "7")
    page.wait_for_function("() => document.getElementById('settings-error').textContent === ''")
    assert page.get_attribute("#setting-seed", "aria-invalid") is None
    assert page.evaluate("() => document.activeElement.id") == "setting-seed", "the focus stays where one types"
    set_settings(page, GREEDY_FORM)


# every text set (set_text replaces the node's children), even several within one task
RECORD_TEXTS = """(ids) => { window.seenTexts = []; for (const id of ids) {
    new MutationObserver((records) => { for (const r of records) for (const a of r.addedNodes)
        window.seenTexts.push([id, a.textContent]); })
        .observe(document.getElementById(id), {childList: true}); } }"""


def seen_texts(page, node_id: str, start: str) -> list[str]:
    """The texts #node_id showed since record_texts, those starting with `start`, in order."""
    texts = page.evaluate("() => window.seenTexts")
    return [t for i, t in texts if i == node_id and t.startswith(start)]


def test_every_load_phase_shows_its_progress(bundled, site, bundled_model):
    page, key = bundled, site.url + bundled_model["url"]
    page.evaluate(RECORD_TEXTS, ["progress-text"])
    page.select_option("#model-select", key)
    page.click("#load")
    page.wait_for_selector("#progress[data-phase='upload']", state="attached", timeout=300_000)
    screenshot(page, "chat-load-upload-phase")
    assert wait_settled(page) == "loaded" and page.get_attribute("#app", "data-load") == "ok"
    assert seen_texts(page, "progress-text", "Reading from browser storage"), "no progress while reading storage"
    # a load streamed from storage shows the read while it lasts (parsing and uploading keep pace
    # with it), then the upload's last steps; a file read first shows every parse and upload step
    parse = seen_texts(page, "progress-text", "Checking the model file")
    assert all("1 of 1" not in t for t in parse), parse
    upload = seen_texts(page, "progress-text", "Uploading to the GPU")
    parts = [[int(n) for n in t.split("part ")[1].split(" (")[0].split(" of ")] for t in upload]
    steps = [done for done, _ in parts]  # one per layer, then the last (embeddings, head, kernels)
    assert steps and steps == sorted(set(steps)), upload
    assert parts[-1][0] == parts[-1][1] and upload[-1].endswith("(100%)"), upload


def test_a_long_prompt_shows_its_prefill_and_stop_ends_it(bundled, site, bundled_model):
    page, key = bundled, site.url + bundled_model["url"]
    set_settings(page, {**GREEDY_FORM, "max_tokens": "2"})
    # chunks of 16 tokens: the 67-token prompt is read in 5 of them, the ~134-token one in ~9
    worker_python(page, "from bitnet_web.web.worker import main as w\nw._worker.engine_options = {'prefill_chunk': 16}")
    try:
        assert load_option(page, key) == "loaded"
        page.evaluate(RECORD_TEXTS, ["stats"])
        page.fill("#prompt", CODE)
        page.press("#prompt", "Enter")
        page.wait_for_function("() => /Reading the prompt: [0-9]/.test(document.getElementById('stats').textContent)")
        screenshot(page, "chat-prefill-progress")
        page.wait_for_function("() => document.getElementById('app').dataset.busy === '0'", timeout=300_000)
        reply = last_reply(page)
        assert reply["state"] == "done" and reply["pieces"] > 0, reply
        read = seen_texts(page, "stats", "Reading the prompt: ")
        counts = [int(t.split(": ")[1].split(" of ")[0].replace(",", "")) for t in read]
        total = int(read[0].split(" of ")[1].split(" ")[0].replace(",", ""))
        assert len(counts) >= 3 and counts == sorted(counts) and counts[0] == 16 and counts[-1] < total, read
        assert all(c % 16 == 0 for c in counts), read
        # Stop while the prompt is read: the turn ends after the chunk in progress, nothing generated
        page.click("#new-chat")
        page.evaluate(RECORD_TEXTS, ["stats"])
        page.fill("#prompt", CODE * 2)
        page.press("#prompt", "Enter")
        page.wait_for_function("() => /Reading the prompt: [0-9]/.test(document.getElementById('stats').textContent)")
        page.click("#stop")
        assert "Stopping after this part of the prompt" in page.text_content("#status")
        page.wait_for_function("() => document.getElementById('app').dataset.busy === '0'", timeout=300_000)
        reply = last_reply(page)
        assert reply["state"] == "aborted" and reply["pieces"] == 0, reply
        assert "stopped while reading the prompt" in reply["stats"], reply
        read = seen_texts(page, "stats", "Reading the prompt: ")
        stopped_at = int(read[-1].split(": ")[1].split(" of ")[0].replace(",", ""))
        assert stopped_at < total - 16, f"the whole prompt was read after Stop: {read}"
        assert "Stopping" not in page.text_content("#status")
        screenshot(page, "chat-prefill-stopped")
        reply = send_and_wait(page, "import os\n")
        assert reply["state"] == "done" and reply["pieces"] > 0, reply
    finally:
        worker_python(page, "from bitnet_web.web.worker import main as w\nw._worker.engine_options = {}")
    assert load_option(page, key) == "loaded"


# (left, top, right, bottom) of an element, and what a focused control's ring looks like
RECT = "(n) => { const r = n.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; }"
FOCUS_RING = """(id) => { const n = document.getElementById(id), s = getComputedStyle(n);
    let a = n.parentElement;  // the ring is drawn outside the control, over its container's background
    while (getComputedStyle(a).backgroundColor === 'rgba(0, 0, 0, 0)') a = a.parentElement;
    return {active: document.activeElement.id, visible: n.matches(':focus-visible'), width: s.outlineWidth,
            style: s.outlineStyle, color: s.outlineColor, around: getComputedStyle(a).backgroundColor}; }"""
# every option's text as the closed list draws it: its width in the select's font, and the room for it
OPTION_FIT = """() => { const sel = document.getElementById('model-select'), s = getComputedStyle(sel);
    const ctx = document.createElement('canvas').getContext('2d'); ctx.font = s.font;
    const room = sel.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight) - 20;  // 20: the arrow
    return [...sel.options].map(o => [o.textContent, ctx.measureText(o.textContent).width, room]); }"""


def contrast(css_a: str, css_b: str) -> float:
    """WCAG contrast ratio of two computed `rgb(...)` colors."""

    def luminance(css: str) -> float:
        channels = [int(v) / 255 for v in re.findall(r"\d+", css)[:3]]
        lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
        return 0.2126 * lin[0] + 0.7152 * lin[1] + 0.0722 * lin[2]

    hi, lo = sorted((luminance(css_a), luminance(css_b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_model_panel_wording_and_layout(bundled, site, bundled_model):
    """Issue 16 item 10. Last in the module: the fixture, or the test before, has just loaded the model."""
    from bitnet_web.web.shared.progress import loaded_from

    page, key = bundled, site.url + bundled_model["url"]
    # where the model came from, as the worker reported it (not "from the network" for a stored copy)
    assert page.get_attribute("#app", "data-load") == "ok"
    source = page.get_attribute("#app", "data-source")
    said = page.text_content("#progress-text")
    assert said in (loaded_from(source, True), loaded_from(source, False)), (source, said)
    # each model's description is one sentence per point, not "a: b: c"
    for value in page.evaluate("() => [...document.getElementById('model-select').options].map(o => o.value)"):
        page.select_option("#model-select", value)
        desc = page.text_content("#model-desc")
        assert desc.count(":") <= 1, (value, desc)
    # the LOSSY checkbox sits right before its label's text, on its first line
    box = page.eval_on_selector("#lossy-ternarize", RECT)
    text = page.eval_on_selector("#lossy-ternarize + span", RECT)
    assert 0 <= text[0] - box[2] <= 12 and abs(text[1] - box[1]) <= 8, (box, text)
    screenshot(page, "chat-custom-url-row")
    page.select_option("#model-select", key)
    assert page.text_content("#model-desc") == bundled_model["description"]
    # no model's name is cut in the closed list, on a wide screen and on a phone
    for width in (1280, 390):
        page.set_viewport_size({"width": width, "height": 860})
        for label, need, room in page.evaluate(OPTION_FIT):
            assert need <= room, f"{label!r} needs {need:.0f}px, the list shows {room:.0f}px at {width}px"
    page.set_viewport_size({"width": 1280, "height": 860})
    # a control focused from the keyboard has a ring that stands out from what surrounds it
    for before, control in (("#model-select", "load"), ("#prompt", "send")):
        page.focus(before)
        page.keyboard.press("Tab")
        ring = page.evaluate(FOCUS_RING, control)
        assert ring["active"] == control and ring["visible"], ring
        assert ring["style"] == "solid" and float(ring["width"].rstrip("px")) >= 2, ring
        assert contrast(ring["color"], ring["around"]) >= 3, ring
    screenshot(page, "chat-focus-ring")
