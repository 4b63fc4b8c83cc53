"""A cached model loaded while it is read (web/worker/stream.py), in the chat page: the engine parses
and uploads each part as its IndexedDB chunks arrive. The worker stores 16 KiB chunks (test hook
chunkBytes), so the tiny model spans 8 chunks and its embedding is on the GPU before its layer is read.

- The streamed model answers exactly as the CPython engine does on the same file.
- Cancel while the engine waits for a chunk (one held back by the test) ends the load at once, frees
  what was uploaded, and keeps the loaded model answering.
- A chunk damaged in storage (bytes changed, its recorded SHA-256 kept) is found after the parts
  before it were uploaded: those are freed, the entry is fetched again and loads, byte-identical.

References: the CPython engine, the file on disk (hashlib), IndexedDB read by the test itself, the
worker's WebGPU calls counted by wrapping them (browser_helpers.install_gpu_counters).
"""

from __future__ import annotations

import hashlib
import time

import pytest
from browser_helpers import (
    GREEDY_FORM,
    SYSTEM,
    app_page,
    assert_chunk_checks,
    audit_cache,
    cpython_turn,
    engine_worker,
    gpu_counts,
    install_gpu_counters,
    load_custom,
    needs_engine,
    notice,
    send_and_wait,
    set_settings,
)

from bitnet_web.web.shared.settings import parse_form

pytestmark = [pytest.mark.browser, needs_engine, pytest.mark.slow]  # two engine loads: minutes on SwiftShader

CHUNK = 16 * 1024
SHORT = {**GREEDY_FORM, "max_tokens": "3"}
HELD = 6  # the chunk held back / damaged: after the embedding's chunks, before the layer's

# In the worker: IndexedDB answers a get of chunk `index` only after `ms` (the data itself unchanged).
_HOLD_CHUNK = """([index, ms]) => {
  const get = IDBObjectStore.prototype.get;
  self.__bitnetRealGet = get;
  IDBObjectStore.prototype.get = function (query) {
    const req = get.call(this, query);
    if (this.name !== "chunks" || !Array.isArray(query) || query[1] !== index) return req;
    const held = {result: undefined, error: null, onsuccess: null, onerror: null};
    const answer = () => { held.result = req.result; if (held.onsuccess) held.onsuccess({type: "success"}); };
    req.onsuccess = () => setTimeout(answer, ms);
    req.onerror = () => { held.error = req.error; if (held.onerror) held.onerror({type: "error"}); };
    return held;
  };
}"""
_RELEASE_CHUNK = "() => { IDBObjectStore.prototype.get = self.__bitnetRealGet; }"

# Flip byte `at` of a stored chunk, keeping the SHA-256 recorded for it (storage damage).
_DAMAGE_CHUNK = """async ([key, index, at]) => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  const tx = db.transaction("chunks", "readonly");
  const r = tx.objectStore("chunks").get([key, index]);
  const rec = await new Promise((ok, bad) => { r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error); });
  await new Promise((ok, bad) => { tx.oncomplete = ok; tx.onabort = () => bad(tx.error); });
  // the app stores chunks as Blobs: read the bytes outside the transaction (an await would end it)
  const bytes = new Uint8Array(rec.data instanceof Blob ? await rec.data.arrayBuffer() : rec.data.slice(0));
  bytes[at] ^= 0xff;
  const put = db.transaction("chunks", "readwrite");
  put.objectStore("chunks").put({...rec, data: rec.data instanceof Blob ? new Blob([bytes]) : bytes.buffer});
  await new Promise((ok, bad) => { put.oncomplete = ok; put.onabort = () => bad(put.error); });
  db.close();
}"""

# Rewrite an entry's chunks as an older build stored them: the bytes as ArrayBuffer values, not Blobs,
# and no `check` (those builds checked the SHA-256 alone).
_AS_ARRAYBUFFERS = """async (key) => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  const req = (r) => new Promise((ok, bad) => { r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error); });
  const read = db.transaction("chunks", "readonly");
  const chunks = await req(read.objectStore("chunks").getAll(IDBKeyRange.bound([key, 0], [key, Infinity])));
  const converted = [];
  for (const c of chunks) {
    const {check, ...older} = c;
    converted.push({...older, data: c.data instanceof Blob ? await c.data.arrayBuffer() : c.data});
  }
  const tx = db.transaction("chunks", "readwrite");
  for (const c of converted) tx.objectStore("chunks").put(c);
  await new Promise((ok, bad) => { tx.oncomplete = ok; tx.onabort = () => bad(tx.error); });
  db.close();
  return converted.length;
}"""


@pytest.fixture(scope="module")
def app(browser, site):
    with app_page(browser, site, dict(chunkBytes=CHUNK), fail_on_page_errors=True) as page:
        install_gpu_counters(page)
        yield page


@pytest.fixture(scope="module")
def model(test_files, tiny_model):
    path = test_files / "streamed-tiny.gguf"
    path.write_bytes(tiny_model)
    return path


