"""Driving the chat page from tests: wait for its states, load models, read its IndexedDB."""

from __future__ import annotations

import concurrent.futures
import functools
from pathlib import Path
from typing import Any

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "test-results"
LOCAL_PREFIXES = ("http://127.0.0.1:", "data:", "blob:")
NO_AUTOLOAD = "?autoload=0"  # the page does not load its default model at start
GREEDY_FORM = {"temperature": "0", "top_k": "1", "top_p": "1", "max_tokens": "8",
               "repetition_penalty": "1", "seed": "0"}
SYSTEM = "You are a test."
SETTLED = ("loaded", "header", "error")
READY_MODEL = ("loaded", "header")  # "header": the model was fetched and checked, engine absent

_IDB_READ = """
async (key) => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  const get = (store, k) => new Promise((ok, bad) => {
    const r = db.transaction(store).objectStore(store).get(k);
    r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  try {
    if (!db.objectStoreNames.contains("models")) return null;
    const meta = await get("models", key);
    if (!meta) return null;
    const parts = [];
    for (let i = 0; i < meta.chunks; i++) {
      const rec = await get("chunks", [key, i]);
      if (!rec) return {meta: {...meta, header: null}, missing: i};
      parts.push(new Uint8Array(rec.data));
    }
    const size = parts.reduce((n, p) => n + p.length, 0);
    const all = new Uint8Array(size);
    let at = 0;
    for (const p of parts) { all.set(p, at); at += p.length; }
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", all));
    return {meta: {...meta, header: null}, size,
            sha256: Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("")};
  } finally { db.close(); }
}
"""


def engine_importable() -> bool:
    try:
        import bitnet_web.engine  # noqa: F401
        import bitnet_web.sampler  # noqa: F401
    except ImportError:
        return False
    return True


needs_engine = pytest.mark.skipif(not engine_importable(),
                                  reason="bitnet_web.engine is not importable yet (the engine has not landed)")


