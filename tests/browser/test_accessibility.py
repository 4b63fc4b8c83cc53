"""Accessibility as axe-core (build.py's AXE_CORE pin, fetched for the tests only) finds it: the chat
page with the bundled model loaded and every panel open, the widget demo page, and a foreign page
embedding the widgets. No violation of impact serious or critical is allowed; moderate and minor
ones are printed.

axe.min.js is served from /_test/ (same origin, so the pages' script-src 'self' admits it) and
added to each page by the test: dist/ does not contain it and the app never loads it."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from browser_helpers import needs_engine, screenshot
from site_server import build
from test_widget import _foreign_page, _wait_state

pytestmark = pytest.mark.browser

BLOCKING = ("serious", "critical")
# WCAG 2.x A and AA plus axe's best practices (landmarks, headings, regions)
TAGS = ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "wcag22aa", "best-practice"]
# A target inside a shadow root is a list of selectors, host first: written "host >>> inner".
_RUN = """async (tags) => {
  // every result type in full (resultTypes would cut passes to one node each: no coverage left)
  const r = await axe.run(document, {runOnly: {type: "tag", values: tags}});
  const where = (n) => n.target.map((t) => [].concat(t).join(" >>> ")).join(" ");
  const listed = (v) => ({id: v.id, impact: v.impact, help: v.help,
    nodes: v.nodes.map((n) => ({target: where(n), summary: n.failureSummary || ""}))});
  return {
    violations: r.violations.map(listed),
    incomplete: r.incomplete.map(listed),
    checked: [...new Set([...r.passes, ...r.violations].flatMap((v) => v.nodes.map(where)))],
  };
}"""


@pytest.fixture(scope="module")
def axe_url(site, test_files) -> str:
    shutil.copyfile(build.axe_script(), test_files / "axe.min.js")
    return site.url + "_test/axe.min.js"


def describe(violations: list[dict]) -> str:
    """One line a violation, then one a node: rule id, impact, what it asks, target selector, why."""
    lines = []
    for v in violations:
        lines.append(f"{v['id']} ({v['impact']}): {v['help']}")
        for n in v["nodes"]:
            lines.append(f"    {n['target']}: {' '.join(n['summary'].split())}")
    return "\n".join(lines)


def check(page, axe_url: str, where: str) -> list[str]:
    """Run axe on the page as it is; fail on serious/critical violations, print the others.
    Returns the targets axe checked (passed or not)."""
    if not page.evaluate("() => typeof axe !== 'undefined'"):
        page.add_script_tag(url=axe_url)
    found = page.evaluate(_RUN, TAGS)
    violations = found["violations"]
    blocking = [v for v in violations if v["impact"] in BLOCKING]
    others = [v for v in violations if v["impact"] not in BLOCKING]
    if others:
        print(f"axe on {where}, moderate/minor:\n{describe(others)}")
    if found["incomplete"]:  # what axe could not decide (a contrast over an image, ...): for people to look at
        print(f"axe on {where}, to review by hand:\n{describe(found['incomplete'])}")
    assert not blocking, f"axe on {where}: serious/critical violations:\n{describe(blocking)}"
    return found["checked"]


def inside_widgets(checked: list[str]) -> set[str]:
    """The widget hosts whose shadow roots axe looked into."""
    return {t.split(" >>> ")[0] for t in checked if " >>> " in t}


def test_axe_is_for_the_tests_only(dist_dir):
    shipped = [p.relative_to(dist_dir).as_posix() for p in dist_dir.rglob("*") if p.is_file()]
    assert not [p for p in shipped if "axe" in p.rsplit("/", 1)[-1]], shipped
    pages = [p for p in shipped if p.endswith((".html", ".js")) and not p.startswith("pyodide/")]
    assert not [p for p in pages if "axe" in (dist_dir / p).read_text(errors="replace")]


@needs_engine
def test_chat_page_with_the_bundled_model_and_its_panels(bundled, axe_url):
    page = bundled
    page.evaluate("() => { for (const d of document.querySelectorAll('details')) d.open = false; }")
    check(page, axe_url, "the chat page, panels closed")
    page.evaluate("() => { for (const d of document.querySelectorAll('details')) d.open = true; }")
    page.wait_for_function("() => document.querySelectorAll('#settings-fields input').length > 0")
    check(page, axe_url, "the chat page, every panel open")
    page.select_option("#model-select", "custom")
    check(page, axe_url, "the chat page, Custom URL chosen")
    page.select_option("#model-select", page.get_attribute("#app", "data-key"))
    screenshot(page, "a11y-chat-panels-open")


@contextlib.contextmanager
def widgets_at(browser, url: str) -> Iterator[Any]:
    """`url` in a fresh browser context, once both its widgets (#code, #tldr) have settled."""
    context = browser.new_context(viewport={"width": 1000, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(120_000)
    try:
        page.goto(url)
        _wait_state(page, "#code")
        _wait_state(page, "#tldr")
        yield page
    finally:
        context.close()


def test_widget_demo_page(browser, site, axe_url):
    with widgets_at(browser, site.url + "widget/") as page:
        assert inside_widgets(check(page, axe_url, "the widget demo page")) == {"#code", "#tldr"}


def test_widgets_on_a_foreign_page(browser, site, test_files, axe_url):
    embed = """<div id="code">def fibonacci(n):</div>
<div id="tldr"></div>
<script type="module" src="/pyscript/core.js"></script>
<script type="py" config='{"interpreter": "/pyodide/pyodide.mjs", "files": {"/bitnet_web.zip": "./*"}}'>
from bitnet_web.web.page.widget import mount_code, mount_tldr
mount_code("#code", root="/")
mount_tldr("#tldr", root="/")
</script>"""
    # the host page's content sits in a <main> of its own (the host's landmarks are the host's affair)
    (test_files / "foreign-a11y.html").write_text(
        _foreign_page(embed).replace("<body>\n", "<body>\n<main>\n").replace("</body>", "</main>\n</body>")
    )
    with widgets_at(browser, site.url + "_test/foreign-a11y.html") as page:
        checked = check(page, axe_url, "a foreign page embedding the widgets")
        assert inside_widgets(checked) == {"#code", "#tldr"}
