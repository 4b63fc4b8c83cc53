"""The engine worker: owns the model cache, the download and the engine, answers the page's messages.

Runs in a Web Worker under Pyodide (booted by static/engine-worker.js), so a long GPU step or a
1 GB copy never freezes the page. Messages are described in `protocol`. One load and one
generation at a time; `abort` and `cancel_load` act at once (they are handled synchronously in the
message handler while the running task awaits the GPU or the network).

Memory: the model's bytes go network -> IndexedDB chunks (never one big JS buffer) -> one numpy
array in wasm memory for `Engine.load_async`; after the upload the worker drops its reference.
The engine loads while the chunks are read (stream.FileStream): reading and uploading overlap.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import importlib
import time
import traceback
from typing import Any

import js
import numpy as np
from pyodide.ffi import create_proxy

from ..shared import protocol
from ..shared.checkpoints import is_checkpoint_model, visible_entries
from ..shared.failures import describe, failure_event, name_the_file
from ..shared.settings import speculate_option, to_engine_settings
from .checkpoint_downloader import CheckpointDownloader, EngineMissingError, delete_entry
from .downloader import ModelDownloader, testing_hooks
from .store import CorruptEntryError, ModelStore
from .stream import FileStream

PROGRESS_EVERY_S = 0.1


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()


class NoModelError(Exception):
    failure_kind = "internal"


class LoadCancelled(Exception):
    """Cancel pressed after the download, while the file is parsed or uploaded to the GPU."""

    failure_kind = "cancelled"


class PromptTooLong(Exception):
    """The latest message alone does not fit the context (with room for the reply)."""

    failure_kind = "too_long"


class EngineWorker:
    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.store: ModelStore | None = None
        self.engine: Any = None
        self.engine_module: Any = None
        self.engine_options: dict[str, Any] = {}  # keyword arguments of every Engine the worker makes
        self.engine_error: str | None = None
        # (device, engine_options) of a failed load that opened a GPU device while no model was loaded:
        # a next load with the same options reuses it, and the kernels compiled on it (KernelCache.of)
        self.spare_device: tuple[Any, dict[str, Any]] | None = None
        self.downloader: ModelDownloader | None = None
        self.load_task: asyncio.Task | None = None
        self.upgrade_task: asyncio.Task | None = None  # an older entry's chunks rewritten as Blobs
        self.generate_task: asyncio.Task | None = None
        self.warm_up_task: asyncio.Task | None = None
        self.loaded_key: str | None = None
        self.abort_requested = False
        self.cancel_requested = False  # Cancel during parse or upload (the downloader has its own flag)
        self.lost_reason: str | None = None  # why the GPU device went away (the model must be loaded again)
        self._tasks: set[asyncio.Task] = set()

    # -- messaging --------------------------------------------------------------------------------

    def post(self, message: dict[str, Any]) -> None:
        js.postMessage(protocol.encode(message))

    def on_message(self, event: Any) -> None:
        try:
            msg = protocol.decode(event.data, key="op", allowed=protocol.OPS)
        except protocol.ProtocolError as e:
            self.post({"event": "log", "message": f"worker ignored a message: {e}"})
            return
        op, req_id = msg["op"], msg.get("id")
        if op == "abort":
            self.abort_requested = True
            if self.engine is not None:
                self.engine.abort()
            return
        if op == "cancel_load":
            if self.load_task is not None and not self.load_task.done():
                self.cancel_requested = True
                if self.reading is not None:  # the engine may be waiting for a chunk: end that now
                    self.reading.fail(_cancelled())
            if self.downloader is not None:
                self.downloader.cancel()
            return
        if op in ("chat", "complete") and (self.generate_task is None or self.generate_task.done()):
            # A new request: an earlier Stop must not end it, but a Stop sent after it (even one
            # handled before its task starts) must. So the flag is cleared here, in message order.
            self.abort_requested = False
        handler = getattr(self, "op_" + op)
        task = asyncio.ensure_future(self._run(handler, msg, req_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, handler, msg: dict[str, Any], req_id: int | None) -> None:
        blocked_before = len(_csp_violations())
        try:
            await handler(msg, req_id)
        except Exception as e:  # every failure becomes a message in the page, never a silent worker
            event = failure_event(e, req_id)
            if event["kind"] == "internal":
                event["detail"] += "\n" + "".join(traceback.format_exception(e))[-2000:]
            blocked = _csp_violations()[blocked_before:]
            if blocked:  # e.g. a model URL on a host the policy does not list: fetch() only says "failed"
                event["message"] += (
                    f" (this site's Content-Security-Policy blocked it: {'; '.join(blocked)}; "
                    "it allows downloads only from this site and the model hosts it lists)"
                )
            if event["kind"] == "device_lost":
                self._forget_lost_model(str(e))
            self.post(event)

    def _forget_lost_model(self, reason: str) -> None:
        """The GPU device is gone and the engine's model with it: later requests say so (kind
        device_lost, so the page offers to load the model again) instead of failing obscurely."""
        if self.loaded_key is not None:
            self.lost_reason = reason
        self.loaded_key = None

    def _on_device_lost(self, reason: str) -> None:
        """The device was lost while a model was loaded (driver reset, GPU process crash, tab
        reclaimed): tell the page now, not at its next request."""
        if self.loaded_key is None:
            return
        self._forget_lost_model(reason)
        self.post(_error("device_lost", f"the GPU device was lost ({reason}): the model must be loaded again", None))

    # -- ops --------------------------------------------------------------------------------------

    async def op_init(self, msg: dict[str, Any], req_id: int | None) -> None:
        self.engine_module, self.engine_error = _import_engine()
        gpu = await _probe_gpu()
        try:
            self.store = await ModelStore.open()
            store_error = None
        except Exception as e:
            store_error = str(e)
        self.post(
            {
                "event": "ready",
                "id": req_id,
                "engine_available": self.engine_module is not None,
                "engine_error": self.engine_error,
                "gpu": gpu,
                "store_error": store_error,
            }
        )

    async def op_list_models(self, msg: dict[str, Any], req_id: int | None) -> None:
        await self._post_models(req_id)

    async def op_delete_model(self, msg: dict[str, Any], req_id: int | None) -> None:
        key = msg["key"]
        if (
            self.downloader is not None
            and self.load_task is not None
            and not self.load_task.done()
            and self.loading_key == key
        ):
            self.downloader.cancel("the model was deleted from browser storage while it was loading", kind="deleted")
            await asyncio.wait([self.load_task])
        await delete_entry(self._require_store(), key)  # a checkpoint's group: all its files
        # a loaded model stays loaded (the engine holds its own copy): only the cached file is gone
        await self._post_models(req_id)

    async def op_load(self, msg: dict[str, Any], req_id: int | None) -> None:
        if self.load_task is not None and not self.load_task.done():
            self.post(_error("busy", "a model is already loading: cancel it first", req_id))
            return
        if self.generate_task is not None and not self.generate_task.done():
            self.post(_error("busy", "stop the running generation before loading a model", req_id))
            return
        self.load_task = asyncio.current_task()
        self.cancel_requested = False
        if _running(self.warm_up_task):  # it reads the model this load replaces: end it first
            self.engine.stop_warm_up()
            await asyncio.wait([self.warm_up_task])
        model = msg["model"]
        self.loading_key = model["key"]
        try:
            await self._load(model, req_id)
        except Exception as e:
            name_the_file(e, model.get("name"))
            raise
        finally:
            # The load is over once "loaded" (or an error) is posted: a request sent on that event
            # must not find the worker busy while the model list is refreshed below.
            self.downloader = None
            self.load_task = None
            await self._post_models(None)

    async def _load(self, model: dict[str, Any], req_id: int | None) -> None:
        store = self._require_store()

        def emit(event: dict[str, Any]) -> None:
            self.post({**event, "id": req_id})

        if is_checkpoint_model(model):  # a Hugging Face checkpoint folder: checkpoint_downloader
            self.downloader = CheckpointDownloader(store, emit)
            meta, gguf, source = await self.downloader.load(model)
            if self.engine_module is None or testing_hooks().get("skipEngine"):
                why = (
                    "the engine load was skipped (test hook skipEngine)"
                    if self.engine_module
                    else (self.engine_error or "")
                )
                raise EngineMissingError(f"{meta['name']}: fetched and converted. {why}".strip())
            await self._engine_load(meta, gguf, source, emit)
            return
        for attempt in (1, 2):  # a damaged cache entry is deleted and fetched once more
            self.downloader = ModelDownloader(store, emit)
            meta, source = await self.downloader.ensure_cached(model)
            self._check_cancel()
            try:
                if self._can_stream(meta):
                    await self._stream_load(model, meta, source, emit)
                    self._upgrade_storage_later(meta, source)
                    return
                data = await self._read(meta, emit)
                self._verify(meta, data, emit)
                break
            except CorruptEntryError as e:
                await store.delete(meta["key"])
                if attempt == 2:
                    raise
                emit({"event": "log", "message": f"{e}; downloading it again"})
        if meta.get("header") is None:  # an entry cached by an older version
            try:
                meta["header"] = _header_from_bytes(data)
            except Exception:
                await store.delete(meta["key"])  # not a usable file: keep no "complete" entry of it
                raise
            await store.put_meta(meta)
        emit({"event": "header", "info": meta["header"]})
        offline_copy = source == "network" and await _in_offline_copy(meta.get("url") or model.get("url") or "")
        skip = bool(testing_hooks().get("skipEngine"))  # browser tests of downloads and storage
        if self.engine_module is None or skip:
            del data
            why = "the engine load was skipped (test hook skipEngine)" if skip else (self.engine_error or "")
            f = describe("engine_missing", f"{meta['name']}: {meta['total']:,} bytes, verified. {why}".strip())
            emit(
                {
                    "event": "error",
                    "kind": f.kind,
                    "title": f.title,
                    "message": f.message,
                    "advice": list(f.advice),
                    "fatal": False,
                    "detail": "",
                    "info": meta["header"],
                    "source": source,
                }
            )
            return
        await self._engine_load(meta, data, source, emit, offline_copy=offline_copy)
        self._upgrade_storage_later(meta, source)

    def _upgrade_storage_later(self, meta: dict[str, Any], source: str) -> None:
        """After a load from the cache: rewrite the entry's chunks in the background if an older build
        stored them (ArrayBuffers, or no `check`: ModelStore.upgrade_chunks), so the next load reads
        them faster. Failures are logged, never shown: the entry stays valid."""
        if source != "cache" or (self.upgrade_task is not None and not self.upgrade_task.done()):
            return

        async def upgrade() -> None:
            try:
                n = await self._require_store().upgrade_chunks(meta)
                if n:
                    self.post({"event": "log", "message": f"{meta['name']}: {n} chunks stored in the faster format"})
            except Exception as e:  # a delete meanwhile, quota, a closed database: the old chunks stay
                self.post({"event": "log", "message": f"{meta['name']}: chunks left as they were ({e})"})

        self.upgrade_task = asyncio.ensure_future(upgrade())

    def _can_stream(self, meta: dict[str, Any]) -> bool:
        """Whether the engine can load the entry while it is read (the header is known; an entry
        cached by an older version without one, or a test skipping the engine, is read first)."""
        return self.engine_module is not None and not testing_hooks().get("skipEngine") and bool(meta.get("header"))

    async def _stream_load(self, model: dict[str, Any], meta: dict[str, Any], source: str, emit) -> None:
        """Read the cached file and load it into the engine at the same time (stream.FileStream): the
        engine parses the header once it is in and uploads each part as its bytes arrive. Progress
        shows the read while it lasts (the upload keeps pace with it), then the upload's last steps."""
        emit({"event": "header", "info": meta["header"]})
        offline_copy = source == "network" and await _in_offline_copy(meta.get("url") or model.get("url") or "")
        last = [0.0]

        def chunk_in(done: int, total: int) -> None:
            self._check_cancel()
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done == total:
                last[0] = now
                emit({"event": "progress", "phase": "read", "done": done, "total": total})

        stream = FileStream(self._require_store(), meta, chunk_in)
        self.reading = stream
        self.last_read_timings = stream.timings  # for static/bench/load.html
        emit({"event": "progress", "phase": "read", "done": 0, "total": stream.total})
        stream.start()
        try:
            gguf = await _header_of(stream)
            await self._engine_load(
                meta, gguf, source, emit, offline_copy=offline_copy, ready=stream.wait, quiet=lambda: not stream.done
            )
        except Exception as e:
            if e is not stream.failed and not isinstance(e, LoadCancelled):
                # The engine refused bytes the whole-file check had not judged yet: a damaged copy
                # is deleted and fetched again (as when it was read first), not reported as a bad
                # file, so let the read finish and say which it was.
                failed = await stream.finish()
                if isinstance(failed, CorruptEntryError):
                    raise failed from None
            raise
        finally:
            self.reading = None
            await stream.close()

    def _check_cancel(self) -> None:
        if self.cancel_requested:
            raise _cancelled()

    async def _read(self, meta: dict[str, Any], emit) -> np.ndarray:
        total = int(meta["total"])
        try:
            data = np.empty(total, dtype=np.uint8)
        except MemoryError:
            raise MemoryError(f"could not reserve {total:,} bytes of WebAssembly memory for {meta['name']}") from None
        last = [0.0]

        def progress(done: int, total: int) -> None:
            self._check_cancel()  # Cancel while reading from browser storage
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done == total:
                last[0] = now
                emit({"event": "progress", "phase": "read", "done": done, "total": total})

        await self._require_store().read_into(meta, data, progress)
        return data

    def _verify(self, meta: dict[str, Any], data: np.ndarray, emit) -> None:
        expected = meta.get("sha256")
        if not expected:
            return  # each chunk (its checksum or SHA-256) and the size were checked while reading
        emit({"event": "progress", "phase": "verify", "done": 0, "total": len(data)})
        actual = hashlib.sha256(data).hexdigest()
        if actual != expected:
            raise CorruptEntryError(
                f"{meta['name']}: SHA-256 {actual[:16]}… does not match the expected {expected[:16]}…"
            )

    async def _engine_load(
        self,
        meta: dict[str, Any],
        data: Any,
        source: str,
        emit,
        offline_copy: bool = False,
        ready: Any = None,
        quiet: Any = None,
    ) -> None:
        """Load into a new Engine beside the one in use, on the same GPU device, and swap only when
        it is ready: a file that fails to parse or upload, or a Cancel, leaves the old model usable.
        `ready`: the file is still being read (Engine.load_async); while `quiet()` is true the
        engine's progress is not posted (the read's is)."""
        from ...formats.gguf_reader import GGUFFile

        def report(event: dict[str, Any]) -> None:
            if quiet is None or not quiet():
                emit(event)

        old = self.engine
        new = self.engine_module.Engine(**self.engine_options)
        device = old.device if old is not None else None
        if device is not None and device.lost_reason is not None:
            device = None
        if device is None and self.spare_device is not None and self.spare_device[1] == self.engine_options:
            device = self.spare_device[0]
        if device is not None:
            new.device = device  # Engine._load reuses a device that is not lost
        hooks = testing_hooks()  # browser tests: hold the parse phase, or Cancel at an upload step

        def progress(phase: str, done: int, total: int) -> None:
            if phase == "upload" and done == hooks.get("cancelAtUploadStep"):
                self.cancel_requested = True  # as if Cancel came now (the message path is tested in parse)
            self._check_cancel()  # raised inside the engine's upload loop: it releases what it uploaded
            if phase == "parse":  # the engine's checks (config, tensors, tokenizer): steps 2-3 of 3
                done, total = 1 + int(done), 3
            # every step (a layer at most): a small model's whole upload can take less than PROGRESS_EVERY_S
            report({"event": "progress", "phase": phase, "done": int(done), "total": int(total)})

        report({"event": "progress", "phase": "parse", "done": 0, "total": 3})
        await asyncio.sleep(0)  # a Cancel sent during the download or read is handled here
        self._check_cancel()
        gguf = data if isinstance(data, GGUFFile) else GGUFFile.from_buffer(np.asarray(data, dtype=np.uint8))
        del data
        report({"event": "progress", "phase": "parse", "done": 1, "total": 3})
        await asyncio.sleep(float(hooks.get("parseDelayMs") or 0) / 1000)
        self._check_cancel()
        try:
            await new.load_async(gguf, name=meta["name"], progress=progress, ready=ready)
            self._check_cancel()  # a Cancel that came during the last upload step
        except BaseException:
            with contextlib.suppress(Exception):
                new.unload()
            self.spare_device = (new.device, dict(self.engine_options)) if new.device is not None else None
            raise
        self.spare_device = None
        if old is not None:
            with contextlib.suppress(Exception):
                old.unload()  # its buffers on the shared device; the device itself stays open
        self.engine = new
        self.loaded_key = meta["key"]
        self.lost_reason = None
        if hasattr(self.engine.device, "add_lost_listener"):  # the browser backend
            self.engine.device.add_lost_listener(self._on_device_lost)
        header = meta.get("header") or {}
        try:
            engine_info = dict(self.engine.info)
        except Exception as e:  # display only: the model works, show what the header says
            engine_info = {}
            emit(
                {
                    "event": "log",
                    "message": f"engine.info failed ({type(e).__name__}: {e}); showing the file header instead",
                }
            )
        info = {**header, **engine_info}
        if header.get("name"):
            info["name"] = header["name"]  # the file's own name rather than the engine's label
        emit({"event": "loaded", "info": info, "source": source, "offline_copy": offline_copy, "key": meta["key"]})

    async def op_chat(self, msg: dict[str, Any], req_id: int | None) -> None:
        options = msg.get("settings") or {}
        await self._generate(
            req_id,
            lambda engine, settings, max_tokens: self._drafting(engine.chat_async, options)(
                msg["messages"], settings, max_tokens=max_tokens
            ),
            options,
        )

    async def op_complete(self, msg: dict[str, Any], req_id: int | None) -> None:
        options = msg.get("settings") or {}
        if not msg.get("keep_recent"):
            start = lambda engine, settings, max_tokens: self._drafting(engine.complete_async, options)(  # noqa: E731
                msg["prompt"], settings, max_tokens=max_tokens
            )
        else:  # the chat page's running document: keep the most recent text that fits

            def start(engine, settings, max_tokens):
                ids = self._recent_prompt(engine, msg["prompt"], int(msg.get("latest_chars") or 0), max_tokens)
                return self._drafting(engine.generate_tokens_async, options)(ids, settings, max_tokens)

        await self._generate(req_id, start, options)

    def _drafting(self, method: Any, settings: dict[str, Any]) -> Any:
        """`method` with the page's speculative-decoding setting (a log line when this engine lacks it)."""
        options, note = speculate_option(settings, method)
        if note:
            self.post({"event": "log", "message": note})
        return functools.partial(method, **options)

    def _recent_prompt(self, engine: Any, prompt: str, latest_chars: int, max_tokens: int) -> list[int]:
        from ..shared.prompts import keep_recent_tokens, reply_room

        context = int(engine.config.context_length)
        budget = context - reply_room(context, max_tokens)
        ids = engine.encode_prompt(prompt)
        if len(ids) <= budget:
            return ids
        latest = prompt[-latest_chars:] if latest_chars else prompt
        n_latest = len(engine.encode_prompt(latest))
        if n_latest > budget:
            raise PromptTooLong(
                f"this message has {n_latest:,} tokens; the model's context holds {context:,}, "
                f"{context - budget:,} of them kept for the reply (Max tokens): shorten the message"
            )
        bos = engine.tokenizer.add_bos and ids[:1] == [engine.tokenizer.bos_id]
        kept = keep_recent_tokens(ids, budget, keep_first=1 if bos else 0, min_keep=n_latest)
        self.dropped_tokens = len(ids) - len(kept)
        return kept

    async def _generate(self, req_id: int | None, start, settings_dict: dict[str, Any]) -> None:
        if self.loaded_key is None and self.lost_reason is not None:
            self.post(
                _error("device_lost", f"the GPU device was lost ({self.lost_reason}): load the model again", req_id)
            )
            return
        if self.engine is None or self.loaded_key is None:
            reason = (
                "the inference engine is not part of this build"
                if self.engine_module is None
                else "no model is loaded yet"
            )
            kind = "engine_missing" if self.engine_module is None else "internal"
            self.post(_error(kind, f"cannot generate: {reason}", req_id))
            return
        if self.generate_task is not None and not self.generate_task.done():
            self.post(_error("busy", "a reply is already being generated", req_id))
            return
        if self.load_task is not None and not self.load_task.done():
            self.post(_error("busy", "a model is loading", req_id))
            return
        self.generate_task = asyncio.current_task()
        self.dropped_tokens = 0
        sampler = importlib.import_module("bitnet_web.text.sampler")
        settings = to_engine_settings(settings_dict, sampler.SamplerSettings)
        max_tokens = int(settings_dict.get("max_tokens") or 256)
        sent = 0

        def prefill_progress(done: int, total: int) -> None:
            self.post({"event": "progress", "id": req_id, "phase": "prefill", "done": done, "total": total})
            if self.abort_requested:
                self.engine.abort()  # a Stop that came before the engine cleared its flag: end the prefill

        self.engine.on_prefill = prefill_progress
        try:
            async for piece in start(self.engine, settings, max_tokens):
                if piece:
                    sent += 1
                    self.post({"event": "piece", "id": req_id, "text": piece})
                if self.abort_requested:
                    # The engine clears its abort flag when a generation starts, so a Stop that came
                    # before that (during the request's hand-over or prefill) is applied again here.
                    self.engine.abort()
        except Exception as e:
            # The engine's context checks (EngineError "... shorten ..."): nothing was generated, the
            # page keeps the message in its box
            if sent == 0 and type(e).__name__ == "EngineError" and "shorten" in str(e):
                raise PromptTooLong(str(e)) from e
            raise
        stats = _stats_dict(self.engine.last_stats)
        aborted = self.abort_requested or stats.get("stop_reason") == "aborted"
        self.post(
            {
                "event": "done",
                "id": req_id,
                "stats": stats,
                "reason": "aborted" if aborted else "end",
                "dropped_tokens": self.dropped_tokens,
            }
        )

    async def op_warm_up(self, msg: dict[str, Any], req_id: int | None) -> None:
        """The person is typing: raise the GPU's clocks before the reply (Engine.warm_up_async). A reply
        that starts meanwhile ends it after its current submit of a few milliseconds."""
        busy = [
            (self.engine is None or self.loaded_key is None, "no model is loaded"),
            (_running(self.load_task), "a model is loading"),
            (_running(self.generate_task), "a reply is being generated"),
            (_running(self.warm_up_task), "a warm-up is running"),
            (
                not msg.get("force") and getattr(self.engine, "device", None) is not None and self.engine.device.is_cpu,
                "a CPU adapter has no clocks to raise",
            ),
        ]
        why = next((reason for skip, reason in busy if skip), None)
        if why is not None:
            self.post({"event": "warmed", "id": req_id, "skipped": why})
            return
        self.warm_up_task = asyncio.current_task()
        try:
            stats = await self.engine.warm_up_async()
        except Exception as e:  # nothing of the page's depends on a warm-up: it only says why it ended
            failure = failure_event(e, req_id)
            if failure["kind"] == "device_lost":
                raise
            self.post({"event": "warmed", "id": req_id, "skipped": f"failed: {failure['message']}"})
            return
        self.post({"event": "warmed", "id": req_id, "stats": stats})

    async def op_reset(self, msg: dict[str, Any], req_id: int | None) -> None:
        if self.engine is not None:
            self.engine.reset()

    # -- helpers ----------------------------------------------------------------------------------

    def _require_store(self) -> ModelStore:
        if self.store is None:
            raise RuntimeError("browser storage (IndexedDB) is not available in this context")
        return self.store

    async def _post_models(self, req_id: int | None) -> None:
        entries = visible_entries(await self.store.entries()) if self.store is not None else []
        estimate: dict[str, Any] = {}
        storage = getattr(js.navigator, "storage", None)
        if storage is not None:
            try:
                est = await storage.estimate()
                estimate = {"usage": int(est.usage), "quota": int(est.quota)}
            except Exception:
                estimate = {}
        self.post(
            {
                "event": "models",
                "id": req_id,
                "estimate": estimate,
                "loaded": self.loaded_key,
                "entries": [
                    {k: e.get(k) for k in ("key", "url", "name", "total", "stored", "complete", "updated")}
                    for e in entries
                ],
            }
        )

    loading_key: str | None = None
    last_read_timings: dict[str, float] | None = None  # the last streamed load's read (FileStream.timings)
    reading: FileStream | None = None  # the streamed load's reader while it runs
    dropped_tokens = 0  # completion mode: the oldest tokens left out of the last request (keep_recent)


