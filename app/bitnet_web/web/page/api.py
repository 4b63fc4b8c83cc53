"""The page author's Python API: `Engine`, the shape of bitnet_web.engine.Engine, in the browser.

    from bitnet_web.web.page.api import Engine
    engine = Engine(root="/bitnet/")
    await engine.load(progress=lambda phase, done, total: ...)
    async for piece in engine.chat_async([{"role": "user", "content": "Hi"}], {"temperature": 0}):
        ...

It runs in a page's own `<script type="py">` and talks to the page's one engine worker, shared
with any widgets (and the chat app): a widget that needs another model loads it, and the next call
here loads this engine's model back first (from browser storage, no download). README "Script the
model from your page" documents it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from ..shared.settings import DEFAULTS
from .client import EngineClient, shared_client, site_root
from .services import probe_webgpu
from .widget import resolve_model

ProgressCallback = Callable[[str, int, "int | None"], None]


class EngineError(RuntimeError):
    """A request the engine could not serve; `kind` and `title` as the app's failure messages."""

    def __init__(self, kind: str, title: str, message: str) -> None:
        super().__init__(f"{title}: {message}" if title else message)
        self.kind = kind
        self.title = title


def _error(event: dict[str, Any]) -> EngineError:
    return EngineError(
        str(event.get("kind") or "internal"), str(event.get("title") or ""), str(event.get("message") or "")
    )


def _settings(settings: Any, max_tokens: int) -> dict[str, Any]:
    """The worker's settings dict from None, a dict or a SamplerSettings-like dataclass."""
    if settings is None:
        given: dict[str, Any] = {}
    elif dataclasses.is_dataclass(settings):
        given = dataclasses.asdict(settings)
    elif isinstance(settings, dict):
        given = dict(settings)
    else:
        raise TypeError(f"settings must be a dict or a SamplerSettings, got {type(settings).__name__}")
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown settings {', '.join(unknown)} (known: {', '.join(DEFAULTS)})")
    return {**DEFAULTS, **given, "max_tokens": int(max_tokens)}


class Engine:
    """One model in the page's shared engine worker.

    root: the bitnet-web site (where engine-worker.js, pyodide/ and models/ are), relative to the page.
    """

    def __init__(self, root: str = "./") -> None:
        self.root_url = site_root(root)
        self._client: EngineClient | None = None
        self._model: dict[str, Any] | None = None
        self._progress: ProgressCallback | None = None
        self.info: dict[str, Any] = {}  # engine.info of the loaded model (name, context_length, template_kind...)
        self.last_stats: dict[str, Any] = {}  # GenerationStats of the last request, as a dict

    async def _ready_client(self) -> EngineClient:
        if self._client is None:
            kind, text = await probe_webgpu()
            if kind is not None:
                raise EngineError(kind, "No WebGPU", text)
            client = shared_client(self.root_url)
            ready = await client.init()
            if ready["event"] == "error":
                raise _error(ready)
            self._client = client
        return self._client

    async def warm_up_async(self) -> dict[str, Any]:
        """Raise an idle GPU's clocks before a request (call it while your user types: a GPU idle for a
        few seconds runs the next reply at a fraction of its speed; bitnet_web.model.warm_up). Returns
        the worker's figures {"seconds", "submits", "heads", "stopped"}, or {"skipped": why} (no model
        loaded, a request running, a CPU adapter)."""
        client = await self._ready_client()
        event = await client.request("warm_up")
        if event["event"] == "error":
            raise _error(event)
        return event["stats"] if event.get("stats") is not None else {"skipped": str(event.get("skipped", ""))}

    async def load(self, model: str | None = None, progress: ProgressCallback | None = None) -> dict[str, Any]:
        """Load `model`: None (the site's default), an id from models/models.json (e.g.
        "bitnet-b1.58-2b-4t") or a GGUF URL. progress(phase, done, total) is called as it downloads,
        reads, verifies and uploads ("download", "read", "verify", "parse", "upload"; total may be
        None). Returns `info`. Raises EngineError (kind, title, message) when it cannot load."""
        client = await self._ready_client()
        try:
            descriptor = await resolve_model(self.root_url, model)
        except (ValueError, OSError) as e:
            raise EngineError("download", "Cannot find the model", str(e)) from None
        self._model, self._progress = descriptor, progress
        async with client.run_lock:
            await self._ensure_loaded(client)
        return self.info

    async def _ensure_loaded(self, client: EngineClient) -> None:
        def on_event(msg: dict[str, Any]) -> None:
            if msg["event"] == "progress" and self._progress is not None:
                total = msg.get("total")
                self._progress(str(msg["phase"]), int(msg["done"]), int(total) if total is not None else None)

        result = await client.ensure_loaded(self._model, on_event)
        if result["event"] != "loaded":
            raise _error(result)
        self.info = dict(result.get("info") or {})

    async def _stream(self, op: str, max_tokens: int, **fields: Any) -> AsyncIterator[str]:
        if self._model is None:
            raise EngineError("internal", "No model", "no model is loaded: call await engine.load() first")
        client = await self._ready_client()
        pieces: asyncio.Queue = asyncio.Queue()
        async with client.run_lock:
            await self._ensure_loaded(client)  # a widget may have loaded another model meanwhile
            request = asyncio.ensure_future(
                client.request(op, lambda m: pieces.put_nowait(m["text"]) if m["event"] == "piece" else None, **fields)
            )
            request.add_done_callback(lambda _: pieces.put_nowait(None))
            try:
                while (piece := await pieces.get()) is not None:
                    yield piece
            finally:
                if not request.done():  # the caller stopped iterating: end the generation
                    client.abort()
                result = await request
        if result["event"] != "done":
            if result.get("kind") == "device_lost":
                client.loaded = None  # the next request loads the model again on a fresh device
            raise _error(result)
        self.last_stats = dict(result.get("stats") or {})

    async def chat_async(
        self, messages: Sequence[dict[str, str]], settings: Any = None, max_tokens: int = 256
    ) -> AsyncIterator[str]:
        """Stream the reply to OpenAI-style `messages` ([{"role": "system"|"user"|"assistant",
        "content": str}, ...]) as text pieces. settings: a dict of temperature, top_k, top_p,
        repetition_penalty, seed (defaults as the chat app's) or a SamplerSettings. Old turns are
        dropped when the conversation does not fit the context. A model without a chat template
        (template_kind "completion") gets the messages' contents joined as plain text."""
        async for piece in self._stream(
            "chat", max_tokens, messages=[dict(m) for m in messages], settings=_settings(settings, max_tokens)
        ):
            yield piece

    async def complete_async(self, prompt: str, settings: Any = None, max_tokens: int = 256) -> AsyncIterator[str]:
        """Stream the continuation of `prompt` (plain text, no chat format)."""
        async for piece in self._stream(
            "complete", max_tokens, prompt=prompt, settings=_settings(settings, max_tokens)
        ):
            yield piece

    def abort(self) -> None:
        """Stop the running generation after the token being computed (its stream then ends)."""
        if self._client is not None:
            self._client.abort()

    def reset(self) -> None:
        """Forget the cached context (the next request recomputes its whole prompt)."""
        if self._client is not None:
            self._client.reset()
