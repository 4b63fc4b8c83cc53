"""Network faults during a model download, in the chat page (one browser context for the module).

Faults come from the test server (site_server.py): a TCP reset at 10 %, 50 % and 99 % of the file, a
response shorter than its Content-Length (once, and on every request), HTTP 500 on every retry (first
request and on a resume), HTTP 503 once (retried), 404 (not retried), an HTML page answering a resume
(a captive portal), a truncated file cut before its header was read, a transfer that stalls (mid-body,
and before any response). test_app_session.py already covers a server ignoring Range, a 404, a URL
that is an HTML page, a truncated GGUF and the Range/If-Range headers of a resume; these tests do not
repeat them.

References: the file on disk (hashlib), the server's request log, and IndexedDB read by the test
itself (browser_helpers.audit_cache: every entry and chunk checked, chunks reassembled and hashed).
The worker stores 16 KiB chunks (test hook chunkBytes: the 125 KB model spans 8 chunks) and skips
the engine load (skipEngine: the GPU upload is not what these tests are about), so a finished load
shows the model's header (data-model "header").
"""

from __future__ import annotations

import re
import threading

import pytest
from browser_helpers import (
    app_page,
    assert_cached_exactly,
    audit_cache,
    load_custom,
    notice,
    resume_offsets,
    serve_test_file,
    set_test_hooks,
)

from bitnet_web.web.worker.downloader import MAX_AUTO_RESUMES

pytestmark = pytest.mark.browser

CHUNK = 16 * 1024
FAILING = MAX_AUTO_RESUMES + 1  # answers of a failing server: the first request and every automatic retry


@pytest.fixture(scope="module")
def app(browser, site):
    with app_page(browser, site, dict(chunkBytes=CHUNK, skipEngine=True), fail_on_page_errors=True) as page:
        yield page


def _log_since(app, n: int) -> str:
    return "\n".join(app.bitnet_log[n:])


@pytest.mark.parametrize("percent", [10, 50, 99])
def test_connection_reset_resumes_to_an_identical_file(app, site, tiny_model, test_files, percent):
    data = tiny_model
    path = serve_test_file(test_files, f"reset{percent}.gguf", data)
    cut = len(data) * percent // 100
    site.add_fault(path, drop_after=cut, reset=True, pause_s=0.5)
    n_log = len(app.bitnet_log)
    assert load_custom(app, site.url + path[1:]) == "header", notice(app)
    requests = site.requests_for(path)
    assert len(requests) == 2 and requests[0]["range"] is None, requests
    (resumed_at,) = resume_offsets(requests)
    assert 0 < resumed_at <= cut  # what arrived before the reset is kept, nothing past it invented
    log = _log_since(app, n_log)
    assert "dropped" in log and f"resuming at byte {resumed_at:,}" in log, log
    assert_cached_exactly(app, site.url + path[1:], data, gguf_header=True)


def test_stalled_transfers_are_ended_and_resumed(app, site, tiny_model, test_files):
    """A server that stops sending mid-body without closing the connection, then one that does not
    answer a request at all: after the stall timeout (test hook stallTimeoutS: 2 s here, 30 s in the
    app) each request is ended and the download resumes from what was stored, to an identical file."""
    data = tiny_model
    path = serve_test_file(test_files, "stall.gguf", data)
    url = site.url + path[1:]
    cut = len(data) // 2
    stall = threading.Event()
    site.add_fault(path, drop_after=cut, hold=stall)  # half the body, then nothing (held open)
    site.add_fault(path, delay_s=8)  # the resume: no response for 8 s
    set_test_hooks(app, chunkBytes=CHUNK, skipEngine=True, stallTimeoutS=2)
    n_log = len(app.bitnet_log)
    try:
        assert load_custom(app, url) == "header", notice(app)
    finally:
        stall.set()
        set_test_hooks(app, chunkBytes=CHUNK, skipEngine=True)
    requests = site.requests_for(path)
    assert len(requests) == 3 and requests[0]["range"] is None, requests
    first, second = resume_offsets(requests)
    assert 0 < first <= cut and second == first, (first, second, cut)  # the unanswered request stored nothing
    log = _log_since(app, n_log)
    assert "sent no data for 2 s (the connection stalled)" in log, log
    assert "sent no response for 2 s (the connection stalled)" in log, log
    assert_cached_exactly(app, url, data, gguf_header=True)


def test_response_shorter_than_its_content_length_resumes(app, site, tiny_model, test_files):
    data = tiny_model
    path = serve_test_file(test_files, "short.gguf", data)
    site.add_fault(path, short_by=3000, pause_s=0.3)
    assert load_custom(app, site.url + path[1:]) == "header", notice(app)
    requests = site.requests_for(path)
    assert len(requests) == 2 and resume_offsets(requests) == [len(data) - 3000], requests
    assert_cached_exactly(app, site.url + path[1:], data, gguf_header=True)