def _cancelled() -> LoadCancelled:
    return LoadCancelled("loading cancelled before the new model was ready")


def _error(kind: str, message: str, req_id: int | None) -> dict[str, Any]:
    f = describe(kind, message)
    return {
        "event": "error",
        "id": req_id,
        "kind": f.kind,
        "title": f.title,
        "message": f.message,
        "advice": list(f.advice),
        "fatal": f.fatal,
        "detail": "",
    }


async def _in_offline_copy(url: str) -> bool:
    """True if the service worker's offline copy of the site holds `url` (the bundled model): the
    fetch was answered from it, not from the network."""
    caches = getattr(js.self, "caches", None)
    if not url or caches is None:
        return False
    try:
        return bool(await caches.match(str(js.URL.new(url, js.self.location.href).href)))
    except Exception:
        return False


def _csp_violations() -> list[str]:
    """What the worker's Content-Security-Policy refused so far (recorded by engine-worker.js)."""
    found = getattr(js.self, "cspViolations", None)
    return [str(v) for v in found] if found is not None else []


def _stats_dict(stats: Any) -> dict[str, Any]:
    if stats is None:
        return {}
    if hasattr(stats, "as_dict"):
        return dict(stats.as_dict())
    return dict(stats)


async def _header_of(stream: FileStream) -> Any:
    """The GGUF header of a file being read, parsed once its bytes are in, over the whole buffer
    (tensor data is used only after `stream.wait` says it is there)."""
    from ...formats.gguf_reader import GGUFFile, parse_header

    while True:
        header = parse_header(stream.data[: stream.filled], stream.total)  # None: more bytes needed
        if header is not None:
            return GGUFFile(
                stream.data,
                version=header.version,
                metadata=header.metadata,
                tensors=header.tensors,
                alignment=header.alignment,
                data_offset=header.data_offset,
                header_size=header.header_size,
                total_size=stream.total,
            )
        await stream.wait(stream.filled + 1)


