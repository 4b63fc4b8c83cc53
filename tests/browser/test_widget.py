"""The widgets (static/widget/, web/page/widget.py) and the page author's API (web/page/api.py):
the demo page; a foreign page with its own styles embedding widgets (host styles untouched, no
service worker, requests as the README lists them); the README's API example, run as written."""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
from browser_helpers import LOCAL_PREFIXES, _reference_thread, engine_importable, needs_engine, screenshot

from bitnet_web.web.shared.progress import format_bytes
from bitnet_web.web.shared.settings import DEFAULTS, greedy

pytestmark = pytest.mark.browser

README = Path(__file__).resolve().parents[2] / "README.md"
CODE = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'
WIDGET_STATES = "['ready', 'error', 'download', 'unsupported']"


def _cpython(path: Path, how: str, what, settings: dict) -> str:
    """The CPython engine's output for the same request (greedy settings: deterministic)."""
    from browser_helpers import _cpython_engine

    from bitnet_web.text.sampler import SamplerSettings
    from bitnet_web.web.shared.settings import to_engine_settings

    def run() -> str:
        engine = _cpython_engine(str(path))
        engine.reset()
        extra = {"messages": what} if how == "chat" else {"prompt": what}
        return "".join(
            engine.generate(
                settings=to_engine_settings(settings, SamplerSettings), max_tokens=int(settings["max_tokens"]), **extra
            )
        )

    return _reference_thread.submit(run).result()


def _wait_state(page, selector: str, states: str = WIDGET_STATES, timeout: float = 300_000) -> str:
    page.wait_for_function(
        f"() => {states}.includes(document.querySelector({selector!r})?.dataset.state)", timeout=timeout
    )
    return page.get_attribute(selector, "data-state")


def _readme_block(marker: str) -> str:
    """The text between <!-- marker --> and <!-- /marker --> in README.md."""
    text = README.read_text()
    m = re.search(rf"<!-- {marker} -->\n(.*?)<!-- /{marker} -->", text, re.S)
    assert m, f"README.md has no <!-- {marker} --> block"
    return m.group(1)


def _readme_example() -> str:
    """The API example's HTML, exactly as the README shows it (its only code block in the marked part)."""
    m = re.search(r"```html\n(.*?)```", _readme_block("api-example"), re.S)
    assert m, "the README's api-example block has no ```html code"
    return m.group(1)


# ------------------------------------------------------------------------------------------------
# The demo page
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo(browser, site):
    context = browser.new_context(viewport={"width": 1000, "height": 1000})
    page = context.new_page()
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    page.set_default_timeout(120_000)
    page.goto(site.url + "widget/")
    _wait_state(page, "#code")
    _wait_state(page, "#tldr")
    yield page
    context.close()
    assert outside == [], f"the widgets requested URLs outside 127.0.0.1: {outside}"


def test_demo_page_has_landmarks_and_both_widgets(demo):
    assert demo.locator("main").count() == 1
    outside = demo.evaluate(
        "() => [...document.body.children].filter(e => !['HEADER', 'MAIN', 'SCRIPT', 'PY-SCRIPT'].includes(e.tagName)"
        " && e.offsetParent !== null && e.textContent.trim()).map(e => e.tagName)"
    )
    assert outside == [], f"visible content outside the landmarks: {outside}"
    assert "mount_code" in demo.inner_text("#snippet") and "mount_tldr" in demo.inner_text("#snippet")


def test_tldr_names_its_chat_model_and_offers_the_download(demo, dist_dir):
    models = json.loads((dist_dir / "models" / "models.json").read_text())
    chat = next(m for m in models["models"] if m["id"] == "bitnet-b1.58-2b-4t")
    box = demo.locator("#tldr")
    if not engine_importable():
        assert box.get_attribute("data-state") == "error"
        return
    assert box.get_attribute("data-state") == "download", box.inner_text()
    assert chat["name"] in box.locator("[data-role=model]").text_content()
    button = box.locator("[data-role=download]")
    assert button.is_visible() and not button.is_disabled()
    assert button.text_content() == f"Download {format_bytes(chat['size_hint'])}", button.text_content()
    assert button.text_content().endswith(" GB")
    notice = box.locator("[data-role=notice]").text_content()
    assert "not in this browser yet" in notice and "huggingface.co" in notice
    assert box.locator("button", has_text="Summarize").is_disabled()
    screenshot(demo, "widget")


