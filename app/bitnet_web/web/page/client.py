"""The page's side of the engine worker: requests, replies and streamed events as asyncio calls.

`shared_client(root)` gives one worker per page, shared by the chat app and any number of
widgets. Events carrying a request id go to that request's queue; the rest (the models list after a
load, log lines, a worker that failed to start) go to the `listeners`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import js
from pyodide.ffi import create_proxy

from ..shared import protocol

FINAL_EVENTS = {"ready", "models", "loaded", "done", "error", "fatal", "warmed"}
# While someone types, at most one GPU warm-up a second, none within a second of a reply's end: each
# keeps the GPU busy ~0.3 s (engine.WARM_UP_S), and its clocks stay up for over a second after it
# and after a reply (model/warm_up.py).
WARM_UP_EVERY_S = 1.0


class EngineClient:
    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.worker = js.Worker.new(root_url + "engine-worker.js")
        self._on_message_proxy = create_proxy(self._on_message)
        self._on_error_proxy = create_proxy(self._on_error)
        self.worker.onmessage = self._on_message_proxy
        self.worker.onerror = self._on_error_proxy
        self._next_id = 1
        self._queues: dict[int, asyncio.Queue] = {}
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self.ready: dict[str, Any] | None = None
        self._ready_future: asyncio.Future | None = None
        self.dead: dict[str, Any] | None = None  # the fatal event, once the worker has failed
        self.loaded: dict[str, Any] | None = None  # the last `loaded` event (model info, key)
        self._load_lock = asyncio.Lock()
        # Held by widgets and api.Engine from loading their model to the end of their request, so
        # that one of them cannot swap the worker's model while another generates with it.
        self.run_lock = asyncio.Lock()
        self.gpu_busy_at = float("-inf")  # when a reply last ended or a warm-up was last asked for

    # -- transport --------------------------------------------------------------------------------

    def _on_message(self, event: Any) -> None:
        try:
            msg = protocol.decode(event.data, key="event", allowed=protocol.EVENTS)
        except protocol.ProtocolError as e:
            js.console.warn(f"bitnet-web: {e}")
            return
        if msg["event"] == "fatal":
            self._fail(msg)
            return
        if msg["event"] == "done":
            self.gpu_busy_at = time.monotonic()
        queue = self._queues.get(msg.get("id")) if msg.get("id") is not None else None
        if queue is not None:
            queue.put_nowait(msg)
        else:
            self._broadcast(msg)

    def _on_error(self, event: Any) -> None:
        message = str(getattr(event, "message", "") or "the worker script failed to load")
        self._fail({"event": "fatal", "kind": "worker_start", "message": message})

    def _fail(self, msg: dict[str, Any]) -> None:
        self.dead = msg
        error = {
            "event": "error",
            "kind": msg.get("kind", "worker_start"),
            "message": msg.get("message", ""),
            "fatal": True,
        }
        for queue in self._queues.values():
            queue.put_nowait(error)
        self._broadcast(msg)

    def _broadcast(self, msg: dict[str, Any]) -> None:
        for listener in list(self.listeners):
            listener(msg)

    def send(self, op: str, **fields: Any) -> int:
        req_id = self._next_id
        self._next_id += 1
        self.worker.postMessage(protocol.encode({"op": op, "id": req_id, **fields}))
        return req_id

    async def request(
        self, op: str, on_event: Callable[[dict[str, Any]], None] | None = None, **fields: Any
    ) -> dict[str, Any]:
        """Send `op` and wait for its final event; intermediate events go to `on_event`."""
        if self.dead is not None:
            return {
                "event": "error",
                "kind": self.dead.get("kind", "worker_start"),
                "message": self.dead.get("message", ""),
                "fatal": True,
            }
        queue: asyncio.Queue = asyncio.Queue()
        req_id = self.send(op, **fields)
        self._queues[req_id] = queue
        try:
            while True:
                msg = await queue.get()
                if msg["event"] in FINAL_EVENTS:
                    return msg
                if on_event is not None:
                    on_event(msg)
        finally:
            del self._queues[req_id]

    # -- operations -------------------------------------------------------------------------------

    async def init(self) -> dict[str, Any]:
        """The worker's `ready` event (started once, shared by every caller)."""
        if self._ready_future is None:
            self._ready_future = asyncio.ensure_future(self.request("init"))
        self.ready = await asyncio.shield(self._ready_future)
        return self.ready

    async def load(self, model: dict[str, Any], on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        async with self._load_lock:
            return await self._load(model, on_event)

    async def ensure_loaded(self, model: dict[str, Any], on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """The model's `loaded` event, loading it only if this page's worker has not already."""
        async with self._load_lock:
            if self.loaded is not None and self.loaded["key"] == model["key"]:
                return self.loaded
            return await self._load(model, on_event)

    async def _load(self, model: dict[str, Any], on_event: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        result = await self.request("load", on_event, model=model)
        self.loaded = {**result, "key": model["key"]} if result["event"] == "loaded" else None
        return result

    async def chat(
        self,
        messages: list[dict[str, str]],
        settings: dict[str, Any],
        on_piece: Callable[[str], None],
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """A chat turn; `on_progress` gets the prompt's "progress" events (phase "prefill")."""
        return await self.request("chat", _events(on_piece, on_progress), messages=messages, settings=settings)

    async def complete(
        self,
        prompt: str,
        settings: dict[str, Any],
        on_piece: Callable[[str], None],
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        return await self.request("complete", _events(on_piece, on_progress), prompt=prompt, settings=settings)

    async def list_models(self) -> dict[str, Any]:
        return await self.request("list_models")

    async def delete_model(self, key: str) -> dict[str, Any]:
        return await self.request("delete_model", key=key)

    def abort(self) -> None:
        self.send("abort")

    def cancel_load(self) -> None:
        self.send("cancel_load")

    def reset(self) -> None:
        self.send("reset")

    def typing(self, on_answer: Callable[[dict[str, Any]], None]) -> bool:
        """Someone is typing a request: ask the worker to raise the GPU's clocks meanwhile, unless
        the GPU was busy within WARM_UP_EVERY_S. `?warmup=0` in the page's URL: never; `?warmup=1`:
        also on a CPU adapter (tests). `on_answer` gets the worker's `warmed` event (stats, or why it
        was skipped) or an error event (warm_up_outcome reads either). True when one was asked for."""
        now = time.monotonic()
        if self.dead is not None or now - self.gpu_busy_at < WARM_UP_EVERY_S:
            return False
        mode = str(js.URLSearchParams.new(js.location.search).get("warmup") or "")
        if mode == "0":
            return False
        self.gpu_busy_at = now
        task = asyncio.ensure_future(self.request("warm_up", force=mode == "1"))
        task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else on_answer(t.result()))
        return True


def warm_up_outcome(msg: dict[str, Any]) -> str:
    """How a warm-up request ended, as the pages' data-warm-up says it: "ran", or why not."""
    if msg.get("stats") is not None:
        return "ran"
    return str(msg.get("skipped") or msg.get("message") or "")


def _events(
    on_piece: Callable[[str], None], on_progress: Callable[[dict[str, Any]], None] | None
) -> Callable[[dict[str, Any]], None]:
    def on_event(msg: dict[str, Any]) -> None:
        if msg["event"] == "piece":
            on_piece(msg["text"])
        elif msg["event"] == "progress" and on_progress is not None:
            on_progress(msg)

    return on_event


_shared: dict[str, EngineClient] = {}


def shared_client(root_url: str) -> EngineClient:
    """One worker per page and site root: the chat and the widgets share its loaded model."""
    if root_url not in _shared:
        _shared[root_url] = EngineClient(root_url)
    return _shared[root_url]


def site_root(relative: str = "./") -> str:
    """Absolute URL of the site root (where engine-worker.js, pyodide/ and models/ live)."""
    href = str(js.URL.new(relative, js.document.baseURI).href)
    return href if href.endswith("/") else href + "/"
