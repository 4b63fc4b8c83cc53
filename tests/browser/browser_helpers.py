"""Driving the chat page from tests: wait for its states, load models, read its IndexedDB."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest

from bitnet_web.web.worker.checksum import chunk_checksum

RESULTS = Path(__file__).resolve().parents[2] / "test-results"
LOCAL_PREFIXES = ("http://127.0.0.1:", "data:", "blob:")
NO_AUTOLOAD = "?autoload=0"  # the page does not load its default model at start
GREEDY_FORM = {
    "temperature": "0",
    "top_k": "1",
    "top_p": "1",
    "max_tokens": "8",
    "repetition_penalty": "1",
    "seed": "0",
}
SYSTEM = "You are a test."
SETTLED = ("loaded", "header", "error")
READY_MODEL = ("loaded", "header")  # "header": the model was fetched and checked, engine absent

_IDB_READ = """
async (key) => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  try {
    if (!db.objectStoreNames.contains("models")) return null;
    // one transaction for the record and its chunks: a snapshot no concurrent write can split
    const tx = db.transaction(["models", "chunks"]);
    const req = (r) => new Promise((ok, bad) => { r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error); });
    const [meta, chunks] = await Promise.all([
      req(tx.objectStore("models").get(key)),
      req(tx.objectStore("chunks").getAll(IDBKeyRange.bound([key, 0], [key, Infinity])))]);
    if (!meta) return null;
    const parts = [];
    for (let i = 0; i < meta.chunks; i++) {
      const rec = chunks.find((c) => c.index === i);
      if (!rec) return {meta: {...meta, header: null}, missing: i};
      parts.push(new Uint8Array(rec.data instanceof Blob ? await rec.data.arrayBuffer() : rec.data));
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


_IDB_AUDIT = """
async () => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  // Both stores read in ONE transaction: IndexedDB runs it between the app's read-write transactions,
  // so it sees each chunk-and-record write whole. (Read in two transactions, a chunk committed
  // between them looks like a chunk its record does not count.)
  const all = (tx, store) => new Promise((ok, bad) => {
    const r = tx.objectStore(store).getAll(); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  const hex = async (data) => Array.from(new Uint8Array(await crypto.subtle.digest("SHA-256", data)),
                                         (b) => b.toString(16).padStart(2, "0")).join("");
  try {
    if (!db.objectStoreNames.contains("models")) return {entries: [], chunks: []};
    const tx = db.transaction(["models", "chunks"]);
    const [metas, chunks] = await Promise.all([all(tx, "models"), all(tx, "chunks")]);
    const out = {entries: [], chunks: []};
    for (const c of chunks) {  // the app stores Blobs (ArrayBuffers before): audit the bytes either way
      c.blob = c.data instanceof Blob;
      if (c.blob) c.data = await c.data.arrayBuffer();
      out.chunks.push({key: c.key, index: c.index, offset: c.offset, size: c.size, bytes: c.data.byteLength,
                       blob: c.blob, sha256: c.sha256, actual_sha256: await hex(c.data),
                       check: typeof c.check === "string" ? c.check : null});
    }
    for (const m of metas) {
      const own = chunks.filter((c) => c.key === m.key).sort((a, b) => a.index - b.index);
      const size = own.reduce((n, c) => n + c.data.byteLength, 0);
      const all_ = new Uint8Array(size);
      let at = 0;
      for (const c of own) { all_.set(new Uint8Array(c.data), at); at += c.data.byteLength; }
      out.entries.push({...m, header: m.header ? {name: m.header.name} : null, file_size: size,
                        file_sha256: await hex(all_)});
    }
    return out;
  } finally { db.close(); }
}
"""


def audit_cache(page) -> dict[str, dict[str, Any]]:
    """Every model cache entry, read straight from IndexedDB and checked for consistency: chunks
    0..n-1 present, contiguous offsets, sizes and per-chunk SHA-256 as recorded, `stored` equal to
    their sum, `complete` only with stored == total, no chunk without its entry. Returns the entries
    by key, each with file_size / file_sha256 of its reassembled chunks, blob_chunks (how many of
    its chunks are stored as Blobs, the app's format; older builds stored ArrayBuffers) and
    chunk_checks ((offset, size, check) of each chunk; check None in older builds' chunks)."""
    found = page.evaluate(_IDB_AUDIT)
    entries = {e["key"]: e for e in found["entries"]}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for c in found["chunks"]:
        assert c["key"] in entries, f"chunk {c['index']} of {c['key']} has no model record (orphan)"
        assert c["actual_sha256"] == c["sha256"], f"chunk {c['index']} of {c['key']}: SHA-256 differs"
        assert c["bytes"] == c["size"], f"chunk {c['index']} of {c['key']}: {c['bytes']} bytes, record says {c['size']}"
        by_key.setdefault(c["key"], []).append(c)
    for key, e in entries.items():
        chunks = sorted(by_key.get(key, []), key=lambda c: c["index"])
        assert [c["index"] for c in chunks] == list(range(e["chunks"])), (
            f"{key}: chunk indexes {[c['index'] for c in chunks]}, record counts {e['chunks']}"
        )
        e["blob_chunks"] = sum(bool(c["blob"]) for c in chunks)
        e["chunk_checks"] = [(c["offset"], c["size"], c["check"]) for c in chunks]
        offset = 0
        for c in chunks:
            assert c["offset"] == offset, f"{key}: chunk {c['index']} at offset {c['offset']}, expected {offset}"
            offset += c["size"]
        assert e["stored"] == offset == e["file_size"], f"{key}: stored {e['stored']}, chunks hold {offset}"
        if e["complete"]:
            assert e["total"] is not None and e["stored"] == e["total"], (
                f"{key}: marked complete with {e['stored']} of {e['total']} bytes"
            )
    return entries


def serve_test_file(test_files: Path, name: str, data: bytes) -> str:
    """Put `data` where the test site serves it; returns its URL path."""
    (test_files / name).write_bytes(data)
    return "/_test/" + name


def assert_cached_exactly(page, url: str, data: bytes, gguf_header: bool = False) -> dict[str, Any]:
    """The cache entry of `url` is complete and its chunks reassemble `data` (and, with `gguf_header`,
    it holds the parsed GGUF header); returns the entry."""
    entry = audit_cache(page)[url]
    assert entry["complete"] is True and entry["total"] == len(data)
    assert entry["file_size"] == len(data) and entry["file_sha256"] == hashlib.sha256(data).hexdigest()
    assert_chunk_checks(entry, data)
    if gguf_header:
        assert entry["header"] is not None, "a complete GGUF entry without its parsed header"
    return entry


def assert_chunk_checks(entry: dict[str, Any], data: bytes) -> None:
    """Every chunk of an audited entry has the checksum of its own bytes of `data` (the file)."""
    for offset, size, check in entry["chunk_checks"]:
        assert check == chunk_checksum(data[offset : offset + size]), f"chunk at {offset}: check {check!r}"


def resume_offsets(requests: list[dict]) -> list[int]:
    """The start offsets of the requests that resumed a download with `Range: bytes=N-`."""
    return [int(re.fullmatch(r"bytes=(\d+)-", r["range"]).group(1)) for r in requests if r["range"]]


def engine_worker(page):
    """The page's engine worker (Playwright Worker: `evaluate` runs JS in the worker's scope)."""
    for worker in page.workers:
        if worker.url.endswith("/engine-worker.js"):
            return worker
    raise AssertionError(f"no engine worker in {[w.url for w in page.workers]}")


def set_test_hooks(page, **hooks: Any) -> None:
    """Set the worker's test hooks (downloader.testing_hooks), e.g. chunkBytes, skipEngine, stallTimeoutS."""
    engine_worker(page).evaluate("(hooks) => { self.bitnetWebTestHooks = hooks; }", hooks)


_GPU_COUNTERS = """
() => {
  if (self.gpuCounters) return;
  // Counts WebGPU calls from this point on, beside the app (an independent tally of what it creates).
  const c = self.gpuCounters = {buffers: 0, destroyed: 0, bytes: 0, pipelines: 0, async_pipelines: 0, writes: 0};
  const made = new WeakSet(), gone = new WeakSet();
  const wrap = (proto, name, after) => {
    const orig = proto[name];
    proto[name] = function (...args) { const out = orig.apply(this, args); after(this, args, out); return out; };
  };
  wrap(GPUDevice.prototype, "createBuffer", (d, [desc], b) => { made.add(b); c.buffers++; c.bytes += desc.size; });
  wrap(GPUBuffer.prototype, "destroy", (b) => {
    if (made.has(b) && !gone.has(b)) { gone.add(b); c.destroyed++; c.bytes -= b.size; }
  });
  wrap(GPUDevice.prototype, "createComputePipeline", () => { c.pipelines++; });
  wrap(GPUDevice.prototype, "createComputePipelineAsync", () => { c.pipelines++; c.async_pipelines++; });
  wrap(GPUQueue.prototype, "writeBuffer", () => { c.writes++; });
}
"""


def install_gpu_counters(page) -> None:
    """Count the engine worker's WebGPU buffers, pipelines and uploads from now on (see gpu_counts)."""
    engine_worker(page).evaluate(_GPU_COUNTERS)


def gpu_counts(page) -> dict[str, int]:
    """{buffers, destroyed, bytes (still alive), pipelines (async_pipelines of them made with
    createComputePipelineAsync), writes} since install_gpu_counters."""
    return engine_worker(page).evaluate("() => ({...self.gpuCounters})")


def worker_python(page, code: str) -> Any:
    """Run Python in the engine worker's interpreter (after `code`'s statements, the value of its
    last line, converted to JS and back)."""
    return engine_worker(page).evaluate(
        """(code) => {
        const out = self.pyodide.runPython(code);
        if (!(out && out.toJs)) return out;
        try { return out.toJs({dict_converter: Object.fromEntries}); } finally { out.destroy(); } }""",
        code,
    )


def engine_importable() -> bool:
    try:
        import bitnet_web.engine  # noqa: F401
        import bitnet_web.text.sampler  # noqa: F401
    except ImportError:
        return False
    return True


needs_engine = pytest.mark.skipif(
    not engine_importable(), reason="bitnet_web.engine is not importable yet (the engine has not landed)"
)


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
    page.wait_for_function(
        """() => { const a = document.getElementById('app');
        return ['ready', 'missing', 'failed'].includes(a.dataset.engine); }""",
        timeout=180_000,
    )


def wait_settled(page, timeout: float = 240_000) -> str:
    """Wait for the current model load to finish; returns data-model."""
    page.wait_for_function(
        f"""() => {{ const a = document.getElementById('app');
        return {list(SETTLED)!r}.includes(a.dataset.model); }}""",
        timeout=timeout,
    )
    return app_state(page)["model"]


def wait_offline_ready(page) -> None:
    page.wait_for_selector("#offline-status[data-ready='1']", state="attached", timeout=120_000)


def notice(page) -> dict[str, str]:
    return page.evaluate("""() => { const n = document.getElementById('notice');
        return {visible: !n.hidden, kind: n.dataset.kind || '', text: n.textContent}; }""")


def start_load(page, action) -> str:
    """Run `action` (which starts a load), wait for that load to finish; returns data-model, or
    "error" when the load failed although the model loaded before it stays loaded."""
    before = int(page.get_attribute("#app", "data-loads") or 0)
    action()
    page.wait_for_function(f"() => Number(document.getElementById('app').dataset.loads || 0) > {before}")
    state = wait_settled(page)
    outcome = page.get_attribute("#app", "data-load")
    return "error" if state == "loaded" and outcome not in ("ok", None) else state


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
    try:
        page.wait_for_function(
            f"""() => {{ const r = document.querySelectorAll('.msg.assistant .text');
            return r.length > {n_before} && r[r.length - 1].dataset.state !== 'streaming'; }}""",
            timeout=300_000,
        )
    except Exception as exc:  # say what the page showed: a hang and a refused send look alike otherwise
        raise AssertionError(f"no finished reply to {text!r}; the page: {page_state(page, n_before)}") from exc
    return last_reply(page)


def wait_for_new_reply(page, n_before: int, pieces: int = 1, timeout: float = 120_000) -> None:
    """Wait until the reply after the first `n_before` ones has `pieces` pieces. The page creates a
    reply's bubble in the task that handles the Enter key, after `page.press` returns: a wait on "the
    last reply" alone can see the previous, finished one."""
    page.wait_for_function(
        """([n, k]) => { const r = document.querySelectorAll('.msg.assistant .text');
        return r.length > n && Number(r[r.length - 1].dataset.pieces || 0) >= k; }""",
        arg=[n_before, pieces],
        timeout=timeout,
    )


def page_state(page, n_before: int = 0) -> dict[str, Any]:
    """What a person would see when a reply does not come: #app's flags, status, stats, the notice,
    the prompt box and the replies since `n_before`."""
    return page.evaluate(
        """(n) => { const app = document.getElementById('app'); const text = (id) =>
            (document.getElementById(id) || {}).textContent || '';
        const r = [...document.querySelectorAll('.msg.assistant .text')].slice(n);
        return {flags: {...app.dataset}, status: text('status'), stats: text('stats'), notice: text('notice'),
                prompt: document.getElementById('prompt').value,
                prompt_disabled: document.getElementById('prompt').disabled,
                replies: r.map((t) => ({state: t.dataset.state, pieces: t.dataset.pieces,
                                        text: t.textContent.slice(0, 200)}))}; }""",
        n_before,
    )


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
    from bitnet_web.text.sampler import SamplerSettings
    from bitnet_web.web.shared.prompts import summary_messages, summary_prompt, turn_request
    from bitnet_web.web.shared.settings import to_engine_settings

    engine = _cpython_engine(path)
    engine.reset()
    kind = _template_kind(engine)
    if request[0] == "turn":
        how, what = turn_request(kind, *request[1:])
    else:
        how, what = (
            ("complete", summary_prompt(request[1])) if kind == "completion" else ("chat", summary_messages(request[1]))
        )
    extra = {"messages": what} if how == "chat" else {"prompt": what}
    return "".join(
        engine.generate(
            settings=to_engine_settings(settings, SamplerSettings), max_tokens=int(settings["max_tokens"]), **extra
        )
    )


def cpython_turn(path: Path, system: str, history: list[dict[str, str]], text: str, settings: dict[str, Any]) -> str:
    """The reply the CPython engine streams for the chat page's next turn (same request building)."""
    return _reference_thread.submit(_cpython_generate, str(path), ("turn", system, history, text), settings).result()


def cpython_summary(path: Path, text: str, settings: dict[str, Any]) -> str:
    """The TL;DR the CPython engine writes for `text`, requested as the widget requests it."""
    return _reference_thread.submit(_cpython_generate, str(path), ("summary", text), settings).result()


def watch(page, log: list[str]) -> None:
    """Collect the page's console lines and uncaught exceptions into `log`; generous timeouts."""
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    page.set_default_timeout(120_000)


@contextlib.contextmanager
def app_page(browser, site, hooks: dict[str, Any] | None = None, fail_on_page_errors: bool = False):
    """The chat page (no autoload) in a fresh browser context, with test `hooks` set in its worker.

    On exit: prints the page's log, fails if any page or worker of the context requested anything
    outside 127.0.0.1, and with `fail_on_page_errors` if an uncaught exception reached the page."""
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    log: list[str] = []
    outside: list[str] = []
    watch(page, log)
    context.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    open_app(page, site.url + NO_AUTOLOAD)
    if hooks:
        set_test_hooks(page, **hooks)
    page.bitnet_log = log
    try:
        yield page
    finally:
        context.close()
    if log:
        print("\n".join(log[-80:]))
    assert outside == [], f"the pages or their workers requested URLs outside 127.0.0.1: {outside}"
    if fail_on_page_errors:
        errors = [line for line in log if line.startswith("pageerror")]
        assert not errors, f"uncaught errors in the page: {errors}"
