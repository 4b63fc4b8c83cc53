"""The embeddable TL;DR widget: paste text, get a short summary from the page's shared engine.

Embed (see README "Embed the widget"):

    <script type="module" src="BASE/pyscript/core.js"></script>
    <div id="tldr"></div>
    <script type="py" config='{"interpreter": "BASE/pyodide/pyodide.mjs",
                               "files": {"BASE/bitnet_web.zip": "./*"}}'>
    from bitnet_web.web.page.widget import mount_tldr
    mount_tldr("#tldr", root="BASE/")
    </script>

Every widget on a page (and the chat app, if present) shares one engine worker and its loaded
model. The container gets data-state: "starting" | "ready" | "busy" | "done" | "error".
"""

from __future__ import annotations

import asyncio
from typing import Any

import js

from ..shared.failures import describe
from ..shared.progress import progress_text, stats_line
from ..shared.prompts import clip_to_context, summary_messages, summary_prompt
from ..shared.settings import greedy
from . import services
from .client import EngineClient, shared_client, site_root
from .dom import Listeners, append_text, clear, el, set_text

MAX_TOKEN_CHOICES = (16, 32, 64, 128, 256)


class TldrWidget:
    def __init__(self, container: Any, root_url: str, model_url: str | None = None, max_tokens: int = 64) -> None:
        self.container = container
        self.root_url = root_url
        self.model_url = model_url
        self.client: EngineClient | None = None
        self.info: dict[str, Any] = {}
        self.listeners = Listeners()
        self.busy = False
        choices = sorted(set(MAX_TOKEN_CHOICES) | {max_tokens})
        uid = f"tldr-{id(self):x}"
        self.text = el(
            "textarea", attrs={"id": uid + "-text", "rows": "7", "placeholder": "Paste an article, an e-mail, notes…"}
        )
        self.max_tokens = el(
            "select",
            attrs={"id": uid + "-max"},
            children=[el("option", str(n), attrs={"value": str(n)}) for n in choices],
        )
        self.max_tokens.value = str(max_tokens)
        self.button = el("button", "Summarize", cls="primary", attrs={"type": "button", "disabled": ""})
        self.stop_button = el("button", "Stop", attrs={"type": "button", "disabled": ""})
        self.summary = el("div", cls="summary", attrs={"aria-live": "polite", "data-role": "summary"})
        self.stats = el("div", cls="stats muted", attrs={"data-role": "stats"})
        self.status = el("div", "Starting…", cls="status muted", attrs={"role": "status"})
        clear(container)
        container.classList.add("tldr")
        container.append(
            el("h2", "TL;DR"),
            el("label", "Text to summarize", attrs={"for": uid + "-text"}),
            self.text,
            el(
                "div",
                cls="controls",
                children=[
                    el("label", children=[el("span", "Max tokens"), self.max_tokens]),
                    self.button,
                    self.stop_button,
                ],
            ),
            self.summary,
            self.stats,
            self.status,
        )
        self.listeners.on(self.button, "click", lambda e: asyncio.ensure_future(self.summarize()))
        self.listeners.on(self.stop_button, "click", lambda e: self.client and self.client.abort())
        self._state("starting")

    def _state(self, state: str) -> None:
        self.container.setAttribute("data-state", state)

    def _fail(self, kind: str, message: str) -> None:
        f = describe(kind, message)
        self.summary.classList.add("error")
        set_text(self.summary, f"{f.title}: {f.message}")
        set_text(self.status, " ".join(f.advice[:1]))
        self._state("error")

    async def start(self) -> None:
        kind, text = await services.probe_webgpu()
        if kind is not None:
            self._fail(kind, text)
            return
        self.client = shared_client(self.root_url)
        ready = await self.client.init()
        if ready["event"] == "error":
            self._fail(ready.get("kind", "worker_start"), ready.get("message", ""))
            return
        asyncio.ensure_future(services.register_service_worker(self.root_url))
        self.client.listeners.append(self._on_worker_event)
        if await self._load_model():
            self.button.disabled = False
            self._state("ready")

    def _on_worker_event(self, msg: dict[str, Any]) -> None:
        if msg["event"] == "error" and msg.get("kind") == "device_lost":
            self.client.loaded = None  # the GPU went away while idle: the next Summarize loads it again

    async def _load_model(self) -> bool:
        """Load the widget's model unless the page's worker already has it (from browser storage
        after the first visit); False, with the failure shown, when it cannot be loaded."""
        model = await self._model()
        if model is None:
            return False

        def on_event(msg: dict[str, Any]) -> None:
            if msg["event"] == "progress":
                set_text(self.status, progress_text(msg["phase"], int(msg["done"]), msg.get("total"), None, None))

        set_text(self.status, f"Loading {model['name']}…")
        result = await self.client.ensure_loaded(model, on_event)
        if result["event"] != "loaded":
            self._fail(result.get("kind", "internal"), result.get("message", ""))
            return False
        self.info = result.get("info") or {}
        set_text(self.status, f"Model: {self.info.get('name') or model['name']}")
        return True

    async def _model(self) -> dict[str, Any] | None:
        if self.model_url:
            return services.custom_descriptor(str(js.URL.new(self.model_url, self.root_url).href))
        try:
            manifest = await services.fetch_json(self.root_url + "models/models.json")
        except Exception as e:
            self._fail("download", f"the model list could not be read: {e}")
            return None
        models = manifest.get("models") or []
        entry = next((m for m in models if m.get("id") == manifest.get("default")), models[0] if models else None)
        if entry is None:
            self._fail("download", "the model list is empty")
            return None
        return services.model_descriptor(entry, self.root_url)

    async def summarize(self) -> None:
        if self.busy or self.client is None:
            return
        max_tokens = int(self.max_tokens.value)
        text, cut = clip_to_context(
            str(self.text.value), self.info.get("context_length"), reserve_tokens=max_tokens + 64
        )
        if not text:
            set_text(self.status, "Paste some text first.")
            return
        self.busy = True
        self._state("busy")
        self.button.disabled = True
        self.summary.classList.remove("error")
        clear(self.summary)
        if self.client.loaded is None and not await self._load_model():  # the GPU was lost: load it again
            self.busy = False
            self.button.disabled = False
            return
        self.stop_button.disabled = False
        set_text(self.stats, "")
        set_text(self.status, "Summarizing" + (" (text shortened to fit the model's context)…" if cut else "…"))
        pieces = [0]

        def on_piece(piece: str) -> None:
            pieces[0] += 1
            append_text(self.summary, piece)
            self.summary.setAttribute("data-pieces", str(pieces[0]))

        settings = greedy(max_tokens)
        try:
            if self.info.get("template_kind") == "completion":
                result = await self.client.complete(summary_prompt(text), settings, on_piece)
            else:
                result = await self.client.chat(summary_messages(text), settings, on_piece)
        finally:
            self.busy = False
            self.button.disabled = False
            self.stop_button.disabled = True
        if result["event"] == "done":
            stats = result.get("stats") or {}
            set_text(self.stats, stats_line(stats, result.get("reason")))
            set_text(self.status, "Done." if result.get("reason") != "aborted" else "Stopped.")
            self._state("done")
        else:
            if result.get("kind") == "device_lost":
                self.client.loaded = None  # the worker dropped the model with the device
            self._fail(result.get("kind", "internal"), result.get("message", ""))
            if result.get("kind") == "device_lost":
                set_text(self.status, "Press Summarize to load the model again (from browser storage) and retry.")


_widgets: list[TldrWidget] = []


def mount_tldr(selector: str, root: str = "./", model: str | None = None, max_tokens: int = 64) -> TldrWidget:
    """Build a TL;DR box inside the element matching `selector`.

    root: URL of the bitnet-web site (where engine-worker.js, pyodide/ and models/ are), relative
    to the page. model: a GGUF URL to use instead of the site's default model.
    """
    container = js.document.querySelector(selector)
    if container is None:
        raise LookupError(f"mount_tldr: no element matches {selector!r}")
    widget = TldrWidget(container, site_root(root), model, max_tokens)
    _widgets.append(widget)
    task = asyncio.ensure_future(widget.start())
    task.add_done_callback(lambda t: _report(widget, t))
    return widget


def _report(widget: TldrWidget, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        js.console.error(f"bitnet-web widget: {type(exc).__name__}: {exc}")
        widget._fail("internal", f"{type(exc).__name__}: {exc}")
