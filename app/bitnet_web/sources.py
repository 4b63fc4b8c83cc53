"""Model download for the CLI (CPython): cached on disk, resumed with HTTP Range after an interruption.

The browser has its own downloader (web/worker/), which stores into IndexedDB; this one writes
`~/.cache/bitnet-web/models/<name>`, keeping a `.part` file until the size matches the server's.
"""

from __future__ import annotations

import hashlib
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


def download_to_cache(url: str, progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Return the local path of `url`, downloading (or resuming) it first if needed."""
    final = cached_path(url)
    if final.exists():
        return final
    part = final.with_name(final.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # already complete
            part.rename(final)
            return final
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
    part.rename(final)
    return final
