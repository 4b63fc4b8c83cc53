"""build.py's server: single-range requests (download resume), If-Range, MIME types (no browser)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from site_server import build

# (header, size) -> expected (first, last) or None, written out from RFC 9110 14.1.2 by hand
RANGE_CASES = [
    ("bytes=0-9", 100, (0, 9)),
    ("bytes=90-", 100, (90, 99)),
    ("bytes=-10", 100, (90, 99)),
    ("bytes=-200", 100, (0, 99)),
    ("bytes=95-200", 100, (95, 99)),
    ("bytes=99-99", 100, (99, 99)),
    ("bytes=100-", 100, None),
    ("bytes=5-1", 100, None),
    ("bytes=-0", 100, None),
    ("bytes=0-1,5-6", 100, None),
    ("items=0-1", 100, None),
    ("bytes=a-b", 100, None),
    ("bytes=0-", 0, None),
]


@pytest.mark.parametrize(("header", "size", "expected"), RANGE_CASES)
def test_parse_range(header, size, expected):
    assert build.parse_range(header, size) == expected


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    data = np.random.default_rng(7).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    (root / "model.gguf").write_bytes(data)
    for name in ("a.mjs", "b.wasm", "c.json", "d.js"):
        (root / name).write_bytes(b"x")
    server = build.make_server(root, 0)
    build.DistRequestHandler.log_message = lambda *a: None
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/", data
    server.shutdown()
    server.server_close()


def get(url: str, headers: dict[str, str] | None = None, method: str = "GET"):
    req = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_whole_file(served):
    url, data = served
    status, headers, body = get(url + "model.gguf")
    assert status == 200 and body == data
    assert headers["Accept-Ranges"] == "bytes" and int(headers["Content-Length"]) == len(data)
    assert headers["Content-Type"] == "application/octet-stream"


@pytest.mark.parametrize("spec", ["bytes=1000-", "bytes=0-0", "bytes=-77", "bytes=299990-400000"])
def test_range_returns_exactly_those_bytes(served, spec):
    url, data = served
    first, last = build.parse_range(spec, len(data))
    status, headers, body = get(url + "model.gguf", {"Range": spec})
    assert status == 206
    assert body == data[first : last + 1]
    assert headers["Content-Range"] == f"bytes {first}-{last}/{len(data)}"
    assert int(headers["Content-Length"]) == last - first + 1


def test_if_range_with_current_etag_resumes_and_stale_etag_restarts(served):
    url, data = served
    _, headers, _ = get(url + "model.gguf", method="HEAD")
    status, _, body = get(url + "model.gguf", {"Range": "bytes=500-", "If-Range": headers["ETag"]})
    assert status == 206 and body == data[500:]
    status, _, body = get(url + "model.gguf", {"Range": "bytes=500-", "If-Range": '"stale"'})
    assert status == 200 and body == data


def test_unsatisfiable_range(served):
    url, data = served
    status, headers, _ = get(url + "model.gguf", {"Range": f"bytes={len(data)}-"})
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"


@pytest.mark.parametrize(
    ("name", "mime"),
    [
        ("a.mjs", "text/javascript"),
        ("b.wasm", "application/wasm"),
        ("c.json", "application/json"),
        ("d.js", "text/javascript"),
    ],
)
def test_mime_types(served, name, mime):
    url, _ = served
    _, headers, _ = get(url + name)
    assert headers["Content-Type"] == mime


def test_missing_file_is_404(served):
    url, _ = served
    assert get(url + "nope.gguf")[0] == 404