def _header_from_bytes(data: np.ndarray) -> dict[str, Any]:
    from ...formats.gguf_reader import GGUFFile
    from ..shared.modelinfo import header_info

    return header_info(GGUFFile.from_buffer(data), len(data))


def _import_engine() -> tuple[Any, str | None]:
    try:
        return importlib.import_module("bitnet_web.engine"), None
    except ModuleNotFoundError as e:
        if e.name in ("bitnet_web.engine", "bitnet_web.text.sampler"):
            return None, None  # not written yet: the app works up to showing the model's header
        return None, f"the engine failed to import: {e}"
    except Exception as e:
        return None, f"the engine failed to import: {type(e).__name__}: {e}"


async def _probe_gpu() -> dict[str, Any]:
    gpu = getattr(js.navigator, "gpu", None)
    if gpu is None:
        return {"available": False, "error": "navigator.gpu is missing in the worker"}
    try:
        adapter = await gpu.requestAdapter()
    except Exception as e:
        return {"available": False, "error": f"requestAdapter failed: {e}"}
    if adapter is None:
        return {"available": False, "error": "requestAdapter returned no adapter"}
    info = getattr(adapter, "info", None)
    features = sorted(str(f) for f in getattr(js.Array, "from")(adapter.features))
    return {
        "available": True,
        "features": features,
        "adapter": " / ".join(str(getattr(info, k, "") or "") for k in ("vendor", "architecture", "description")).strip(
            " /"
        )
        if info is not None
        else "",
        "max_buffer_size": int(adapter.limits.maxBufferSize),
        "max_storage_buffer_binding_size": int(adapter.limits.maxStorageBufferBindingSize),
    }


_worker: EngineWorker | None = None
_handler: Any = None


def start(root_url: str, pending: Any) -> None:
    """Called once by engine-worker.js: take over message handling, then replay early messages."""
    global _worker, _handler
    _worker = EngineWorker(root_url)
    _handler = create_proxy(_worker.on_message)  # lives as long as the worker
    js.self.onmessage = _handler
    for event in pending:
        _worker.on_message(event)
