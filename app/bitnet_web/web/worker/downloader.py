"""Fetching a model into the IndexedDB cache: streamed, chunked, resumable, checked early.

One `ModelDownloader.ensure_cached(model)` call ends with a complete cache entry or a typed error:
- the stream is written to `ModelStore` in CHUNK_BYTES pieces as it arrives (never one big buffer);
- the first bytes must be the GGUF magic, and the header is parsed as soon as it has arrived, so a
  web page, a truncated file or a lying length is reported before gigabytes are fetched;
- a dropped connection or a short response resumes with `Range: bytes=<stored>-` (and `If-Range`
  so a changed file restarts instead of splicing two versions); a server that ignores Range
  restarts from zero; a few automatic retries, then a message saying Load resumes;
- a connection that stalls (no response, or no body bytes, for STALL_TIMEOUT_S) is ended and resumed
  the same way, rather than waiting forever on a server that never answers or closes; an answer that
  says "try again" (RETRY_STATUSES: 5xx, 408, 429) is retried the same way too;
- the expected size (model list) and the server's length must agree; SHA-256 per chunk is kept
  for the read-back check in `ModelStore.read_into`;
- nothing already stored is thrown away on the word of a response that is not a model: a resume
  answered with the whole file (200) replaces the partial copy only once its first bytes are the
  GGUF magic (a captive portal's or proxy's HTML page leaves the partial copy as it was);
- a resume that starts before the header was parsed re-reads the stored prefix, so every GGUF entry
  is marked complete only with a parsed header whose tensors end within the file;
- `cancel()` (Cancel, or Delete in the cache manager) ends the transfer with DownloadCancelled;
  writes to an entry deleted meanwhile (any tab) fail with model_store.EntryDeletedError.

Model format "raw" (a checkpoint's JSON and safetensors files, web/worker/checkpoint_downloader.py): no GGUF checks.

Test hooks (browser tests set them in the worker with Playwright's Worker.evaluate):
`self.bitnetWebTestHooks = {chunkBytes: N}` stores chunks of N bytes (multi-chunk files from small
test models); `stallTimeoutS: S` replaces STALL_TIMEOUT_S;
`skipEngine: true` makes the worker stop after the cache is verified (see worker.py).

The pure helpers (`parse_content_range`, `describe_non_gguf`, `is_strong_etag`, `kept_text`) are
tested under CPython; the rest runs in the worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

CHUNK_BYTES = 16 * 1024 * 1024
HEADER_LIMIT = 256 * 1024 * 1024  # a header (vocabulary + merges) beyond this is refused
MAX_AUTO_RESUMES = 4
RESUME_BACKOFF_S = (0.5, 1.0, 2.0, 4.0)
PROGRESS_EVERY_S = 0.1
# Seconds without a response or a body byte before a transfer counts as stalled (ended and resumed).
# Long enough for a slow link's next TCP segment and a server busy starting a large file.
STALL_TIMEOUT_S = 30.0
# HTTP statuses of a server or CDN that may answer the same request differently a moment later.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class DownloadError(Exception):
    """The model could not be fetched: HTTP status, network failure, size mismatch."""

    failure_kind = "download"


class NotGGUFError(Exception):
    """The URL answered with something that is not a GGUF file (e.g. an HTML page)."""

    failure_kind = "not_gguf"


class DownloadCancelled(Exception):
    """The load was cancelled (kind "cancelled"), or its cache entry deleted (kind "deleted")."""

    failure_kind = "cancelled"

    def __init__(self, message: str, kind: str = "cancelled") -> None:
        super().__init__(message)
        self.failure_kind = kind


class QuotaError(Exception):
    failure_kind = "quota"


class _Interrupted(Exception):
    """The transfer stopped early; resumable."""


class ContentRange(NamedTuple):
    first: int
    last: int
    total: int | None


def parse_content_range(value: str | None) -> ContentRange | None:
    """`bytes 100-199/1000` (or `/*`) -> ContentRange; None when absent or malformed."""
    if not value:
        return None
    unit, _, rest = value.strip().partition(" ")
    span, _, total_s = rest.partition("/")
    first_s, _, last_s = span.partition("-")
    if unit.lower() != "bytes":
        return None
    try:
        first, last = int(first_s), int(last_s)
        total = None if total_s.strip() == "*" else int(total_s)
    except ValueError:
        return None
    if first < 0 or last < first or (total is not None and last >= total):
        return None
    return ContentRange(first, last, total)


def is_strong_etag(etag: str | None) -> bool:
    """Only strong validators may be used in If-Range (RFC 9110 13.1.5)."""
    return bool(etag) and not etag.startswith("W/") and etag.startswith('"')


def describe_non_gguf(first_bytes: bytes, content_type: str | None, url: str) -> str:
    """Why a response is not a model, in words: what it starts with and what the server called it."""
    head = first_bytes[:64]
    printable = "".join(chr(b) if 32 <= b < 127 else "." for b in head)
    looks_html = head.lstrip().lower().startswith((b"<!doctype", b"<html", b"<"))
    kind = (
        "an HTML page"
        if looks_html or (content_type or "").startswith("text/html")
        else f"content of type {content_type}"
        if content_type
        else "data"
    )
    return (
        f"{url} returned {kind}, not a GGUF model: the first bytes are {printable[:24]!r} "
        f"(a GGUF file starts with 'GGUF')"
    )


def kept_text(stored: int, total: int | None) -> str:
    """The sentence that tells a person a partial download is kept and how to continue it."""
    if stored <= 0:
        return ""
    of = f" of {total:,}" if total else ""
    return f" {stored:,}{of} bytes are kept: press Load to resume."


def testing_hooks() -> dict[str, Any]:
    """The test hooks set in this context's global scope (`self.bitnetWebTestHooks`), or {}."""
    import js

    hooks = getattr(js.self, "bitnetWebTestHooks", None)
    if hooks is None or not hasattr(hooks, "to_py"):
        return {}
    value = hooks.to_py()
    return value if isinstance(value, dict) else {}