@needs_engine
def test_code_widget_streams_the_engines_completion_and_stops(demo, bundled_model):
    box = demo.locator("#code")
    assert box.get_attribute("data-state") == "ready", box.inner_text()
    assert bundled_model["name"] in box.locator("[data-role=model]").text_content()
    assert box.locator("textarea").input_value() == CODE
    box.locator("select").select_option("16")
    box.locator("button", has_text="Complete").click()
    _wait_state(demo, "#code", "['done', 'error']")
    completion = box.locator("[data-role=completion]").text_content()
    assert completion == _cpython(bundled_model["path"], "complete", CODE, greedy(16))
    assert completion.strip()
    assert box.locator("[data-role=output]").text_content() == CODE + completion
    assert "tok/s" in box.locator("[data-role=stats]").text_content()
    screenshot(demo, "widget-code-completion")

    box.locator("button", has_text="Accept").click()
    assert box.locator("textarea").input_value() == CODE + completion

    box.locator("select").select_option("256")
    box.locator("button", has_text="Complete").click()
    demo.wait_for_function(
        "() => document.querySelector('#code').shadowRoot.querySelector('[data-role=completion]')?.textContent.length"
    )
    box.locator("button", has_text="Stop").click()
    _wait_state(demo, "#code", "['done', 'error']")
    assert box.locator("[data-role=status]").text_content() == "Stopped."
    assert box.locator("button", has_text="Complete").is_enabled()


def test_typing_into_a_widget_warms_the_gpu_up(demo):
    """Typing into a widget asks the engine worker to raise the GPU's clocks before its request
    (EngineClient.typing): declined on this CPU adapter, with the reason; with ?warmup=1, run."""
    box = demo.locator("#code")
    textarea = box.locator("textarea")
    warm_up = "() => document.querySelector('#code').dataset.warmUp"
    demo.wait_for_timeout(1100)  # a second after the last reply
    textarea.type("x")
    demo.wait_for_function(f"() => ({warm_up})() === 'a CPU adapter has no clocks to raise'")
    demo.evaluate("() => history.replaceState(null, '', '?warmup=1')")
    try:
        demo.wait_for_timeout(1100)
        textarea.type("y")
        demo.wait_for_function(f"() => ({warm_up})() === 'ran'")
    finally:
        demo.evaluate("() => history.replaceState(null, '', location.pathname)")
        textarea.fill(CODE)


# ------------------------------------------------------------------------------------------------
# A foreign page embedding widgets
# ------------------------------------------------------------------------------------------------

FOREIGN_STYLE = """
* { box-sizing: content-box; letter-spacing: 0.5px; }
body { font: 17px/1.7 Georgia, serif; color: rgb(40, 20, 10); background: rgb(250, 245, 230); margin: 30px; }
button { background: rgb(200, 0, 0); color: rgb(255, 255, 0); border: 3px dotted black; padding: 7px; }
input, textarea, select { border: 2px solid rgb(0, 128, 0); font-family: monospace; }
label { font-style: italic; display: inline; }
p { margin: 5px 0; }
"""
HOST_PROBES = ("body", "h1", "p", "#host-button", "#host-input", "label")
STYLE_KEYS = (
    "font-family",
    "font-size",
    "line-height",
    "color",
    "background-color",
    "margin-top",
    "padding-top",
    "border-top-style",
    "border-top-width",
    "box-sizing",
    "display",
    "letter-spacing",
    "font-style",
)


def _foreign_page(embed: str) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>A foreign page</title>
<style>{FOREIGN_STYLE}</style>
</head><body>
<h1>Someone else's page</h1>
<p>Its own paragraph, <label for="host-input">its label</label> <input id="host-input"> and
<button id="host-button" type="button">its button</button>.</p>
{embed}
</body></html>
"""


def _computed(page) -> dict[str, dict[str, str]]:
    return page.evaluate(
        """([probes, keys]) => Object.fromEntries(probes.map(sel => {
             const s = getComputedStyle(document.querySelector(sel));
             return [sel, Object.fromEntries(keys.map(k => [k, s.getPropertyValue(k)]))];
           }))""",
        [list(HOST_PROBES), list(STYLE_KEYS)],
    )


def _embed_requests() -> list[str]:
    """The README's list of what an embed loads: every `path` (globs allowed) in its embed-requests block."""
    return re.findall(r"`([^`]+)`", _readme_block("embed-requests"))


