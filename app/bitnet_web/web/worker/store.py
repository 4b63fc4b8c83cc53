"""The IndexedDB model cache: a model file stored as numbered chunks plus one metadata record.

Database "bitnet-web-models" (version 1):
  models  keyPath "key" (the model's absolute URL):
          {key, url, name, total (bytes or null while unknown), stored (bytes committed),
           chunks (count), complete (bool), etag, last_modified, sha256 (expected, or null),
           header (model info from the GGUF header, or null), created, updated}
  chunks  keyPath ["key", "index"]:
          {key, index, offset, size, sha256 (hex of this chunk), data (Blob; ArrayBuffer in entries
          written before session 6, still read)}

Why chunks: a 1.2 GB file never exists as one ArrayBuffer in the page; each chunk is written as it
arrives, so an interrupted download keeps what it got and resumes with a Range request.
Consistency: a chunk and the metadata update that counts it are written in one transaction, so
`stored` never counts bytes that are not there, a chunk is never there uncounted, and `complete` is
set only after the last chunk. The record is the truth: readers take chunks 0..chunks-1 only, and
`drop_uncounted` (run before an entry is resumed or read) deletes any chunk beyond its count, as a
copy written in two steps by another build and cut between them could hold.
Deletes: every update of an existing entry (`append_chunk`, `put_meta`) first reads the entry's
record in the same transaction and writes only if it is still the one `begin` created (same
`created` stamp); otherwise it raises EntryDeletedError. So a delete from the cache manager, in
this tab or another, can never be undone by a download still running: no entry is left with
chunks missing, and none is marked complete after it was deleted.
Every chunk is checked when it is read back, so storage damage is found and the entry re-fetched
instead of loading damaged weights: against its `check` (checksum.chunk_checksum, computed by numpy
over the bytes just copied into wasm memory), or, in chunks stored by builds before it, against its
SHA-256 (WebCrypto: 1.2 GB read back in 3.1 s with it, 1.25 s without, on the H100 machine; such an
entry is rewritten with checks after its first load, `upgrade_chunks`). Each chunk also keeps its
SHA-256, written when it was downloaded.
Why Blob values: Chromium reads a Blob value back (get + arrayBuffer()) about 3x faster than an
ArrayBuffer value of the same size (1.9 against 0.6 GB/s on the H100 machine, static/bench/storage.html;
docs/performance.md), which is most of the time a cached model takes to load.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any

import js
from pyodide.ffi import JsException, JsProxy, create_once_callable, create_proxy

from ..shared.jsutil import error_message, error_name, js_obj, sha256_hex
from .checksum import chunk_checksum

DB_NAME = "bitnet-web-models"
DB_VERSION = 1
META = "models"
CHUNKS = "chunks"
READ_AHEAD = 4  # chunks being read at once while loading (16 MB each by default)


class StoreError(Exception):
    """An IndexedDB operation failed; `name` is the DOMException name (e.g. QuotaExceededError)."""

    def __init__(self, op: str, name: str, message: str) -> None:
        super().__init__(f"browser storage ({op}): {name}: {message}")
        self.name = name
        self.failure_kind = "quota" if name == "QuotaExceededError" else "storage"


class CorruptEntryError(Exception):
    """A stored chunk is missing or its SHA-256 does not match: the entry must be re-fetched."""


class EntryDeletedError(Exception):
    """The entry was deleted (or deleted and begun again) while this writer or reader used it."""

    failure_kind = "deleted"


def _now() -> float:
    return time.time()


class ModelStore:
    def __init__(self, db: JsProxy) -> None:
        self._db = db

    @classmethod
    async def open(cls) -> ModelStore:
        if not hasattr(js, "indexedDB") or js.indexedDB is None:
            raise StoreError("open", "NotSupportedError", "this browser context has no IndexedDB")
        req = js.indexedDB.open(DB_NAME, DB_VERSION)

        def upgrade(event):
            db = req.result
            names = db.objectStoreNames
            if not names.contains(META):
                db.createObjectStore(META, js_obj({"keyPath": "key"}))
            if not names.contains(CHUNKS):
                db.createObjectStore(CHUNKS, js_obj({"keyPath": ["key", "index"]}))

        on_upgrade = create_proxy(upgrade)
        req.onupgradeneeded = on_upgrade
        try:
            await _request(req, "open")
        finally:
            req.onupgradeneeded = None
            on_upgrade.destroy()
        return cls(req.result)

    # -- metadata ---------------------------------------------------------------------------------

    async def entries(self) -> list[dict[str, Any]]:
        tx = self._db.transaction(META, "readonly")
        req = tx.objectStore(META).getAll()
        await _request(req, "list")
        return [_meta_to_py(m) for m in req.result]

    async def get(self, key: str) -> dict[str, Any] | None:
        tx = self._db.transaction(META, "readonly")
        req = tx.objectStore(META).get(key)
        await _request(req, "get")
        return None if req.result is None or str(req.result) == "undefined" else _meta_to_py(req.result)

    async def put_meta(self, meta: dict[str, Any]) -> None:
        """Save an entry's record. A record made by `begin` (it has `created`) is only updated while
        that entry exists: if it was deleted meanwhile, EntryDeletedError (nothing is written)."""
        meta = {**meta, "updated": _now()}
        if meta.get("created") is None:
            await self._put_record(meta)
        else:
            await self._write_if_current(meta, None, "save model record")

    async def _put_record(self, meta: dict[str, Any]) -> None:
        tx = self._db.transaction(META, "readwrite")
        _put(tx, META, meta)
        await _transaction(tx, "save model record")

    async def _write_if_current(
        self, meta: dict[str, Any], chunk: dict[str, Any] | None, op: str, write_meta: bool = True
    ) -> None:
        """Write `meta` (unless not `write_meta`) and `chunk` in one transaction that first checks
        the stored record is still meta's entry (same key and `created`): the check and the writes
        cannot be separated by a delete, because they share the transaction."""
        tx = self._db.transaction([META, CHUNKS] if chunk is not None else META, "readwrite")
        gone = False

        def write(current: JsProxy | None) -> None:
            nonlocal gone
            if current is None or getattr(current, "created", None) != meta["created"]:
                gone = True
                tx.abort()
                return
            if chunk is not None:
                _put(tx, CHUNKS, chunk)
            if write_meta:
                _put(tx, META, meta)

        try:
            await _transaction_after_read(tx, tx.objectStore(META).get(meta["key"]), op, write)
        except StoreError:
            if gone:
                raise EntryDeletedError(
                    f"{meta['key']} was deleted from browser storage while it was being "
                    "written (Delete in this or another tab)"
                ) from None
            raise

    async def begin(self, key: str, **fields: Any) -> dict[str, Any]:
        """A fresh, empty entry for `key` (any older chunks of that key are deleted first)."""
        await self.delete(key)
        meta = {
            "key": key,
            "url": key,
            "name": key,
            "total": None,
            "stored": 0,
            "chunks": 0,
            "complete": False,
            "etag": None,
            "last_modified": None,
            "sha256": None,
            "header": None,
            "created": _now(),
            "updated": _now(),
            **fields,
        }
        await self._put_record(meta)
        return meta

    async def delete(self, key: str) -> None:
        tx = self._db.transaction([META, CHUNKS], "readwrite")
        tx.objectStore(META).delete(key)
        tx.objectStore(CHUNKS).delete(js.IDBKeyRange.bound(js_obj([key, 0]), js_obj([key, float("inf")])))
        await _transaction(tx, "delete")

    async def drop_uncounted(self, key: str) -> int:
        """Delete the chunks of `key` that its record does not count (all of them when there is no
        record); returns how many there were. Record and chunks are read and changed in one
        transaction, so a writer can never slip a counted chunk in between."""
        tx = self._db.transaction([META, CHUNKS], "readwrite")
        dropped: list[JsProxy] = []

        def drop(current: JsProxy | None) -> None:
            counted = 0 if current is None else int(current.chunks)
            beyond = js.IDBKeyRange.bound(js_obj([key, counted]), js_obj([key, float("inf")]))
            chunks = tx.objectStore(CHUNKS)
            dropped.append(chunks.count(beyond))  # requests run in order: counted before the delete
            chunks.delete(beyond)

        await _transaction_after_read(tx, tx.objectStore(META).get(key), "remove uncounted chunks", drop)
        return int(dropped[0].result) if dropped else 0

    # -- chunks -----------------------------------------------------------------------------------

    async def append_chunk(self, meta: dict[str, Any], data: JsProxy) -> dict[str, Any]:
        """Store `data` (an ArrayBuffer) as the next chunk (a Blob) and count it in `meta`,
        atomically. Returns the updated meta (the caller's dict is updated too)."""
        size = int(data.byteLength)
        digest = await sha256_hex(data)  # before the transaction: an await inside would commit it
        index = int(meta["chunks"])
        record = _chunk_record(meta["key"], index, int(meta["stored"]), size, digest, _checksum_of(data), data)
        meta["chunks"] = index + 1
        meta["stored"] = int(meta["stored"]) + size
        meta["updated"] = _now()
        try:
            await self._write_if_current(meta, record, f"write chunk {index}")
        except BaseException:
            meta["chunks"] = index
            meta["stored"] = int(meta["stored"]) - size
            raise
        return meta

    async def read_into(self, meta: dict[str, Any], out: Any, progress=None, timings: dict | None = None) -> None:
        """Copy every chunk of a complete entry into `out` (a writable uint8 buffer of meta's total
        size), checking offsets, sizes and each chunk's bytes. `progress(done, total)` is called
        after each chunk is in `out` (chunks land in order); an exception it raises ends the read.

        READ_AHEAD chunks are read at once, each in its own transaction. A chunk is checked against
        its `check` right after it is copied into `out`, or, an older build's chunk without one,
        against its SHA-256 before (CorruptEntryError names the chunk). `timings` (if given) gets
        the seconds this coroutine waited for chunks, spent copying and checking, and spent on
        SHA-256s."""
        mv = memoryview(out).cast("B")
        total = int(meta["total"])
        if len(mv) != total:
            raise ValueError(f"output buffer has {len(mv)} bytes, the entry {total}")
        n_chunks = int(meta["chunks"])
        pending: collections.deque[asyncio.Task] = collections.deque()
        wait_s = copy_s = hash_s = 0.0

        def fetch_next() -> None:
            index = len(pending) + fetched[0]
            if index < n_chunks:
                pending.append(asyncio.ensure_future(self._fetch_chunk(meta["key"], index)))

        def damaged(index: int, offset: int, size: int, what: str) -> CorruptEntryError:
            return CorruptEntryError(
                f"chunk {index} of {meta['key']} (bytes {offset}-{offset + size - 1}) "
                f"does not match its {what}: the stored copy is damaged"
            )

        fetched = [0]  # chunks taken from the front of `pending`
        try:
            for _ in range(min(READ_AHEAD, n_chunks)):
                fetch_next()
            offset = 0
            for index in range(n_chunks):
                t0 = time.perf_counter()
                rec, data = await pending.popleft()
                fetched[0] += 1
                fetch_next()
                t1 = time.perf_counter()
                wait_s += t1 - t0
                if rec is None:
                    await self._raise_if_deleted(meta)
                    raise CorruptEntryError(f"chunk {index} of {meta['key']} is missing from browser storage")
                if data is None:
                    raise CorruptEntryError(
                        f"chunk {index} of {meta['key']} has no readable data in browser storage "
                        "(neither a Blob nor an ArrayBuffer, or its Blob's file is gone)"
                    )
                size = int(rec.size)
                if int(rec.offset) != offset or int(data.byteLength) != size or offset + size > total:
                    raise CorruptEntryError(
                        f"chunk {index} of {meta['key']} has offset {int(rec.offset)} and "
                        f"{int(data.byteLength)} bytes; expected offset {offset} and {size} bytes"
                    )
                view = mv[offset : offset + size]
                check = _stored_check(rec)
                if check is None:  # an older build's chunk (upgrade_chunks rewrites it after this load)
                    if await sha256_hex(data) != str(rec.sha256):
                        raise damaged(index, offset, size, "SHA-256")
                    hash_s += time.perf_counter() - t1
                    t1 = time.perf_counter()
                    js.Uint8Array.new(data).assign_to(view)
                else:
                    js.Uint8Array.new(data).assign_to(view)
                    if chunk_checksum(view) != check:
                        raise damaged(index, offset, size, "checksum")
                offset += size
                del rec, data, view
                copy_s += time.perf_counter() - t1
                if progress is not None:
                    progress(offset, total)
            if offset != total:
                raise CorruptEntryError(f"{meta['key']}: chunks hold {offset} bytes, the file has {total}")
        finally:
            # A failure or Cancel: the reads ahead are not wanted.
            for task in pending:
                if task.done() and not task.cancelled():
                    task.exception()  # retrieved: a failed read ahead is not logged as unhandled
                else:
                    task.cancel()
            if timings is not None:
                timings["read_wait_s"] = timings.get("read_wait_s", 0.0) + wait_s
                timings["read_copy_s"] = timings.get("read_copy_s", 0.0) + copy_s
                timings["hash_wait_s"] = timings.get("hash_wait_s", 0.0) + hash_s

    async def _get_chunk(self, key: str, index: int) -> JsProxy | None:
        """The stored record of chunk `index` of `key` (its own readonly transaction), or None."""
        tx = self._db.transaction(CHUNKS, "readonly")
        req = tx.objectStore(CHUNKS).get(js_obj([key, index]))
        await _request(req, f"read chunk {index}")
        rec = req.result
        return None if rec is None or str(rec) == "undefined" else rec

    async def _fetch_chunk(self, key: str, index: int) -> tuple[Any, Any]:
        """(record, its bytes as an ArrayBuffer) of one stored chunk; (None, None) if it is missing,
        (record, None) if its data cannot be read."""
        rec = await self._get_chunk(key, index)
        if rec is None:
            return None, None
        return rec, await _chunk_bytes(rec)

    async def _raise_if_deleted(self, meta: dict[str, Any]) -> None:
        """A missing chunk of an entry that is itself gone means a delete, not damage."""
        current = await self.get(meta["key"])
        if current is None or current.get("created") != meta.get("created"):
            raise EntryDeletedError(
                f"{meta['key']} was deleted from browser storage while it was being "
                "read (Delete in this or another tab)"
            )

    async def upgrade_chunks(self, meta: dict[str, Any]) -> int:
        """Rewrite the chunks of an entry cached by an older build in today's format: ArrayBuffer
        values as Blobs (read back ~3x faster), with the `check` that is read back faster than
        their SHA-256; one chunk per transaction; returns how many were rewritten. A chunk is
        rewritten only if its bytes still match its SHA-256 (a damaged one stays for the next load
        to find), and only while the entry is still meta's: a delete meanwhile ends it
        (EntryDeletedError). Bytes, offsets and hashes are unchanged, and readers take every
        format, so stopping at any point leaves a valid entry."""
        rewritten = 0
        for index in range(int(meta["chunks"])):
            rec = await self._get_chunk(meta["key"], index)
            if rec is None:
                continue  # missing: the next load reports it
            if _stored_check(rec) is not None and not hasattr(getattr(rec, "data", None), "byteLength"):
                continue  # today's format already
            data = await _chunk_bytes(rec)
            if data is None or await sha256_hex(data) != str(rec.sha256):
                continue
            record = _chunk_record(
                meta["key"], index, int(rec.offset), int(rec.size), str(rec.sha256), _checksum_of(data), data
            )
            del rec, data
            await self._write_if_current(meta, record, f"rewrite chunk {index} as a Blob", write_meta=False)
            rewritten += 1
        return rewritten

    async def read_prefix(self, meta: dict[str, Any], limit: int) -> bytes:
        """The first min(limit, stored) bytes of an entry (to re-parse its header)."""
        parts: list[bytes] = []
        got = 0
        for index in range(int(meta["chunks"])):
            if got >= limit:
                break
            rec = await self._get_chunk(meta["key"], index)
            if rec is None:
                await self._raise_if_deleted(meta)
                raise CorruptEntryError(f"chunk {index} of {meta['key']} is missing from browser storage")
            buffer = await _chunk_bytes(rec)
            if buffer is None:
                raise CorruptEntryError(f"chunk {index} of {meta['key']} has no readable data in browser storage")
            data = js.Uint8Array.new(buffer)
            take = min(int(data.length), limit - got)
            parts.append(data.subarray(0, take).to_bytes())
            got += take
        return b"".join(parts)


def _chunk_record(
    key: str, index: int, offset: int, size: int, sha256: str, check: str, data: JsProxy
) -> dict[str, Any]:
    """A chunks-store record: `data` (an ArrayBuffer) stored as a Blob (see the module docstring)."""
    return {
        "key": key,
        "index": index,
        "offset": offset,
        "size": size,
        "sha256": sha256,
        "check": check,
        "data": js.Blob.new(js_obj([data])),
    }


def _checksum_of(data: JsProxy) -> str:
    """checksum.chunk_checksum of an ArrayBuffer's bytes."""
    return chunk_checksum(js.Uint8Array.new(data).to_bytes())


def _stored_check(rec: JsProxy) -> str | None:
    """A chunk record's `check` (checksum.chunk_checksum), or None in chunks of older builds."""
    check = getattr(rec, "check", None)
    return check if isinstance(check, str) else None


async def _chunk_bytes(rec: JsProxy) -> JsProxy | None:
    """A stored chunk's bytes as an ArrayBuffer: from its Blob, or as stored (older entries); None
    when it has neither or the Blob cannot be read (its file was removed behind the browser's back)."""
    data = getattr(rec, "data", None)
    if data is None or str(data) == "undefined":
        return None
    if hasattr(data, "byteLength"):
        return data
    if not hasattr(data, "arrayBuffer"):
        return None
    try:
        return await data.arrayBuffer()
    except JsException:
        return None


def _put(tx: JsProxy, store: str, record: dict[str, Any]) -> None:
    tx.objectStore(store).put(js_obj(record))


def _meta_to_py(obj: JsProxy) -> dict[str, Any]:
    meta = obj.to_py()
    # JS null/undefined come back as None; anything else left as a proxy is not ours: drop it
    return {k: (None if isinstance(v, JsProxy) else v) for k, v in meta.items()}


def _settled(target: JsProxy, names: tuple[str, ...]) -> JsProxy:
    """A JS Promise resolved with the first of the `names` events that `target` fires; never rejected.

    Failures resolve too, and the caller reads the event's type: in Pyodide 0.27 awaiting a Promise
    rejected with something that is not an Error (an IndexedDB error or abort Event) never returns
    (its conversion fails with "invalid exception object"), which left a load hanging for good on
    the first storage error (a full quota, a deleted database)."""

    def executor(resolve, reject):
        for name in names:
            setattr(target, "on" + name, resolve)

    return js.Promise.new(create_once_callable(executor))


async def _request(req: JsProxy, op: str) -> None:
    event = await _settled(req, ("success", "error"))
    if str(event.type) != "success":
        err = req.error
        raise StoreError(
            op, error_name(err) if err else "UnknownError", error_message(err) if err else "request failed"
        )


async def _transaction_after_read(
    tx: JsProxy, req: JsProxy, op: str, on_read: Callable[[JsProxy | None], None]
) -> None:
    """Run `tx` to its end, calling `on_read(record or None)` with `req`'s result inside its success
    event, where `tx` is still active: what `on_read` writes commits or aborts with what was read.
    An exception in `on_read` (put() can throw DataCloneError, a storage limit, ...) aborts `tx` and
    is raised as the StoreError of `op`."""
    failure: list[Exception] = []

    def on_success(event: Any) -> None:
        try:
            current = req.result
            on_read(None if current is None or str(current) == "undefined" else current)
        except Exception as e:
            failure.append(e)
            with contextlib.suppress(JsException):  # already aborted
                tx.abort()

    proxy = create_proxy(on_success)
    req.onsuccess = proxy
    try:
        await _transaction(tx, op)
    except StoreError as e:
        if failure and e.name == "AbortError":
            raise StoreError(op, error_name(failure[0]), error_message(failure[0])) from None
        raise
    finally:
        req.onsuccess = None
        proxy.destroy()


async def _transaction(tx: JsProxy, op: str) -> None:
    # a failed request's "error" event bubbles to the transaction and is followed by "abort" (with
    # tx.error set), so "complete" and "abort" are the two outcomes
    event = await _settled(tx, ("complete", "abort"))
    if str(event.type) != "complete":
        err = tx.error
        raise StoreError(
            op, error_name(err) if err else "AbortError", error_message(err) if err else "transaction aborted"
        )