def test_server_always_short_gives_up_with_a_message_and_load_resumes(app, site, tiny_model, test_files):
    """Every response 3000 bytes short: the first makes progress, the resumes bring nothing; after
    the automatic retries the page says what happened and that the bytes are kept. The partial
    entry is never marked complete, and Load (server fixed) resumes it to an identical file."""
    data = tiny_model
    path = serve_test_file(test_files, "alwaysshort.gguf", data)
    url = site.url + path[1:]
    for _ in range(8):
        site.add_fault(path, short_by=3000, pause_s=0.2)
    assert load_custom(app, url) == "error"
    n = notice(app)
    assert n["visible"] and n["kind"] == "download", n
    kept = len(data) - 3000
    assert f"{kept:,} of {len(data):,} bytes are kept: press Load to resume" in n["text"], n["text"]
    assert re.search(r"dropped|shorter than its Content-Length", n["text"]), n["text"]
    entry = audit_cache(app)[url]
    assert entry["complete"] is False and entry["stored"] == kept
    app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    assert app.get_attribute(f"#cache-list li[data-key='{url}']", "data-complete") == "0"
    site.faults.pop(path, None)  # the server is fixed
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert resume_offsets(site.requests_for(path)[n_requests:]) == [kept]
    assert_cached_exactly(app, url, data, gguf_header=True)


def test_http_503_once_is_retried_automatically(app, site, tiny_model, test_files):
    path = serve_test_file(test_files, "e503.gguf", tiny_model)
    site.add_fault(path, status=503)
    n_log = len(app.bitnet_log)
    assert load_custom(app, site.url + path[1:]) == "header", notice(app)
    assert len(site.requests_for(path)) == 2
    assert "HTTP 503" in _log_since(app, n_log) and "trying again in 0.5 s (retry 1)" in _log_since(app, n_log)
    assert_cached_exactly(app, site.url + path[1:], tiny_model, gguf_header=True)


def test_http_500_is_reported_and_nothing_is_cached(app, site, tiny_model, test_files):
    """A server that keeps failing: after the automatic retries the page says so."""
    path = serve_test_file(test_files, "e500.gguf", tiny_model)
    for _ in range(FAILING):
        site.add_fault(path, status=500)
    assert load_custom(app, site.url + path[1:]) == "error"
    n = notice(app)
    assert n["kind"] == "download" and "HTTP 500" in n["text"], n
    assert f"after {MAX_AUTO_RESUMES} automatic retries" in n["text"], n["text"]
    assert "kept" not in n["text"]
    assert len(site.requests_for(path)) == FAILING
    assert site.url + path[1:] not in audit_cache(app), "a failed download left a cache entry"
    site.faults.pop(path, None)


def test_http_404_is_not_retried(app, site, test_files):
    path = "/_test/e404-absent.gguf"
    assert load_custom(app, site.url + path[1:]) == "error"
    assert notice(app)["kind"] == "download" and "HTTP 404" in notice(app)["text"]
    assert len(site.requests_for(path)) == 1


def test_http_500_on_a_resume_keeps_the_partial_copy(app, site, tiny_model, test_files):
    data = tiny_model
    path = serve_test_file(test_files, "resume500.gguf", data)
    url = site.url + path[1:]
    site.add_fault(path, drop_after=len(data) // 2, reset=True, pause_s=0.5)
    for _ in range(FAILING):
        site.add_fault(path, status=500)
    assert load_custom(app, url) == "error"
    n = notice(app)
    assert n["kind"] == "download" and "HTTP 500" in n["text"], n
    entry = audit_cache(app)[url]
    assert entry["complete"] is False and 0 < entry["stored"] <= len(data) // 2
    assert f"{entry['stored']:,} of {len(data):,} bytes are kept: press Load to resume" in n["text"], n["text"]
    site.faults.pop(path, None)  # the server is fixed (a fault the retries did not reach is dropped)
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert resume_offsets(site.requests_for(path)[n_requests:]) == [entry["stored"]]
    assert_cached_exactly(app, url, data, gguf_header=True)


def test_html_page_answering_a_resume_keeps_the_partial_copy(app, site, tiny_model, test_files):
    """A captive portal (or a proxy's error page) answers the resume with 200 and HTML: the page
    says the URL returned HTML, and the bytes already stored are not thrown away for it."""
    data = tiny_model
    path = serve_test_file(test_files, "portal.gguf", data)
    url = site.url + path[1:]
    site.add_fault(path, drop_after=len(data) * 7 // 10, reset=True, pause_s=0.5)
    site.add_fault(path, body=b"<!DOCTYPE html><html><body>Sign in to the Wi-Fi</body></html>")
    assert load_custom(app, url) == "error"
    n = notice(app)
    assert n["kind"] == "not_gguf" and "HTML page" in n["text"], n
    entry = audit_cache(app)[url]
    assert entry["complete"] is False and 0 < entry["stored"] <= len(data) * 7 // 10
    n_requests = len(site.requests_for(path))
    assert load_custom(app, url) == "header", notice(app)
    assert resume_offsets(site.requests_for(path)[n_requests:]) == [entry["stored"]]
    assert_cached_exactly(app, url, data, gguf_header=True)


def test_truncated_file_dropped_before_its_header_was_read_is_not_cached(app, site, tiny_model, test_files):
    """The file on the server is cut (its Content-Length honest), and the connection drops before the
    header was parsed: the resumed download must still check the header against the file's size."""
    cut_file = tiny_model[: len(tiny_model) * 6 // 10]
    path = serve_test_file(test_files, "cut_early_drop.gguf", cut_file)
    site.add_fault(path, drop_after=len(cut_file) // 10, reset=True, pause_s=0.5)
    assert load_custom(app, site.url + path[1:]) == "error"
    n = notice(app)
    assert n["kind"] == "bad_model", n
    assert re.search(r"truncat|past the end|beyond|ends", n["text"], re.I), n["text"]
    assert site.url + path[1:] not in audit_cache(app), "a damaged file was left in the cache"