def screenshot(page, name: str) -> Path:
    """Save a full-page screenshot under test-results/ (looked at by people, not asserted)."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def app_state(page) -> dict[str, str]:
    return page.evaluate("""() => { const a = document.getElementById('app');
        return {engine: a.dataset.engine, model: a.dataset.model, busy: a.dataset.busy,
                source: a.dataset.source || ''}; }""")


def open_app(page, url: str) -> None:
    """Go to the chat page and wait until the worker answered (or a failure page is up)."""
    page.goto(url)
    page.wait_for_function("""() => { const a = document.getElementById('app');
        return ['ready', 'missing', 'failed'].includes(a.dataset.engine); }""", timeout=180_000)


def wait_settled(page, timeout: float = 240_000) -> str:
    """Wait for the current model load to finish; returns data-model."""
    page.wait_for_function(f"""() => {{ const a = document.getElementById('app');
        return {list(SETTLED)!r}.includes(a.dataset.model); }}""", timeout=timeout)
    return app_state(page)["model"]


def wait_offline_ready(page) -> None:
    page.wait_for_selector("#offline-status[data-ready='1']", state="attached", timeout=120_000)


def notice(page) -> dict[str, str]:
    return page.evaluate("""() => { const n = document.getElementById('notice');
        return {visible: !n.hidden, kind: n.dataset.kind || '', text: n.textContent}; }""")


def start_load(page, action) -> str:
    """Run `action` (which starts a load), wait for that load to finish; returns data-model."""
    before = int(page.get_attribute("#app", "data-loads") or 0)
    action()
    page.wait_for_function(f"() => Number(document.getElementById('app').dataset.loads || 0) > {before}")
    return wait_settled(page)


def load_custom(page, url: str) -> str:
    page.select_option("#model-select", "custom")
    page.fill("#custom-url", url)
    return start_load(page, lambda: page.click("#load"))


def load_option(page, key: str) -> str:
    page.select_option("#model-select", key)
    return start_load(page, lambda: page.click("#load"))


def idb_entry(page, key: str) -> dict[str, Any] | None:
    """{meta, size, sha256} of a cached model, read straight from IndexedDB (not via the app)."""
    return page.evaluate(_IDB_READ, key)


def model_info(page) -> dict[str, str]:
    return page.evaluate("""() => { const out = {};
        const dts = document.querySelectorAll('#model-info dt');
        for (const dt of dts) out[dt.textContent] = dt.nextElementSibling.textContent;
        return out; }""")


def set_settings(page, values: dict[str, str], system_prompt: str | None = None) -> None:
    page.evaluate("() => { document.getElementById('settings-panel').open = true; }")
    for name, value in values.items():
        page.fill("#setting-" + name.replace("_", "-"), value)
    if system_prompt is not None and page.is_enabled("#system-prompt"):  # disabled for completion models
        page.fill("#system-prompt", system_prompt)


def send_and_wait(page, text: str) -> dict[str, Any]:
    """Type `text`, press Enter, wait for the reply to finish; returns its text, state and pieces."""
    n_before = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(f"""() => {{ const r = document.querySelectorAll('.msg.assistant .text');
        return r.length > {n_before} && r[r.length - 1].dataset.state !== 'streaming'; }}""", timeout=300_000)
    return last_reply(page)


def last_reply(page) -> dict[str, Any]:
    return page.evaluate("""() => { const r = document.querySelectorAll('.msg.assistant .text');
        const t = r[r.length - 1]; const clone = t.cloneNode(true);
        for (const s of clone.querySelectorAll('.stopped')) s.remove();
        return {text: clone.textContent, state: t.dataset.state, pieces: Number(t.dataset.pieces || 0),
                stats: document.getElementById('stats').textContent}; }""")


# ------------------------------------------------------------------------------------------------
# The CPython reference (the same engine code, run natively with wgpu-py)
# ------------------------------------------------------------------------------------------------

# Playwright's sync API keeps an asyncio loop running on the test thread, and the engine's sync
# wrappers run their own loop: the reference engine lives on one thread of its own.
_reference_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpython-engine")


@functools.lru_cache(maxsize=2)
def _cpython_engine(path: str):
    from bitnet_web.engine import Engine
    engine = Engine()
    engine.load(path)
    return engine


def _template_kind(engine) -> str:
    try:
        return engine.info["template_kind"]
    except Exception:
        return engine.template.kind


def _cpython_generate(path: str, request: str, settings: dict[str, Any]) -> str:
    """request: "turn" (system, history, text) or "summary" (text), built as the page builds it."""
    from bitnet_web.sampler import SamplerSettings
    from bitnet_web.ui.prompts import summary_messages, summary_prompt, turn_request
    from bitnet_web.ui.settings import to_engine_settings

    engine = _cpython_engine(path)
    engine.reset()
    kind = _template_kind(engine)
    if request[0] == "turn":
        how, what = turn_request(kind, *request[1:])
    else:
        how, what = ("complete", summary_prompt(request[1])) if kind == "completion" else \
            ("chat", summary_messages(request[1]))
    extra = {"messages": what} if how == "chat" else {"prompt": what}
    return "".join(engine.generate(settings=to_engine_settings(settings, SamplerSettings),
                                   max_tokens=int(settings["max_tokens"]), **extra))


def cpython_turn(path: Path, system: str, history: list[dict[str, str]], text: str,
                 settings: dict[str, Any]) -> str:
    """The reply the CPython engine streams for the chat page's next turn (same request building)."""
    return _reference_thread.submit(_cpython_generate, str(path), ("turn", system, history, text),
                                    settings).result()


def cpython_summary(path: Path, text: str, settings: dict[str, Any]) -> str:
    """The TL;DR the CPython engine writes for `text`, requested as the widget requests it."""
    return _reference_thread.submit(_cpython_generate, str(path), ("summary", text), settings).result()
