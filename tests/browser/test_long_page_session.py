"""A long chat in the page: no Pyodide proxy or GPU buffer accumulates per turn, and Stop always
ends the reply (mid-decode and during prefill).

Counted before and after N turns, after a warm-up (first-use allocations are not leaks):
- PyProxies and JS references held by Python, in the page's interpreter (PyScript, main thread)
  and in the engine worker's: jsutil.proxy_census (Pyodide's allocation tracing; see the comment
  there for why the count is sound);
- GPU buffers: the app's own count (device.live_buffers) and an independent one from wrapping the
  worker's GPUDevice.createBuffer / GPUBuffer.destroy before the model was loaded.
"""

from __future__ import annotations

import json

import pytest
from browser_helpers import (
    GREEDY_FORM,
    SYSTEM,
    app_page,
    engine_worker,
    gpu_counts,
    install_gpu_counters,
    last_reply,
    load_custom,
    needs_engine,
    notice,
    send_and_wait,
    set_settings,
    wait_for_new_reply,
)

# alone: "Stop ends it" counts the pieces the page receives after the click, which grows when another
# test's Chromium takes the page's CPU (build.py runs the other browser tests two at a time)
pytestmark = [pytest.mark.browser, pytest.mark.alone, needs_engine]

TURNS = 40
# Positive control: a kept PyProxy and a kept JS object must show up in the census.
HOLD = (
    "import js\nfrom pyodide.ffi import create_proxy\nimport bitnet_web.web.shared.jsutil as j\n"
    "j._census_control = (create_proxy(lambda: None), js.Object.new())"
)
RELEASE = "import bitnet_web.web.shared.jsutil as j\nj._census_control[0].destroy()\ndel j._census_control"
CENSUS = "import json\nfrom bitnet_web.web.shared.jsutil import proxy_census\njson.dumps(proxy_census())"
START_CENSUS = "from bitnet_web.web.shared.jsutil import start_proxy_census\nstart_proxy_census()"
# The worker's recorded-program cache holds one JS array per program, up to its capacity (64): it may
# still be filling late in the session, so its entries are counted apart from the other references.
PROGRAMS = (
    "from bitnet_web.web.worker import main as w\n"
    "p = w._worker.engine.device.__dict__.get('_recorded_programs')\n"
    "str(0 if p is None else len(p.entries))"
)
GPU_STATE = (
    "import json\nfrom bitnet_web.web.worker import main as w\nd = w._worker.engine.device\n"
    "json.dumps({'live_buffers': d.live_buffers, 'bytes': d.bytes_allocated})"
)


@pytest.fixture(scope="module")
def app(browser, site, tiny_model, test_files):
    (test_files / "long-tiny.gguf").write_bytes(tiny_model)
    with app_page(browser, site) as page:
        install_gpu_counters(page)
        assert load_custom(page, site.url + "_test/long-tiny.gguf") == "loaded", notice(page)
        yield page


def in_page(page, code: str) -> str:
    return page.evaluate("(code) => window.bitnetPyodide.runPython(code)", code)


def in_worker(page, code: str) -> str:
    return engine_worker(page).evaluate("(code) => self.pyodide.runPython(code)", code)


def census(page) -> dict[str, dict[str, int]]:
    return {
        "page": json.loads(in_page(page, CENSUS)),
        "worker": {**json.loads(in_worker(page, CENSUS)), "programs": int(in_worker(page, PROGRAMS))},
        "gpu_app": json.loads(in_worker(page, GPU_STATE)),
        "gpu_js": gpu_counts(page),
    }


def test_the_census_sees_a_kept_proxy(app):
    for run in (in_page, in_worker):
        run(app, START_CENSUS)
        base = json.loads(run(app, CENSUS))
        run(app, HOLD)
        held = json.loads(run(app, CENSUS))
        run(app, RELEASE)
        # two JS references: the JS object, and the PyProxy itself as Python holds it (a JsProxy of it)
        assert held == {"pyproxies": base["pyproxies"] + 1, "js_refs": base["js_refs"] + 2}, (base, held)
        assert json.loads(run(app, CENSUS)) == base