def content_length(headers: Any) -> int | None:
    """Content-Length when it is the length of the body we will read (not when compressed)."""
    if headers.get("Content-Encoding") not in (None, "", "identity"):
        return None
    value = headers.get("Content-Length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class ModelDownloader:
    """Fills a `ModelStore` entry from the network. Events go to `emit(dict)`.

    `chunk_bytes`: the size of the stored chunks (default CHUNK_BYTES, or the chunkBytes test hook)."""

    def __init__(self, store: Any, emit: Callable[[dict], None], chunk_bytes: int | None = None) -> None:
        self.store = store
        self.emit = emit
        hooks = testing_hooks()
        self.chunk_bytes = max(1024, int(chunk_bytes or hooks.get("chunkBytes") or CHUNK_BYTES))
        self.stall_timeout_s = float(hooks.get("stallTimeoutS") or STALL_TIMEOUT_S)
        self.cancel_requested = False
        self._cancel_message = "download cancelled; press Load to resume"
        self._cancel_kind = "cancelled"
        self._reader = None
        self._request = None  # the AbortController of the request in flight
        self._last_progress = 0.0

    def cancel(self, message: str | None = None, kind: str = "cancelled") -> None:
        """Stop the transfer; the load ends with DownloadCancelled(message) of failure kind `kind`."""
        self.cancel_requested = True
        if message:
            self._cancel_message, self._cancel_kind = message, kind
        if self._reader is not None:
            _cancel_quietly(self._reader)
        if self._request is not None:  # a request still waiting for its response
            self._request.abort()

    def _cancelled(self) -> DownloadCancelled:
        return DownloadCancelled(self._cancel_message, self._cancel_kind)

    async def ensure_cached(self, model: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """(complete meta, "cache" | "network") for `model` = {key, url, name, size, sha256}.

        Holds a Web Lock on the model's key: a second tab loading the same model waits for the
        first to finish and then finds it cached, instead of writing the same entry at once."""
        from ..shared.jsutil import WebLock

        def waiting() -> None:
            self.emit({"event": "log", "message": "another tab is downloading this model: waiting for it"})

        async with WebLock("bitnet-web-model:" + model["key"], on_wait=waiting):
            if self.cancel_requested:  # cancelled (or deleted) while waiting for the other tab
                raise self._cancelled()
            try:
                return await self._ensure_cached(model)
            except BaseException:
                try:
                    meta = await self.store.get(model["key"])
                    if meta is not None and not meta.get("complete") and not meta.get("stored"):
                        await self.store.delete(model["key"])  # nothing arrived: leave no empty entry
                except Exception:
                    pass  # the original failure is the one to report
                raise

    async def _ensure_cached(self, model: dict[str, Any]) -> tuple[dict[str, Any], str]:
        key = model["key"]
        meta = await self.store.get(key)
        if meta is not None:
            await self._drop_uncounted(meta)
        if meta is not None and meta.get("complete"):
            return meta, "cache"
        if meta is None or int(meta.get("stored") or 0) == 0:
            meta = await self.store.begin(
                key, url=model["url"], name=model.get("name") or key, sha256=model.get("sha256")
            )
        elif meta.get("stored"):
            self.emit(
                {"event": "log", "message": f"resuming the download of {meta['name']} at byte {meta['stored']:,}"}
            )
        if meta.get("header"):
            self.emit({"event": "header", "info": meta["header"]})
        attempts = 0
        while True:
            received_before = int(meta["stored"])
            try:
                await self._transfer(model, meta)
                if meta["total"] is None:
                    meta["total"] = meta["stored"]  # no length given: what arrived is the file
                if meta["stored"] == meta["total"]:
                    break
                raise _Interrupted(
                    f"the response ended at byte {meta['stored']:,} of {meta['total']:,} "
                    "(shorter than its Content-Length)"
                )
            except _Interrupted as e:
                attempts += 1
                if int(meta["stored"]) > received_before:
                    attempts = min(attempts, 1)  # progress was made: the retry budget starts again
                stored = int(meta["stored"])
                if attempts > MAX_AUTO_RESUMES:
                    raise DownloadError(
                        f"{e} (after {MAX_AUTO_RESUMES} automatic retries).{kept_text(stored, meta['total'])}"
                    ) from None
                delay = RESUME_BACKOFF_S[min(attempts - 1, len(RESUME_BACKOFF_S) - 1)]
                again = f"resuming at byte {stored:,}" if stored else "trying again"
                self.emit({"event": "log", "message": f"{e}; {again} in {delay:g} s (retry {attempts})"})
                from ..shared.jsutil import sleep_promise

                await sleep_promise(delay)
                if self.cancel_requested:
                    raise self._cancelled() from None
        await self._check_tensor_data(model, meta)
        meta["complete"] = True
        await self.store.put_meta(meta)
        return meta, "network"

    async def _drop_uncounted(self, meta: dict[str, Any]) -> None:
        """Chunks beyond the record's count are not part of the file: removed before it is used."""
        dropped = await self.store.drop_uncounted(meta["key"])
        if dropped:
            self.emit(
                {
                    "event": "log",
                    "message": f"removed {dropped} stored chunk(s) of {meta['name']} that its "
                    "cache record does not count (left by an interrupted write)",
                }
            )

    async def _check_tensor_data(self, model: dict[str, Any], meta: dict[str, Any]) -> None:
        """A GGUF entry is complete only with a parsed header whose tensor data lies within the file
        (checked early when the length was known; a response without one is checked here)."""
        if model.get("format") == "raw":
            return
        data_end = meta.get("data_end")
        if meta.get("header") is not None and (data_end is None or int(data_end) <= int(meta["stored"])):
            return
        from ...formats.ggml import GGUFTruncatedError

        await self.store.delete(meta["key"])  # a damaged file: nothing of it is worth keeping
        if meta.get("header") is None:
            raise GGUFTruncatedError(
                f"{meta['url']}: the GGUF header could not be read from the {int(meta['stored']):,} bytes received"
            )
        raise GGUFTruncatedError(
            f"{meta['url']} ends at byte {int(meta['stored']):,} but its tensor data "
            f"reaches byte {int(data_end):,}: the file is truncated"
        )

    async def _transfer(self, model: dict[str, Any], meta: dict[str, Any]) -> None:
        """One HTTP request continuing `meta` from `meta["stored"]`."""
        import js
        from pyodide.ffi import JsException

        from ..shared.jsutil import error_message, js_obj

        url = model["url"]
        start = int(meta["stored"])
        headers: dict[str, str] = {}
        if start > 0:
            headers["Range"] = f"bytes={start}-"
            validator = meta.get("etag") if is_strong_etag(meta.get("etag")) else meta.get("last_modified")
            if validator:
                headers["If-Range"] = validator
        request = self._request = js.AbortController.new()  # ends a request that stalls or is cancelled
        try:
            resp = await self._within_stall_timeout(
                js.fetch(url, js_obj({"headers": js_obj(headers), "cache": "no-store", "signal": request.signal})),
                f"{_host(url)} sent no response",
                lambda: request.abort(),
            )
        except JsException as e:
            if self.cancel_requested:
                raise self._cancelled() from None
            text = (
                f"could not connect to {_host(url)} ({error_message(e)}: the server is unreachable, "
                "the browser is offline, or the server does not allow cross-origin requests)"
            )
            if start == 0:
                raise DownloadError(text) from None  # nothing to resume: say so at once
            raise _Interrupted(text) from None
        status = int(resp.status)
        if status == 416 and start > 0:
            if meta.get("total") == start:
                return  # everything was already stored
            # the server's copy has fewer bytes than the partial one: it changed, so the partial
            # copy belongs to another version of the file
            self.emit(
                {
                    "event": "log",
                    "message": f"{_host(url)} has no bytes from {start:,} on (HTTP 416: "
                    "the file changed): downloading from the start",
                }
            )
            fresh = await self.store.begin(meta["key"], url=meta["url"], name=meta["name"], sha256=meta.get("sha256"))
            meta.clear()
            meta.update(fresh)
            raise _Interrupted(f"{url} changed on the server")
        if status not in (200, 206):
            answer = f"HTTP {status} {resp.statusText or ''}".rstrip() + f" from {_host(url)} for {url}"
            if status in RETRY_STATUSES:
                raise _Interrupted(answer)  # retried after a pause, then reported with what is kept
            raise DownloadError(f"{answer}.{kept_text(start, meta.get('total'))}")
        total: int | None
        restart = False
        if status == 206:
            cr = parse_content_range(resp.headers.get("Content-Range"))
            if cr is None or cr.first != start:
                raise DownloadError(
                    f"{_host(url)} answered a request for bytes from {start:,} with "
                    f"Content-Range {resp.headers.get('Content-Range')!r}"
                )
            total = cr.total
            if meta.get("total") is not None and total is not None and total != meta["total"]:
                raise DownloadError(
                    f"{url} changed size during the download ({meta['total']:,} -> "
                    f"{total:,} bytes); delete the partial copy and load again"
                )
        else:
            total = content_length(resp.headers)
            restart = start > 0
        expected = model.get("size")
        if expected and total is not None and total != expected:
            raise DownloadError(
                f"{url} is {total:,} bytes but the model list says {expected:,}: a different or damaged file"
            )
        fields = {"total": total, "etag": resp.headers.get("ETag"), "last_modified": resp.headers.get("Last-Modified")}
        if total is not None:
            await _check_quota(total - start)
        if restart:
            self.emit(
                {
                    "event": "log",
                    "message": f"{_host(url)} ignored the range request (or the file "
                    "changed): downloading from the start",
                }
            )
        else:
            meta.update(fields)
            await self.store.put_meta(meta)
        if resp.body is None:
            raise DownloadError(f"{url}: the response has no body")
        await self._stream(
            resp, meta, model, content_type=resp.headers.get("Content-Type"), restart_fields=fields if restart else None
        )

    async def _begin_again(self, meta: dict[str, Any], fields: dict[str, Any]) -> None:
        """Replace the partial copy with a fresh entry (the server sent the whole file again)."""
        fresh = await self.store.begin(meta["key"], url=meta["url"], name=meta["name"], sha256=meta.get("sha256"))
        meta.clear()
        meta.update(fresh)
        meta.update(fields)
        await self.store.put_meta(meta)

    async def _stream(
        self,
        resp: Any,
        meta: dict[str, Any],
        model: dict[str, Any],
        content_type: str | None,
        restart_fields: dict[str, Any] | None = None,
    ) -> None:
        """Read the body into chunks. `restart_fields`: the response is the whole file although a
        partial copy exists; that copy is replaced (with these fields) once the magic is checked."""
        import js
        from pyodide.ffi import JsException

        from ..shared.jsutil import error_message

        # format "raw" (a checkpoint's JSON and safetensors files, web/worker/checkpoint_downloader.py): no GGUF checks
        gguf = model.get("format") != "raw"
        pending = restart_fields
        if pending is not None and not gguf:
            await self._begin_again(meta, pending)
            pending = None
        reader = resp.body.getReader()
        self._reader = reader
        chunk_bytes = self.chunk_bytes
        chunk = js.Uint8Array.new(chunk_bytes)  # a fresh ArrayBuffer per chunk: stored without a copy
        fill = 0
        header_wanted = gguf and (pending is not None or not meta.get("header"))
        prefix = bytearray()
        try:
            if header_wanted and pending is None and int(meta["stored"]) > 0:
                # resuming before the header was parsed: continue from the stored bytes
                prefix.extend(await self._stored_prefix(meta))
            next_parse = max(64 * 1024, len(prefix))
            while True:
                if self.cancel_requested:
                    raise self._cancelled()
                try:
                    result = await self._within_stall_timeout(
                        reader.read(), f"{_host(meta['url'])} sent no data", lambda: _cancel_quietly(reader)
                    )
                except JsException as e:
                    if self.cancel_requested:
                        raise self._cancelled() from None
                    raise _Interrupted(f"the connection to {_host(meta['url'])} dropped ({error_message(e)})") from None
                if result.done:
                    break
                piece = result.value
                n = int(piece.length)
                total = pending["total"] if pending is not None else meta["total"]
                if header_wanted:
                    room = HEADER_LIMIT - len(prefix)
                    if room > 0:
                        prefix.extend(piece.subarray(0, min(n, room)).to_bytes())
                    if len(prefix) >= 4 and bytes(prefix[:4]) != b"GGUF":
                        raise NotGGUFError(describe_non_gguf(bytes(prefix), content_type, meta["url"]))
                    if pending is not None and len(prefix) >= 4:
                        await self._begin_again(meta, pending)
                        pending = None
                    if pending is None and (
                        len(prefix) >= next_parse
                        or len(prefix) >= HEADER_LIMIT
                        or (total is not None and len(prefix) >= total)
                    ):
                        header_wanted = not await self._try_header(prefix, meta)
                        next_parse = len(prefix) * 2
                pos = 0
                while pos < n:
                    take = min(n - pos, chunk_bytes - fill)
                    chunk.set(piece.subarray(pos, pos + take), fill)
                    fill += take
                    pos += take
                    if fill == chunk_bytes and pending is None:
                        await self.store.append_chunk(meta, chunk.buffer)
                        chunk = js.Uint8Array.new(chunk_bytes)
                        fill = 0
                done = (0 if pending is not None else int(meta["stored"])) + fill
                if total is not None and done > total:
                    raise DownloadError(f"{meta['url']} sent more bytes than its length {total:,}")
                self._progress(done, total)
            if self.cancel_requested:  # a cancelled reader ends like a finished body
                raise self._cancelled()
            if pending is not None:  # fewer than 4 bytes: not the model either
                raise NotGGUFError(describe_non_gguf(bytes(prefix), content_type, meta["url"]))
            complete = meta["total"] is None or int(meta["stored"]) + fill == meta["total"]
            if header_wanted and complete:
                await self._try_header(prefix, meta, final=True)
        except BaseException as e:
            _cancel_quietly(reader)
            if pending is not None:
                raise  # nothing of this response was stored: the partial copy stays as it was
            if isinstance(e, NotGGUFError) or _is_header_error(e):
                await self.store.delete(meta["key"])  # a damaged file: nothing of it is worth keeping
            elif fill and isinstance(e, (DownloadCancelled, _Interrupted)):
                await self.store.append_chunk(meta, chunk.slice(0, fill).buffer)  # resume after it
            raise
        finally:
            self._reader = None
        if fill:
            await self.store.append_chunk(meta, chunk.slice(0, fill).buffer)
        self._progress(int(meta["stored"]), meta["total"], force=True)

    async def _stored_prefix(self, meta: dict[str, Any]) -> bytes:
        from .store import CorruptEntryError

        try:
            return await self.store.read_prefix(meta, HEADER_LIMIT)
        except CorruptEntryError as e:
            fresh = await self.store.begin(meta["key"], url=meta["url"], name=meta["name"], sha256=meta.get("sha256"))
            meta.clear()
            meta.update(fresh)
            raise _Interrupted(f"{e}: downloading from the start") from None

    async def _try_header(self, prefix: bytearray, meta: dict[str, Any], final: bool = False) -> bool:
        """Parse the header from the bytes so far; True once parsed (and announced)."""
        import numpy as np

        from ...formats.ggml import GGUFTruncatedError
        from ...formats.gguf_reader import parse_header
        from ..shared.modelinfo import header_info

        data = np.frombuffer(bytes(prefix), dtype=np.uint8)
        gguf = parse_header(data, meta["total"])
        if gguf is None:
            if final or len(prefix) >= HEADER_LIMIT:
                limit = "the end of the file" if final else f"{HEADER_LIMIT:,} bytes"
                raise GGUFTruncatedError(f"the GGUF header does not end within {limit} ({len(prefix):,} bytes read)")
            return False
        info = header_info(gguf, meta["total"])
        meta["header"] = info
        # where the last tensor's data ends: checked against the final size when the length was unknown
        meta["data_end"] = max((t.offset + t.n_bytes for t in gguf.tensors.values()), default=gguf.header_size)
        self.emit({"event": "header", "info": info})
        return True

    async def _within_stall_timeout(self, promise: Any, what: str, end_request: Callable[[], None]) -> Any:
        """The value of the JS `promise`, or _Interrupted (resumable) when it has not settled after
        `stall_timeout_s`: `end_request()` then ends the request, so its promise settles too."""
        import asyncio

        async def settled() -> Any:
            return await promise

        waiting = asyncio.ensure_future(settled())
        done, _ = await asyncio.wait([waiting], timeout=self.stall_timeout_s)
        if waiting in done:
            return waiting.result()
        waiting.add_done_callback(lambda task: task.cancelled() or task.exception())  # outcome seen
        end_request()
        if self.cancel_requested:
            raise self._cancelled()
        raise _Interrupted(f"{what} for {self.stall_timeout_s:g} s (the connection stalled)")

    def _progress(self, done: int, total: int | None, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.emit({"event": "progress", "phase": "download", "done": done, "total": total})


def _cancel_quietly(reader: Any) -> None:
    import js

    try:
        # a cancel that fails is worth a debug line, not an "unhandled rejection" error
        reader.cancel().catch(js.console.debug)
    except Exception:
        pass


def _is_header_error(e: BaseException) -> bool:
    return any(c.__name__ == "GGUFError" for c in type(e).__mro__)


async def _check_quota(needed: int) -> None:
    import js

    storage = getattr(js.navigator, "storage", None)
    if storage is None or not hasattr(storage, "estimate"):
        return
    est = await storage.estimate()
    quota, usage = getattr(est, "quota", None), getattr(est, "usage", None)
    if quota is None or usage is None:
        return
    free = int(quota) - int(usage)
    if needed > free:
        from ..shared.progress import format_bytes

        raise QuotaError(
            f"the model needs {format_bytes(needed)} more of browser storage but only "
            f"{format_bytes(max(0, free))} is available (quota {format_bytes(int(quota))})"
        )


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(url).netloc or url
