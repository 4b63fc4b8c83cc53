"""Storage faults while a model is cached, in the chat page: the quota running out partway through
the download (a put that fails inside the worker's transaction, and one that throws), the cache
entry deleted while it is downloading (in the same tab and in another tab), and the downloading tab
closed while a second tab waits for the same model.

Each must end without a crash, with a clear message, with no entry reported complete that is not
(IndexedDB read by the test itself: browser_helpers.audit_cache), and with the app usable: the next
load works and yields a byte-identical file. test_app.py covers two tabs loading at once (one
download); here the tab doing the download goes away.

The worker stores 16 KiB chunks (test hook chunkBytes) and, but for the last test, skips the engine
load (skipEngine: an engine load costs 40 s or more on SwiftShader and is not what these tests are
about), so a finished load shows the model's header (data-model "header").
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from browser_helpers import (
    GREEDY_FORM,
    NO_AUTOLOAD,
    app_page,
    app_state,
    assert_cached_exactly,
    audit_cache,
    engine_worker,
    load_custom,
    needs_engine,
    notice,
    open_app,
    resume_offsets,
    send_and_wait,
    serve_test_file,
    set_settings,
    set_test_hooks,
    wait_settled,
    watch,
)

from bitnet_web.web.worker.downloader import MAX_AUTO_RESUMES

pytestmark = pytest.mark.browser

CHUNK = 16 * 1024
# Downloads these tests hold stalled (site_server hold) must not be ended as stalled meanwhile: opening
# another tab can take a minute on a loaded machine. The server releases a hold after 120 s.
HELD = 150

# In the worker: from the (after+1)-th chunk on, writing a chunk fails with QuotaExceededError,
# either as the browser reports it (the transaction aborts, its error is the DOMException) or as a
# put() that throws. Only the chunks store is affected.
_FILL_QUOTA = """([after, mode]) => {
  const put = IDBObjectStore.prototype.put;
  self.__bitnetRealPut = put;
  let n = 0;
  IDBObjectStore.prototype.put = function (...args) {
    if (this.name !== "chunks" || ++n <= after) return put.apply(this, args);
    const err = new DOMException("simulated: the storage quota is used up", "QuotaExceededError");
    Error.captureStackTrace(err);  // as the browser's own DOMExceptions (a constructed one has no stack)
    if (mode === "throw") throw err;
    const tx = this.transaction;
    Object.defineProperty(tx, "error", {get: () => err});
    const req = put.apply(this, args);
    tx.abort();
    return req;
  };
}"""
_RESTORE_PUT = "() => { IDBObjectStore.prototype.put = self.__bitnetRealPut; }"

_OPEN_DB = """
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });"""

# Chunks of `key` that its record does not count, each a valid-looking chunk (its SHA-256 right) of
# bytes that are not the file's: what a tab closed between writing a chunk and counting it leaves.
_PUT_UNCOUNTED = (
    "async ([key, indexes, size]) => {"
    + _OPEN_DB
    + """
  const records = [];
  for (const index of indexes) {
    const data = new Uint8Array(size).fill(0xa5).buffer;
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", data));
    records.push({key, index, offset: index * size, size, data,
                  sha256: Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("")});
  }
  const tx = db.transaction("chunks", "readwrite");
  for (const r of records) tx.objectStore("chunks").put(r);
  await new Promise((ok, bad) => { tx.oncomplete = ok; tx.onabort = () => bad(tx.error); });
  db.close();
}"""
)

_CHUNK_INDEXES = (
    "async (key) => {"
    + _OPEN_DB
    + """
  const range = IDBKeyRange.bound([key, 0], [key, Infinity]);
  const r = db.transaction("chunks").objectStore("chunks").getAllKeys(range);
  const keys = await new Promise((ok, bad) => { r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error); });
  db.close();
  return keys.map((k) => k[1]);
}"""
)


@pytest.fixture(scope="module")
def app(browser, site):
    hooks = dict(chunkBytes=CHUNK, skipEngine=True, stallTimeoutS=HELD)
    with app_page(browser, site, hooks, fail_on_page_errors=True) as page:
        yield page


def _start_load(page, url: str) -> int:
    """Press Load for `url` without waiting for the result; returns the load count before it."""
    before = int(page.get_attribute("#app", "data-loads") or 0)
    page.select_option("#model-select", "custom")
    page.fill("#custom-url", url)
    page.click("#load")
    page.wait_for_function(f"() => Number(document.getElementById('app').dataset.loads || 0) > {before}")
    return before


def _wait_stored(page, url: str, at_least: int) -> None:
    """Poll IndexedDB until the entry for `url` has `at_least` bytes committed."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        entry = audit_cache(page).get(url)
        if entry is not None and entry["stored"] >= at_least:
            return
        page.wait_for_timeout(200)
    raise AssertionError(f"{url}: fewer than {at_least} bytes were stored within 60 s")


def _delete_in_cache_manager(page, url: str) -> None:
    page.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    item = page.locator(f"#cache-list li[data-key='{url}']")
    item.wait_for()
    assert item.get_attribute("data-complete") == "0"
    item.locator("button").click()
    page.wait_for_selector(f"#cache-list li[data-key='{url}']", state="detached")