def stop_reply(page, when: str) -> dict:
    """Send a request for a long reply and press Stop `when` ("prefill": at once; "decode": after
    the first piece); returns the reply and how many pieces arrived after the click."""
    set_settings(page, {**GREEDY_FORM, "max_tokens": "200"})
    n_before = page.locator(".msg.assistant").count()
    page.fill("#prompt", f"stop me during {when}")
    page.press("#prompt", "Enter")
    if when == "decode":
        wait_for_new_reply(page, n_before)
    else:  # data-busy is "0" again before a reply's state leaves "streaming": this is the new reply's
        page.wait_for_function("() => document.getElementById('app').dataset.busy === '1'")
    at_click = page.evaluate("""() => { const r = document.querySelectorAll('.msg.assistant .text');
        const stop = document.getElementById('stop'); const enabled = !stop.disabled; stop.click();
        return [enabled, r.length, Number(r[r.length - 1].dataset.pieces || 0)]; }""")
    assert at_click[:2] == [True, n_before + 1], f"Stop was pressed while not enabled or before the reply: {at_click}"
    at_click = at_click[2]
    page.wait_for_function(
        """() => { const r = document.querySelectorAll('.msg.assistant .text');
        return r[r.length - 1].dataset.state !== 'streaming'; }""",
        timeout=60_000,
    )
    reply = last_reply(page)
    return {**reply, "after_stop": reply["pieces"] - at_click}


# The page's engine client posts a chat request and, in the same JS task, a Stop: both messages are
# queued in the worker before the request's task starts (the window in which a Stop used to be lost:
# the worker and the engine cleared their abort flags when the generation began).
STOP_RIGHT_BEHIND = """
import asyncio, json
from bitnet_web.web.page import chat_app
client = chat_app._app.client
queue = asyncio.Queue()
req = client.send("chat", messages=[{"role": "user", "content": "never answer this"}],
                  settings={"temperature": 0, "top_k": 1, "max_tokens": 200})
client.abort()
client._queues[req] = queue
pieces = 0
while True:
    msg = await queue.get()
    if msg["event"] == "piece":
        pieces += 1
    elif msg["event"] in ("done", "error"):
        break
del client._queues[req]
json.dumps({"event": msg["event"], "reason": msg.get("reason"), "pieces": pieces,
            "stop_reason": (msg.get("stats") or {}).get("stop_reason")})
"""


def test_a_stop_sent_right_behind_the_request_ends_it(app):
    for _ in range(3):
        outcome = json.loads(app.evaluate("(code) => window.bitnetPyodide.runPythonAsync(code)", STOP_RIGHT_BEHIND))
        assert outcome["event"] == "done" and outcome["reason"] == "aborted", outcome
        assert outcome["stop_reason"] == "aborted" and outcome["pieces"] <= 2, outcome


def run_turns(page, first: int, count: int, stops: list[dict]) -> None:
    """`count` turns of 1-2 token replies; every fifth one a long reply stopped (alternately during
    prefill and after its first piece)."""
    for turn in range(first, first + count):
        if turn % 5 == 4:
            stops.append(stop_reply(page, "prefill" if turn % 10 == 4 else "decode"))
            set_settings(page, {**GREEDY_FORM, "max_tokens": "2"})
        else:
            reply = send_and_wait(page, f"turn {turn}: say something")
            assert reply["state"] == "done", reply
            assert 1 <= reply["pieces"] <= 2


def test_turns_leave_no_proxies_or_buffers_behind_and_stop_always_ends(app):
    """Three censuses: after a warm-up, after half the turns, after all of them. Bounded caches (the
    browser backend keeps a few recorded GPU programs, each a JS array) may still fill during the
    first half; in the second half nothing may grow. A leak of one reference every few turns would."""
    page = app
    set_settings(page, {**GREEDY_FORM, "max_tokens": "2"}, SYSTEM)
    in_page(page, START_CENSUS)
    in_worker(page, START_CENSUS)
    stops: list[dict] = []
    run_turns(page, 0, 5, stops)  # warm-up: first-use allocations, the Stop path included
    censuses = [census(page)]
    for half in (1, 2):
        run_turns(page, 5 + (half - 1) * TURNS // 2, TURNS // 2, stops)
        censuses.append(census(page))
    warm, middle, end = censuses
    print("censuses after the warm-up, after half the turns, at the end:", *censuses, sep="\n")

    assert len(stops) == 1 + TURNS // 5
    for stop in stops:
        assert stop["state"] == "aborted", stop
        assert stop["after_stop"] <= 2, f"{stop['after_stop']} pieces arrived after Stop"
        assert "stopped" in stop["stats"]
    assert page.is_enabled("#prompt") and page.is_disabled("#stop")
    for side in ("page", "worker"):
        assert end[side]["pyproxies"] <= warm[side]["pyproxies"], f"{side}: PyProxies leaked"
        refs = [c[side]["js_refs"] - c[side].get("programs", 0) for c in (middle, end)]
        assert refs[1] <= refs[0], f"{side}: JS references leaked (other than cached programs): {refs}"
    assert end["gpu_app"] == warm["gpu_app"]
    live = [c["gpu_js"]["buffers"] - c["gpu_js"]["destroyed"] for c in (warm, end)]
    assert live[0] == live[1] == end["gpu_app"]["live_buffers"]
    assert end["gpu_js"]["bytes"] == warm["gpu_js"]["bytes"] == end["gpu_app"]["bytes"]
