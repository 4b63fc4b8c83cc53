"""The egress check itself: a page's and a worker's requests for another host reach the app's recorder
(which fails the session), never the recorder of Chromium's own requests (which is only reported)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

PROBE_HOST = "egress-probe.example"

_PROBE = """async (host) => {
  await fetch(`http://page.${host}/p`).catch(() => 0);
  const code = `fetch("http://worker.${host}/w").catch(() => 0).then(() => postMessage(1))`;
  const worker = new Worker(URL.createObjectURL(new Blob([code])));
  await new Promise((ok) => { worker.onmessage = ok; });
  worker.terminate();
}"""


def test_requests_of_pages_and_workers_reach_the_apps_recorder(browser, egress, browser_egress):
    context = browser.new_context()  # as every test's: conftest routes its proxy to `egress`
    try:
        page = context.new_page()
        page.set_content("<p>egress probe</p>")
        page.evaluate(_PROBE, PROBE_HOST)
    finally:
        context.close()
    with egress.lock:  # the probe's own lines are expected here: taken out, so only a leak fails the session
        probes = [line for line in egress.seen if PROBE_HOST in line]
        egress.seen[:] = [line for line in egress.seen if PROBE_HOST not in line]
    assert sorted(probes) == [f"GET http://page.{PROBE_HOST}/p HTTP/1.1", f"GET http://worker.{PROBE_HOST}/w HTTP/1.1"]
    assert not [line for line in browser_egress.lines() if PROBE_HOST in line]
