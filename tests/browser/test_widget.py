"""The TL;DR widget page (static/widget/): mounts, loads the site's default model, summarizes."""

from __future__ import annotations

import pytest
from browser_helpers import LOCAL_PREFIXES, cpython_summary, engine_importable, needs_engine, screenshot

from bitnet_web.web.shared.settings import greedy

pytestmark = pytest.mark.browser

TEXT = (
    "The city council met on Tuesday to discuss the new bridge. After a long debate, members voted "
    "seven to two to fund the project, which will take three years to build and connect the old "
    "harbour to the northern districts."
)


@pytest.fixture(scope="module")
def widget(browser, site):
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    page.set_default_timeout(120_000)
    page.goto(site.url + "widget/")
    page.wait_for_function(
        "() => ['ready', 'error'].includes(document.getElementById('tldr').dataset.state)", timeout=240_000
    )
    yield page
    context.close()
    assert outside == [], f"the widget requested URLs outside 127.0.0.1: {outside}"


def test_widget_mounts_with_its_controls(widget):
    box = widget.locator("#tldr")
    assert box.locator("textarea").count() == 1
    options = box.locator("select option").all_text_contents()
    assert {"32", "64", "128", "256"} <= set(options) and box.locator("select").input_value() == "64"
    assert box.locator("button", has_text="Summarize").count() == 1
    assert "mount_tldr" in widget.inner_text("#snippet")
    state = box.get_attribute("data-state")
    if engine_importable():
        assert state == "ready", widget.inner_text("#tldr")
    else:
        assert state == "error" and "engine" in widget.inner_text("#tldr")
    screenshot(widget, "widget")


@needs_engine
def test_widget_summarizes_with_the_greedy_engine_output(widget, bundled_model):
    box = widget.locator("#tldr")
    box.locator("textarea").fill(TEXT)
    box.locator("select").select_option("16")  # short: SwiftShader decodes slowly
    box.locator("button", has_text="Summarize").click()
    widget.wait_for_function("() => document.getElementById('tldr').dataset.state === 'done'", timeout=300_000)
    summary = box.locator("[data-role=summary]").text_content()
    assert summary == cpython_summary(bundled_model["path"], TEXT.strip(), greedy(16))
    assert summary.strip()
    assert "tok/s" in box.locator("[data-role=stats]").text_content()
    screenshot(widget, "widget-summary")
