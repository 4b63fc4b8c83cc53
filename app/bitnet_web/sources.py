"""Model download for the CLI (CPython): cached on disk, resumed with HTTP Range after an interruption.

The browser has its own downloader (web/worker/), which stores into IndexedDB; this one writes
`~/.cache/bitnet-web/models/<name>`, keeping a `.part` file until the size matches the server's.
A file is checked before it is used, fresh or cached (an HTML page where a model was expected, a GGUF
whose header or size is wrong, a JSON file that does not parse): a bad one is deleted, never reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

CHUNK = 1 << 20


class DownloadError(RuntimeError):
    pass


def cache_dir() -> Path:
    root = os.environ.get("BITNET_WEB_CACHE") or Path.home() / ".cache" / "bitnet-web"
    path = Path(root) / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cached_path(url: str) -> Path:
    name = url.rstrip("/").rsplit("/", 1)[-1].split("?")[0] or "model.gguf"
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return cache_dir() / f"{digest}-{name}"


def _looks_like_html(head: bytes) -> bool:
    start = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    return start.startswith((b"<!doctype html", b"<html", b"<head", b"<body", b"<!--"))


def check_file(url: str, path: Path) -> str | None:
    """What is wrong with the downloaded `path` of `url`, or None when it is usable."""
    with open(path, "rb") as f:
        head = f.read(512)
    if _looks_like_html(head):
        return "the server sent an HTML page, not the file (a login or error page?)"
    name = url.split("?")[0].lower()
    if name.endswith(".gguf") or head.startswith(b"GGUF"):
        from .formats.ggml import GGUFError
        from .formats.gguf_reader import open_gguf

        try:
            open_gguf(str(path))  # the header parses and every tensor lies inside the file's size
        except GGUFError as exc:
            return f"not a complete GGUF file ({str(exc).removeprefix(str(path) + ': ')})"
    elif name.endswith(".json"):
        try:
            json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError) as exc:
            return f"not valid JSON ({exc})"
    return None


def download_to_cache(url: str, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Return the local path of `url`, downloading (or resuming) it first if needed.

    A cached copy that fails `check_file` is deleted and downloaded again; a fresh download that
    fails it is deleted and raises DownloadError."""
    final = cached_path(url)
    if final.exists():
        if check_file(url, final) is None:
            return final
        final.unlink()
    part = final.with_name(final.name + ".part")
    if part.exists():
        with open(part, "rb") as f:
            if _looks_like_html(f.read(512)):
                part.unlink()  # an error page is nothing to resume
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # already complete
            return _finish(url, part, final)
        raise DownloadError(f"downloading {url} failed: HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise DownloadError(f"downloading {url} failed: {exc}") from exc
    with response:
        if have and response.status != 206:
            have = 0  # the server ignored Range: start over
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else 0
        mode = "ab" if have else "wb"
        done = have
        last_report = 0.0
        with open(part, mode) as out:
            while True:
                try:
                    chunk = response.read(CHUNK)
                except OSError as exc:
                    raise DownloadError(
                        f"downloading {url} broke off after {done} bytes ({exc}); run again to resume"
                    ) from exc
                if not chunk:
                    break
                out.write(chunk)
                done += len(chunk)
                now = time.monotonic()
                if progress and now - last_report > 0.2:
                    progress("download", done, total)
                    last_report = now
    if total and done != total:
        raise DownloadError(f"downloading {url}: got {done} of {total} bytes; run again to resume")
    if progress:
        progress("download", done, total or done)
    return _finish(url, part, final)


def _finish(url: str, part: Path, final: Path) -> Path:
    problem = check_file(url, part)
    if problem is not None:
        part.unlink()
        raise DownloadError(f"downloading {url}: {problem}; the download was discarded")
    part.rename(final)
    return final
