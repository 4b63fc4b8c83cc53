"""Hugging Face checkpoint folders in the worker: fetched, cached and converted (the page side: shared/checkpoints.py).

 `CheckpointDownloader(store, emit).load(model)` -> (group meta, GGUFFile, "cache" | "network").
  1. config.json is fetched first and checked (`hf_checkpoint.check_config`): a missing config.json or an
     unsupported model is refused before any weights are fetched.
  2. A HEAD request per file decides what the folder holds (model.safetensors.index.json -> its shards,
     else model.safetensors; optional files may be absent) and how big it is, so one progress bar covers
     every file and a missing shard is named before gigabytes are fetched.
  3. Each file is fetched by download.ModelDownloader (resumable, chunked, SHA-256 per chunk) into its own
     ModelStore entry, key = base URL + file name. One *group* record, key = base URL, format 'hf', lists
     them (`files`: [{name, size}]); the cache manager shows only the group (`visible_entries`) and
     deleting it deletes every file (`delete_entry`). The group is complete once every file is.
  4. The files are read back into numpy arrays and described by hf_checkpoint as a GGUFFile with no GGUF
     bytes (progress phase 'convert'); the engine loads it, each tensor converted as it is uploaded.
A file that is missing on the server (404), a refused config.json and a checkpoint that cannot be converted
delete the group and its files (nothing of it is usable); an interrupted or cancelled fetch keeps them, and
Load resumes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from ...convert.hf_urls import checkpoint_name
from ..shared.checkpoints import FORMAT, LOSSY_FIELD, part_keys
from .downloader import DownloadCancelled, DownloadError

PROGRESS_EVERY_S = 0.1
_MISSING = object()  # a HEAD answer of 404 / 410 for an optional file


class CheckpointFileMissing(DownloadError):
    """A file the checkpoint needs is not on the server (HTTP 404 / 410); the message names it."""


class EngineMissingError(Exception):
    """The checkpoint was fetched and converted, but this build has no engine to run it."""

    failure_kind = "engine_missing"


# -------------------------------------------------------------------------------------------------
# Listing
# -------------------------------------------------------------------------------------------------


async def delete_entry(store: Any, key: str) -> None:
    """Delete a cache entry; for a checkpoint group, its files first (so no file outlives its group)."""
    group = await store.get(key)
    if group is not None and group.get("format") == FORMAT:
        for part in part_keys(group):
            await store.delete(part)
    await store.delete(key)


def _is_bad_checkpoint(exc: BaseException, *, lossy_refusal: bool = True) -> bool:
    """Failures that fetching again cannot fix: a missing file, a refused config, a conversion error.
    `lossy_refusal=False`: an ordinary checkpoint refused for want of the opt-in does not count (its
    complete cached files work once the person opts in)."""
    names = {c.__name__ for c in type(exc).__mro__}
    if not lossy_refusal and "LossyTernarizationError" in names:
        return False
    return bool(names & {"CheckpointFileMissing", "GGUFError", "SafetensorsError"})


# -------------------------------------------------------------------------------------------------
# Worker side
# -------------------------------------------------------------------------------------------------


class CheckpointDownloader:
    """Fetches, caches and converts one checkpoint folder; events go to `emit(dict)` (as ModelDownloader's)."""

    def __init__(self, store: Any, emit: Callable[[dict], None]) -> None:
        self.store = store
        self.emit = emit
        self.cancel_requested = False
        self._cancel_message, self._cancel_kind = "download cancelled; press Load to resume", "cancelled"
        self._file_downloader: Any = None
        self._last_progress = 0.0

    def cancel(self, message: str | None = None, kind: str = "cancelled") -> None:
        """Stop the load (as ModelDownloader.cancel): it ends with DownloadCancelled(message) of kind `kind`."""
        self.cancel_requested = True
        if message:
            self._cancel_message, self._cancel_kind = message, kind
        if self._file_downloader is not None:
            self._file_downloader.cancel(message, kind)

    def _cancelled(self) -> DownloadCancelled:
        return DownloadCancelled(self._cancel_message, self._cancel_kind)

    async def load(self, model: dict[str, Any]) -> tuple[dict[str, Any], Any, str]:
        """(group meta, GGUFFile, "cache" | "network") for a checkpoint descriptor."""
        from .store import CorruptEntryError

        for attempt in (1, 2):  # a damaged or evicted file is fetched once more
            group, source = await self.ensure_cached(model)
            try:
                buffers = await self._read(group)
                break
            except CorruptEntryError as e:
                if attempt == 2:
                    raise
                self.emit({"event": "log", "message": f"{e}; downloading it again"})
        # the opt-in, once given for a checkpoint, stays with its cached copy (loaded later from the list)
        allow_lossy = bool(model.get(LOSSY_FIELD) or group.get(LOSSY_FIELD))
        try:
            gguf = self._convert(group, buffers, allow_lossy)
        except Exception as e:
            if _is_bad_checkpoint(e, lossy_refusal=False):
                try:
                    await delete_entry(self.store, group["key"])
                except Exception:
                    pass  # the conversion error is the one to report
            raise
        from ..shared.modelinfo import header_info

        group["header"] = header_info(gguf, group.get("total"))
        if allow_lossy and not group.get(LOSSY_FIELD) and group["header"].get("lossy"):
            group[LOSSY_FIELD] = True
            await self.store.put_meta(group)
        self.emit({"event": "header", "info": group["header"]})
        return group, gguf, source

    # -- fetching ---------------------------------------------------------------------------------

    async def ensure_cached(self, model: dict[str, Any]) -> tuple[dict[str, Any], str]:
        from ..shared.jsutil import WebLock

        def waiting() -> None:
            self.emit({"event": "log", "message": "another tab is downloading this model: waiting for it"})

        async with WebLock("bitnet-web-model:" + model["key"], on_wait=waiting):
            try:
                return await self._ensure_cached(model)
            except BaseException as e:
                try:
                    if _is_bad_checkpoint(e) or not await self._anything_stored(model["key"]):
                        await delete_entry(self.store, model["key"])  # unusable, or empty: leave no entry
                except Exception:
                    pass  # the original failure is the one to report
                raise

    async def _ensure_cached(self, model: dict[str, Any]) -> tuple[dict[str, Any], str]:
        key, base = model["key"], model["url"]
        group = await self.store.get(key)
        if group is not None and group.get("format") == FORMAT and group.get("complete"):
            if await self._parts_complete(group):
                return group, "cache"
            group["complete"] = False  # a file was evicted or damaged: fetch what is missing
        if group is None or group.get("format") != FORMAT:
            group = await self.store.begin(
                key, url=base, name=model.get("name") or checkpoint_name(base), format=FORMAT, files=[], planned=False
            )
        if not group.get("planned"):
            await self._plan(group, model)
        for f in group["files"]:
            await self._fetch(group, f)
        group["total"] = group["stored"] = sum(int(f["size"]) for f in group["files"])
        group["complete"] = True
        await self.store.put_meta(group)
        return group, "network"

    async def _plan(self, group: dict[str, Any], model: dict[str, Any]) -> None:
        """Fetch and check config.json, find the weight files, learn every file's size."""
        from ...convert.hf_checkpoint import (
            CONFIG_FILE,
            INDEX_FILE,
            OPTIONAL_FILES,
            TOKENIZER_FILE,
            WEIGHTS_FILE,
            CheckpointFiles,
            check_config,
            files_to_fetch,
        )
        from ...formats.safetensors import SafetensorsError

        base = group["url"]
        why = {
            CONFIG_FILE: f"there is no {CONFIG_FILE}, so {base} is not a Hugging Face checkpoint folder",
            TOKENIZER_FILE: f"the checkpoint has no {TOKENIZER_FILE} (its vocabulary)",
            WEIGHTS_FILE: f"the checkpoint has neither {WEIGHTS_FILE} nor {INDEX_FILE} (only safetensors "
            "checkpoints are supported)",
        }
        size = await self._head(base + CONFIG_FILE, required=True, why=why[CONFIG_FILE])
        config = CheckpointFiles(
            group["name"], source=base, buffers={CONFIG_FILE: await self._fetch_small(group, CONFIG_FILE, size)}
        )
        check_config(
            config.json(CONFIG_FILE), config.label(CONFIG_FILE), allow_lossy_ternarization=bool(model.get(LOSSY_FIELD))
        )
        index = None
        size = await self._head(base + INDEX_FILE, required=False)
        if size is not _MISSING:
            raw = await self._fetch_small(group, INDEX_FILE, size)
            try:
                index = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise SafetensorsError(f"{base}{INDEX_FILE}: not JSON ({e})") from None
        have = {f["name"] for f in group["files"]}
        for name in files_to_fetch(index):
            if name in have:
                continue
            reason = why.get(name) or (
                f"{name}, one of the weight shards named by {INDEX_FILE}, is missing from the checkpoint"
            )
            size = await self._head(base + name, required=name not in OPTIONAL_FILES, why=reason)
            if size is not _MISSING:
                group["files"].append({"name": name, "size": size})
        group["planned"] = True
        self._set_total(group)
        await self.store.put_meta(group)

    async def _fetch_small(self, group: dict[str, Any], name: str, size: int | None) -> bytes:
        """Fetch one small file of the plan (config.json, the index) and return its bytes."""
        f = next((g for g in group["files"] if g["name"] == name), None)  # from an interrupted plan
        if f is None:
            f = {"name": name, "size": size}
            group["files"].append(f)
            await self.store.put_meta(group)  # listed before its entry exists: a delete never misses it
        meta = await self._fetch(group, f)
        data = bytearray(int(meta["total"]))
        await self.store.read_into(meta, data)
        return bytes(data)

    async def _head(self, url: str, *, required: bool, why: str = "") -> Any:
        """The file's size (None when the server does not say), or _MISSING for an optional file that is
        not there. A required file that is not there raises CheckpointFileMissing naming it."""
        import js
        from pyodide.ffi import JsException

        from ..shared.jsutil import error_message, js_obj
        from .downloader import content_length

        if self.cancel_requested:
            raise self._cancelled()
        try:
            resp = await js.fetch(url, js_obj({"method": "HEAD", "cache": "no-store"}))
        except JsException as e:
            raise DownloadError(
                f"could not connect to the server of {url} ({error_message(e)}: it is "
                "unreachable, the browser is offline, or it does not allow cross-origin "
                "requests)"
            ) from None
        status = int(resp.status)
        if status in (404, 410):
            if not required:
                return _MISSING
            raise CheckpointFileMissing(f"{url}: HTTP {status}: {why}")
        if not resp.ok:
            return None  # e.g. HEAD not allowed: the GET tells the size, or the error
        return content_length(resp.headers)

    async def _fetch(self, group: dict[str, Any], f: dict[str, Any]) -> dict[str, Any]:
        """One file into its own cache entry through ModelDownloader; progress over the whole checkpoint."""
        from .downloader import ModelDownloader

        if self.cancel_requested:
            raise self._cancelled()
        before = 0
        for g in group["files"]:
            if g is f:
                break
            before += int(g.get("size") or 0)

        def emit(event: dict[str, Any]) -> None:
            if event.get("event") == "progress":
                self.emit({**event, "done": before + int(event["done"]), "total": group.get("total")})
            elif event.get("event") != "header":  # a file's GGUF header does not exist here
                self.emit(event)

        downloader = ModelDownloader(self.store, emit)
        self._file_downloader = downloader
        try:
            url = group["key"] + f["name"]
            meta, _ = await downloader.ensure_cached(
                {
                    "key": url,
                    "url": url,
                    "name": f"{group['name']}/{f['name']}",
                    "size": None,
                    "sha256": None,
                    "bundled": False,
                    "format": "raw",
                }
            )
        finally:
            self._file_downloader = None
        if f.get("size") != meta["total"]:
            f["size"] = int(meta["total"])  # the server did not say, or said otherwise in the HEAD answer
            self._set_total(group)
        group["stored"] = sum(int(g.get("size") or 0) for g in group["files"][: group["files"].index(f) + 1])
        await self.store.put_meta(group)
        return meta

    async def _parts_complete(self, group: dict[str, Any]) -> bool:
        for key in part_keys(group):
            meta = await self.store.get(key)
            if meta is None or not meta.get("complete"):
                return False
        return True

    async def _anything_stored(self, key: str) -> bool:
        group = await self.store.get(key)
        if group is None:
            return False
        for part in part_keys(group):
            meta = await self.store.get(part)
            if meta is not None and int(meta.get("stored") or 0) > 0:
                return True
        return False

    @staticmethod
    def _set_total(group: dict[str, Any]) -> None:
        sizes = [f.get("size") for f in group["files"]]
        group["total"] = sum(sizes) if group.get("planned") and None not in sizes else None

    # -- reading and converting -------------------------------------------------------------------

    async def _read(self, group: dict[str, Any]) -> dict[str, Any]:
        """Every file of a complete group as a numpy uint8 array, checked chunk by chunk."""
        import numpy as np

        from .store import CorruptEntryError

        total = sum(int(f["size"]) for f in group["files"])
        done = 0
        buffers: dict[str, Any] = {}
        for f in group["files"]:
            key = group["key"] + f["name"]
            meta = await self.store.get(key)
            try:
                if meta is None or not meta.get("complete"):
                    raise CorruptEntryError(f"{key} is missing from browser storage")
                await self.store.drop_uncounted(key)  # as ModelDownloader does before it reads an entry
                try:
                    data = np.empty(int(meta["total"]), dtype=np.uint8)
                except MemoryError:
                    raise MemoryError(
                        f"could not reserve {int(meta['total']):,} bytes of WebAssembly memory for {key}"
                    ) from None
                offset = done
                await self.store.read_into(meta, data, lambda d, t, o=offset: self._phase("read", o + d, total))
            except CorruptEntryError:
                await self.store.delete(key)
                group["complete"] = False
                await self.store.put_meta(group)
                raise
            buffers[f["name"]] = data
            done += len(data)
        self._phase("read", done, total, force=True)
        return buffers

    def _convert(self, group: dict[str, Any], buffers: dict[str, Any], allow_lossy: bool) -> Any:
        from ...convert.hf_checkpoint import CheckpointFiles, load_files

        files = CheckpointFiles(group["name"], buffers=buffers, source=group["url"])
        gguf = load_files(
            files,
            allow_lossy_ternarization=allow_lossy,
            progress=lambda phase, done, total: self._phase("convert", done, total),
        )
        buffers.clear()  # the converted file holds what it needs; each tensor is converted as it uploads
        return gguf

    def _phase(self, phase: str, done: int, total: int, force: bool = False) -> None:
        now = time.monotonic()
        if force or done >= total or now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            self.emit({"event": "progress", "phase": phase, "done": int(done), "total": int(total)})