def _reply_equals_cpython(page, path, text: str) -> None:
    set_settings(page, SHORT, SYSTEM)
    reply = send_and_wait(page, text)
    assert reply["state"] == "done", reply
    assert reply["text"] == cpython_turn(path, SYSTEM, [], text, parse_form(SHORT))
    page.click("#new-chat")  # the next check starts from an empty history again


def test_a_model_in_many_chunks_streams_into_the_engine(app, site, model):
    assert len(model.read_bytes()) > HELD * CHUNK + CHUNK // 2  # the held chunk is not the last
    url = site.url + "_test/" + model.name
    assert load_custom(app, url) == "loaded", notice(app)  # downloaded, then read back streamed
    _reply_equals_cpython(app, model, "hello")


def test_cancel_while_the_engine_waits_for_a_chunk(app, site, model):
    url = site.url + "_test/" + model.name
    loaded = gpu_counts(app)
    engine_worker(app).evaluate(_HOLD_CHUNK, [HELD, 60_000])
    try:
        load_custom_start(app, url)
        # the embedding (chunks before the held one) reaches the GPU while the layer's bytes are held
        deadline = time.monotonic() + 120
        while gpu_counts(app)["bytes"] <= loaded["bytes"]:
            assert time.monotonic() < deadline, "nothing was uploaded before the held chunk arrived"
            time.sleep(0.2)
        pressed = time.monotonic()
        app.click("#cancel-load")
        # data-loads already counts this load (it is set when the load starts): wait for its outcome
        app.wait_for_function("() => document.getElementById('app').dataset.load !== 'running'")
        assert time.monotonic() - pressed < 30, "Cancel waited for the held chunk"
    finally:
        engine_worker(app).evaluate(_RELEASE_CHUNK)
    assert app.get_attribute("#app", "data-load") == "cancelled", notice(app)
    assert notice(app)["kind"] == "cancelled"
    assert gpu_counts(app)["bytes"] == loaded["bytes"], "a cancelled streamed load left GPU buffers behind"
    _reply_equals_cpython(app, model, "still here")


def test_a_damaged_chunk_found_mid_upload_is_fetched_again(app, site, model):
    url, path = site.url + "_test/" + model.name, "/_test/" + model.name
    chunk, at = HELD, 100
    loaded = gpu_counts(app)
    app.evaluate(_DAMAGE_CHUNK, [url, chunk, at])
    downloads = len(site.requests_for(path))
    with app.expect_console_message(lambda m: f"chunk {chunk} of" in m.text and "downloading it again" in m.text):
        assert load_custom(app, url) == "loaded", notice(app)
    assert len(site.requests_for(path)) == downloads + 1
    entry = audit_cache(app)[url]
    assert entry["complete"] is True and entry["file_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    _reply_equals_cpython(app, model, "hello again")
    counts = gpu_counts(app)  # (after a reply, as `loaded`: a model makes some buffers at its first one)
    # the damaged attempt's buffers were freed; the new model replaced the old one of the same size
    assert counts["bytes"] == loaded["bytes"], (loaded, counts)


def load_custom_start(page, url: str) -> None:
    page.select_option("#model-select", "custom")
    page.fill("#custom-url", url)
    page.click("#load")


def test_chunks_are_blobs_and_an_older_arraybuffer_entry_still_loads(app, site, model):
    """New chunks are stored as Blobs (read back ~3x faster in Chromium) with a checksum of their
    bytes (read back faster than their SHA-256); an entry an older build stored with ArrayBuffer
    values and no checksum loads from the cache as before (checked by SHA-256), without a download,
    and is then rewritten in today's format in the background (same bytes and hashes: audit_cache
    checks each chunk; each chunk's checksum that of its bytes of the file)."""
    url, path = site.url + "_test/" + model.name, "/_test/" + model.name
    entry = audit_cache(app)[url]
    assert entry["chunks"] > 1 and entry["blob_chunks"] == entry["chunks"], entry
    assert_chunk_checks(entry, model.read_bytes())
    assert app.evaluate(_AS_ARRAYBUFFERS, url) == entry["chunks"]
    older = audit_cache(app)[url]
    assert older["blob_chunks"] == 0 and all(check is None for *_, check in older["chunk_checks"])
    downloads = len(site.requests_for(path))
    assert load_custom(app, url) == "loaded", notice(app)
    assert app.get_attribute("#app", "data-source") == "cache"
    assert len(site.requests_for(path)) == downloads
    _reply_equals_cpython(app, model, "old format")
    deadline = time.monotonic() + 60
    while (upgraded := audit_cache(app)[url])["blob_chunks"] < entry["chunks"] or any(
        check is None for *_, check in upgraded["chunk_checks"]
    ):
        assert time.monotonic() < deadline, f"the older entry's chunks were not rewritten: {upgraded}"
        time.sleep(0.5)
    assert upgraded["file_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert_chunk_checks(upgraded, model.read_bytes())