@pytest.mark.parametrize("mode", ["abort", "throw"])
def test_quota_exceeded_while_caching_keeps_a_consistent_partial_copy(app, site, tiny_model, test_files, mode):
    data = tiny_model
    path = serve_test_file(test_files, f"quota_{mode}.gguf", data)
    url = site.url + path[1:]
    engine_worker(app).evaluate(_FILL_QUOTA, [2, mode])
    try:
        assert load_custom(app, url) == "error"
    finally:
        engine_worker(app).evaluate(_RESTORE_PUT)
    n = notice(app)
    assert n["visible"] and n["kind"] == "quota", n
    assert "QuotaExceededError" in n["text"] and "Delete cached models" in n["text"], n["text"]
    entry = audit_cache(app)[url]  # the failed chunk and its count were not written
    assert entry["complete"] is False and entry["chunks"] == 2 and entry["stored"] == 2 * CHUNK
    app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    assert app.get_attribute(f"#cache-list li[data-key='{url}']", "data-complete") == "0"
    # space was freed: Load resumes after the two stored chunks
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert resume_offsets(site.requests_for(path)[n_requests:]) == [2 * CHUNK]
    assert_cached_exactly(app, url, data)


def test_delete_while_downloading_stops_the_download_and_leaves_nothing(app, site, tiny_model, test_files):
    data = tiny_model
    path = serve_test_file(test_files, "delete_same_tab.gguf", data)
    url = site.url + path[1:]
    # a first attempt leaves a partial copy, which the cache manager lists
    site.add_fault(path, drop_after=len(data) // 4, reset=True, pause_s=0.3)
    for _ in range(MAX_AUTO_RESUMES + 1):  # the resume and every automatic retry of it fail
        site.add_fault(path, status=500)
    assert load_custom(app, url) == "error"
    site.faults.pop(path, None)
    # Load again: the resume stalls after two more chunks, and the person deletes the entry meanwhile
    stored = audit_cache(app)[url]["stored"]
    stall = threading.Event()
    site.add_fault(path, drop_after=2 * CHUNK + 100, hold=stall)
    try:
        before = _start_load(app, url)
        _wait_stored(app, url, stored + CHUNK)
        _delete_in_cache_manager(app, url)
    finally:
        stall.set()
    assert int(app.get_attribute("#app", "data-loads")) == before + 1
    assert wait_settled(app) == "error"
    n = notice(app)
    assert n["kind"] == "deleted" and "deleted" in n["text"], n
    assert url not in audit_cache(app)  # and (audit) no chunk of it is left behind
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert site.requests_for(path)[n_requests]["range"] is None  # downloaded afresh
    assert_cached_exactly(app, url, data)


def test_delete_in_another_tab_while_downloading(app, site, tiny_model, test_files):
    """Tab B deletes the entry tab A is writing: A's next chunk must not recreate it (which would
    leave a record counting chunks that B deleted); A stops with a message and can load again."""
    data = tiny_model
    path = serve_test_file(test_files, "delete_other_tab.gguf", data)
    url = site.url + path[1:]
    stall = threading.Event()
    site.add_fault(path, drop_after=3 * CHUNK + 100, hold=stall)
    other = app.context.new_page()
    log: list[str] = []
    watch(other, log)
    try:
        _start_load(app, url)
        _wait_stored(app, url, 3 * CHUNK)
        open_app(other, site.url + NO_AUTOLOAD)
        _delete_in_cache_manager(other, url)
        stall.set()  # A's download goes on: its next chunk meets the deleted entry
        assert wait_settled(app) == "error"
        n = notice(app)
        assert n["kind"] == "deleted", n
        assert url not in audit_cache(app)
    finally:
        stall.set()
        other.close()
        if log:
            print("\n".join(log[-40:]))
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert site.requests_for(path)[n_requests]["range"] is None
    assert_cached_exactly(app, url, data)


@contextlib.contextmanager
def _stalled_download_tab(app, site, path: str, url: str):
    """A second tab (page, its console log) whose download of `url` has stored three chunks and stalls;
    on exit the stall is released, the tab closed and the end of its log printed."""
    first = app.context.new_page()
    log: list[str] = []
    watch(first, log)
    stall = threading.Event()
    try:
        open_app(first, site.url + NO_AUTOLOAD)
        set_test_hooks(first, chunkBytes=CHUNK, skipEngine=True, stallTimeoutS=HELD)
        site.add_fault(path, drop_after=3 * CHUNK + 100, hold=stall)
        _start_load(first, url)
        _wait_stored(first, url, 3 * CHUNK)
        yield first, log
    finally:
        stall.set()
        if not first.is_closed():
            first.close()
        if log:
            print("\n".join(log[-40:]))


def test_closing_the_downloading_tab_hands_the_download_to_the_waiting_tab(app, site, tiny_model, test_files):
    """Tab A downloads (stalled half-way), tab B (the module's page) loads the same model and waits
    for A's Web Lock; A is closed: B resumes from what A committed and gets an identical file."""
    data = tiny_model
    path = serve_test_file(test_files, "handover.gguf", data)
    url = site.url + path[1:]
    with _stalled_download_tab(app, site, path, url) as (first, log):
        with app.expect_console_message(lambda m: "another tab is downloading this model" in m.text):
            _start_load(app, url)
        first.close()  # its worker ends and its Web Lock is released mid-download
        assert wait_settled(app) == "header", notice(app)
        assert app_state(app)["source"] == "network"
        requests = site.requests_for(path)
        assert len(requests) == 2 and resume_offsets(requests) == [3 * CHUNK], requests
        assert_cached_exactly(app, url, data)
    assert not [line for line in log if line.startswith("pageerror")]


def test_a_chunk_a_closed_tab_left_uncounted_is_dropped_and_the_resume_is_exact(app, site, tiny_model, test_files):
    """Tab A downloads (stalled after three chunks) and is closed; the store holds chunks its record
    does not count, as a tab closed between storing a chunk and counting it (two separate writes)
    leaves them: the next chunk (bytes that are not the file's) and one beyond the file's end. Load
    in tab B resumes after the three counted chunks, removes the uncounted ones, and the file is
    byte-identical with no orphan left (audit)."""
    data = tiny_model
    path = serve_test_file(test_files, "uncounted.gguf", data)
    url = site.url + path[1:]
    beyond_end = len(data) // CHUNK + 2
    with _stalled_download_tab(app, site, path, url) as (first, _):
        first.close()  # mid-download: its worker ends
    app.evaluate(_PUT_UNCOUNTED, [url, [3, beyond_end], CHUNK])
    assert app.evaluate(_CHUNK_INDEXES, url) == [0, 1, 2, 3, beyond_end]
    n_requests = len(site.requests_for(path))
    with app.expect_console_message(lambda m: "removed 2 stored chunk(s)" in m.text):
        assert load_custom(app, url) == "header", notice(app)
    assert resume_offsets(site.requests_for(path)[n_requests:]) == [3 * CHUNK]
    assert app.evaluate(_CHUNK_INDEXES, url) == list(range((len(data) + CHUNK - 1) // CHUNK))
    assert_cached_exactly(app, url, data)


# Replace one stored chunk's data by a value that holds no bytes (a string), keeping its record.
_UNREADABLE_CHUNK = (
    "async ([key, index]) => {"
    + _OPEN_DB
    + """
  const r = db.transaction("chunks").objectStore("chunks").get([key, index]);
  const rec = await new Promise((ok, bad) => { r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error); });
  const tx = db.transaction("chunks", "readwrite");
  tx.objectStore("chunks").put({...rec, data: "not bytes"});
  await new Promise((ok, bad) => { tx.oncomplete = ok; tx.onabort = () => bad(tx.error); });
  db.close();
  return rec.data instanceof Blob;
}"""
)


def test_a_chunk_whose_data_cannot_be_read_is_fetched_again(app, site, tiny_model, test_files):
    """Chunks are stored as Blobs. A chunk whose stored value holds no bytes (here a string; in use, a
    Blob whose file the browser lost) is damage like a wrong SHA-256: the entry is deleted and
    downloaded again, and the new copy is byte-identical (audit), as Blobs again."""
    data = tiny_model
    path = serve_test_file(test_files, "unreadable.gguf", data)
    url = site.url + path[1:]
    assert load_custom(app, url) == "header", notice(app)
    assert app.evaluate(_UNREADABLE_CHUNK, [url, 2]) is True  # it was a Blob
    n_requests = len(site.requests_for(path))
    with app.expect_console_message(lambda m: "chunk 2 of" in m.text and "no readable data" in m.text):
        assert load_custom(app, url) == "header", notice(app)
    assert len(site.requests_for(path)) == n_requests + 1
    entry = assert_cached_exactly(app, url, data)
    assert entry["blob_chunks"] == entry["chunks"]


@needs_engine
@pytest.mark.slow  # the one engine load of this file: 40-90 s on SwiftShader
def test_deleting_the_loaded_models_cached_copy_keeps_the_model_usable(app, site, tiny_model, test_files):
    path = serve_test_file(test_files, "loaded_then_deleted.gguf", tiny_model)
    url = site.url + path[1:]
    set_test_hooks(app, chunkBytes=CHUNK, skipEngine=False, stallTimeoutS=HELD)
    try:
        assert load_custom(app, url) == "loaded", notice(app)
        app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
        app.locator(f"#cache-list li[data-key='{url}'] button").click()
        app.wait_for_selector(f"#cache-list li[data-key='{url}']", state="detached")
        assert url not in audit_cache(app)
        set_settings(app, {**GREEDY_FORM, "max_tokens": "1"})
        reply = send_and_wait(app, "hello")
        assert reply["state"] == "done", reply  # before the fix: "no model is loaded yet"
    finally:
        set_test_hooks(app, chunkBytes=CHUNK, skipEngine=True, stallTimeoutS=HELD)