@pytest.fixture(scope="module")
def foreign(browser, site, test_files, bundled_model):
    snippet = _readme_block("embed-snippet")
    snippet = re.search(r"```html\n(.*?)```", snippet, re.S).group(1).replace("/bitnet/", "/")
    # The README's embed, plus a TL;DR box pointed at the bundled completion-only model (refused).
    snippet = snippet.replace(
        'mount_code("#code", root="/")',
        f'mount_code("#code", root="/")\nmount_tldr("#tldr", root="/", model={bundled_model["id"]!r})',
    ).replace("import mount_code", "import mount_code, mount_tldr")
    snippet = snippet.replace('<div id="code">', '<div id="tldr"></div>\n<div id="code">')
    assert "mount_tldr" in snippet, "the README's embed snippet changed shape: update this test"
    (test_files / "foreign.html").write_text(_foreign_page(snippet))
    (test_files / "foreign-plain.html").write_text(_foreign_page(""))
    context = browser.new_context(viewport={"width": 900, "height": 1100})
    page = context.new_page()
    page.set_default_timeout(120_000)
    page.goto(site.url + "_test/foreign-plain.html")
    plain = _computed(page)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(site.url + "_test/foreign.html")
    _wait_state(page, "#code")
    _wait_state(page, "#tldr")
    yield {"page": page, "plain": plain, "requests": requests, "site": site}
    context.close()


def test_embedding_leaves_the_host_pages_styles_alone(foreign):
    page = foreign["page"]
    assert _computed(page) == foreign["plain"]
    # and the host's styles do not reach inside: the widget's buttons keep their own look
    inner = page.evaluate(
        "() => getComputedStyle(document.querySelector('#code').shadowRoot.querySelector('button')).backgroundColor"
    )
    assert inner != "rgb(200, 0, 0)"
    assert page.evaluate("() => document.styleSheets.length") == 1  # the host's own <style> only
    screenshot(page, "widget-embedded-foreign-page")


def test_embedding_registers_no_service_worker(foreign):
    page = foreign["page"]
    assert page.evaluate("async () => (await navigator.serviceWorker.getRegistrations()).length") == 0
    assert page.evaluate("() => navigator.serviceWorker.controller") is None
    assert not [u for u in foreign["requests"] if u.endswith("/sw.js")]


def test_embed_requests_match_the_readme(foreign):
    root = foreign["site"].url
    seen = sorted(
        {u[len(root) :].split("?")[0] for u in foreign["requests"] if u.startswith(root)} - {"_test/foreign.html"}
    )
    others = [u for u in foreign["requests"] if not u.startswith(root) and not u.startswith(("data:", "blob:"))]
    assert others == []
    listed = _embed_requests()
    unlisted = [p for p in seen if not any(fnmatch.fnmatchcase(p, pattern) for pattern in listed)]
    unused = [pattern for pattern in listed if not any(fnmatch.fnmatchcase(p, pattern) for p in seen)]
    assert unlisted == [], f"the embed loaded files the README does not list: {unlisted} (all: {seen})"
    assert unused == [], f"the README lists files the embed did not load: {unused} (all: {seen})"


@needs_engine
def test_tldr_refuses_a_completion_only_model_with_the_reason(foreign, bundled_model):
    page = foreign["page"]
    box = page.locator("#tldr")
    assert box.get_attribute("data-state") == "unsupported", box.inner_text()
    text = box.locator("[data-role=output]").text_content()
    assert "completion-only" in text and "chat template" in text and "2B-4T" in text
    assert bundled_model["name"] in box.locator("[data-role=model]").text_content()
    assert box.locator("button", has_text="Summarize").is_disabled()
    assert page.get_attribute("#code", "data-state") == "ready"  # the same model serves the code box


# ------------------------------------------------------------------------------------------------
# The README's API example
# ------------------------------------------------------------------------------------------------


@needs_engine
def test_readme_api_example_runs_as_written(browser, site, test_files, bundled_model):
    example = _readme_example()
    assert "/bitnet/" in example
    # The one change: the README serves dist/ at /bitnet/, the test server at /.
    (test_files / "api-example.html").write_text(
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>API</title></head><body>\n"
        f"{example.replace('/bitnet/', '/')}</body></html>"
    )
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(site.url + "_test/api-example.html")
    try:
        page.wait_for_function(
            "() => document.getElementById('out').dataset.done === '1' || document.querySelector('.py-error')",
            timeout=400_000,
        )
    finally:
        print("page text:", page.inner_text("body"), errors)
    out = page.inner_text("#out")
    example_messages = [{"role": "user", "content": "def fibonacci(n):"}]
    assert '"content": "def fibonacci(n):"' in example and "max_tokens=24" in example
    reply = _cpython(bundled_model["path"], "chat", example_messages, {**DEFAULTS, "temperature": 0, "max_tokens": 24})
    assert reply.strip()
    head, _, rest = out.partition("\n")
    assert head.endswith(" (completion):") and len(head) > len(" (completion):"), out
    assert re.fullmatch(re.escape(reply) + r"\n\[(max_tokens|eos|stop_string)\]", rest), out
    assert errors == []
    context.close()
