"""Embeddable widgets: a TL;DR box (needs a chat model) and Python code completion (any model).

Embed (README "Embed a widget" has the exact snippet and the list of files an embed loads):

    <script type="module" src="BASE/pyscript/core.js"></script>
    <div id="code">def fibonacci(n):</div>
    <script type="py" config='{"interpreter": "BASE/pyodide/pyodide.mjs",
                               "files": {"BASE/bitnet_web.zip": "./*"}}'>
    from bitnet_web.web.page.widget import mount_code
    mount_code("#code", root="BASE/")
    </script>

Each widget draws into a shadow root of its container with its own stylesheet (widget/widget.css),
so the host page's styles and the widget's never meet. Nothing registers a service worker unless
the embedder passes offline=True. Every widget on a page (and page scripts using api.Engine, and the
chat app) shares one engine worker; a widget whose model is not the one loaded loads its own
before it generates. The container gets data-state: "starting" | "ready" | "busy" | "done" |
"error", and for the TL;DR box also "download" (its model is not in this browser yet) and
"unsupported" (the model cannot do the task); typing into a widget raises the GPU's clocks for its
request (EngineClient.typing), and data-warm-up says how the last warm-up ended ("ran", or why not).
"""

from __future__ import annotations

import asyncio
from typing import Any

import js

from ..shared.failures import describe
from ..shared.progress import format_bytes, progress_text, stats_line
from ..shared.prompts import clip_to_context, summary_messages
from ..shared.settings import greedy
from . import services
from .client import EngineClient, shared_client, site_root, warm_up_outcome
from .dom import Listeners, append_text, clear, el, set_text

MAX_TOKEN_CHOICES = (16, 32, 64, 128, 256)
TLDR_MODEL_ID = "bitnet-b1.58-2b-4t"  # models.json id of the chat model the TL;DR box uses by default
STYLESHEET = "widget/widget.css"  # relative to the site root


def completion_only_reason(name: str) -> str:
    """Why a model without a chat template cannot summarize (shown in the TL;DR box)."""
    return (
        f"{name} is a completion-only model (it has no chat template): it continues the text it is "
        'given and does not follow instructions such as "summarize this", so its summaries would '
        "be nonsense. The TL;DR box needs a chat model, such as BitNet b1.58 2B-4T."
    )


async def resolve_model(root_url: str, model: str | None, default_id: str | None = None) -> dict[str, Any]:
    """The worker's descriptor for `model`: None (the site's default, or `default_id`), an id from
    models/models.json, or a GGUF URL (relative to the page). Raises ValueError/OSError with the cause."""
    if model and not model.startswith(("http:", "https:", "/", ".")) and not model.endswith(".gguf"):
        wanted = model
    elif model:
        return services.custom_descriptor(str(js.URL.new(model, js.document.baseURI).href))
    else:
        wanted = default_id
    try:
        manifest = await services.fetch_json(root_url + "models/models.json")
    except Exception as e:
        raise OSError(f"the model list {root_url}models/models.json could not be read: {e}") from None
    models = manifest.get("models") or []
    wanted = wanted or manifest.get("default")
    entry = next((m for m in models if m.get("id") == wanted), None)
    if entry is None:
        known = ", ".join(str(m.get("id")) for m in models) or "none"
        raise ValueError(f"the model list has no model {wanted!r} (it has: {known})")
    return {**services.model_descriptor(entry, root_url), "id": entry.get("id")}


class _Widget:
    """What both widgets share: the shadow root, the shared engine, loading their model, failures."""

    title = ""

    def __init__(self, container: Any, root_url: str, model: str | None, offline: bool) -> None:
        self.container = container
        self.root_url = root_url
        self.model_arg = model
        self.offline = offline
        self.model: dict[str, Any] | None = None
        self.client: EngineClient | None = None
        self.info: dict[str, Any] = {}
        self.listeners = Listeners()
        self.busy = False
        shadow = container.shadowRoot or container.attachShadow(js.Object.fromEntries([["mode", "open"]]))
        clear(shadow)
        shadow.append(el("link", attrs={"rel": "stylesheet", "href": root_url + STYLESHEET}))
        self.card = el("section", cls="card", attrs={"aria-label": self.title})
        shadow.append(self.card)
        self.model_line = el("p", "Model: …", cls="model", attrs={"data-role": "model"})
        self.output = el("div", cls="output", attrs={"aria-live": "polite", "data-role": "output"})
        self.stats = el("div", cls="stats muted", attrs={"data-role": "stats"})
        self.status = el("div", "Starting…", cls="status muted", attrs={"role": "status", "data-role": "status"})
        self._state("starting")

    def _state(self, state: str) -> None:
        self.container.setAttribute("data-state", state)

    def _on_typing(self, event: Any) -> None:
        """Typing announces a request: the GPU's clocks are raised meanwhile (EngineClient.typing). The
        container's data-warm-up says how the last one ended: "ran" or why not."""
        if self.client is None or self.busy:
            return
        self.client.typing(lambda msg: self.container.setAttribute("data-warm-up", warm_up_outcome(msg)))

    def _fail(self, kind: str, message: str) -> None:
        f = describe(kind, message)
        self.output.classList.add("error")
        set_text(self.output, f"{f.title}: {f.message}")
        set_text(self.status, " ".join(f.advice[:1]))
        self._state("error")

    def _name_model(self, extra: str = "") -> None:
        name = self.info.get("name") or (self.model or {}).get("name") or "?"
        set_text(self.model_line, f"Model: {name}{extra}")

    async def _start_engine(self) -> bool:
        """WebGPU, the shared worker and the model descriptor; False with the failure shown."""
        try:
            self.model = await resolve_model(self.root_url, self.model_arg, self._default_model_id())
        except (ValueError, OSError) as e:
            self._fail("download", str(e))
            return False
        self._name_model()
        kind, text = await services.probe_webgpu()
        if kind is not None:
            self._fail(kind, text)
            return False
        self.client = shared_client(self.root_url)
        ready = await self.client.init()
        if ready["event"] == "error":
            self._fail(ready.get("kind", "worker_start"), ready.get("message", ""))
            return False
        if self.offline:  # the embedder opted in: precache the app on this site for offline use
            asyncio.ensure_future(services.register_service_worker(self.root_url))
        self.client.listeners.append(self._on_worker_event)
        return True

    def _default_model_id(self) -> str | None:
        return None

    def _on_worker_event(self, msg: dict[str, Any]) -> None:
        if msg["event"] == "error" and msg.get("kind") == "device_lost":
            self.client.loaded = None  # the GPU went away while idle: the next request loads it again

    def _on_load_event(self, msg: dict[str, Any]) -> None:
        """Progress of a load, or of reading a request's prompt (phase "prefill")."""
        if msg["event"] == "progress":
            set_text(self.status, progress_text(msg["phase"], int(msg["done"]), msg.get("total"), None, None))

    async def _ensure_model(self) -> bool:
        """Load this widget's model unless the shared worker already holds it; False with the
        failure shown when it cannot be loaded."""
        if self.client.loaded is None or self.client.loaded["key"] != self.model["key"]:
            set_text(self.status, f"Loading {self.model['name']}…")
        result = await self.client.ensure_loaded(self.model, self._on_load_event)
        if result["event"] != "loaded":
            self._fail(result.get("kind", "internal"), result.get("message", ""))
            return False
        self.info = result.get("info") or {}
        self._name_model()
        return True

    async def _generate(self, op: str, payload: Any, max_tokens: int, on_piece, busy_text: str) -> None:
        """Run one request on this widget's model (loading it first if another holds the worker)."""
        self.busy = True
        self._state("busy")
        self._set_running(True)
        self.output.classList.remove("error")
        set_text(self.stats, "")
        try:
            async with self.client.run_lock:
                if not await self._ensure_model():
                    return
                set_text(self.status, busy_text)
                # a long text is read in parts: the status counts its tokens until the first piece
                reading = [False]

                def on_progress(msg: dict[str, Any]) -> None:
                    reading[0] = True
                    self._on_load_event(msg)

                def piece(text: str) -> None:
                    if reading[0]:
                        reading[0] = False
                        set_text(self.status, busy_text)
                    on_piece(text)

                run = self.client.chat if op == "chat" else self.client.complete
                result = await run(payload, greedy(max_tokens), piece, on_progress)
        finally:
            self.busy = False
            self._set_running(False)
        if result["event"] == "done":
            stats = result.get("stats") or {}
            set_text(self.stats, stats_line(stats, result.get("reason")))
            set_text(self.status, "Stopped." if result.get("reason") == "aborted" else _end_note(stats))
            self._state("done")
        else:
            if result.get("kind") == "device_lost":
                self.client.loaded = None  # the worker dropped the model with the device
            self._fail(result.get("kind", "internal"), result.get("message", ""))
            if result.get("kind") == "device_lost":
                set_text(self.status, "Press the button again to load the model again (from browser storage).")

    def _set_running(self, running: bool) -> None:
        raise NotImplementedError

    def _controls(self, uid: str, action: str, max_tokens: int, *extra: Any) -> Any:
        """The row under the input: Max tokens, the action button, Stop, then `extra` buttons.

        Sets `self.max_tokens`, `self.button` (the action) and `self.stop_button`; both start disabled.
        """
        self.max_tokens = _token_select(MAX_TOKEN_CHOICES, max_tokens, uid + "-max")
        self.button = el("button", action, cls="primary", attrs={"type": "button", "disabled": ""})
        self.stop_button = el("button", "Stop", attrs={"type": "button", "disabled": ""})
        label = el("label", attrs={"for": uid + "-max"}, children=[el("span", "Max tokens")])
        return el("div", cls="controls", children=[label, self.max_tokens, self.button, self.stop_button, *extra])


def _end_note(stats: dict[str, Any]) -> str:
    reason = stats.get("stop_reason")
    if reason == "max_tokens":
        return "Done: stopped at the token limit (raise Max tokens for more)."
    if reason == "context_full":
        return "Done: stopped because the model's context is full."
    return "Done."


def _token_select(choices: tuple[int, ...], initial: int, uid: str) -> Any:
    node = el(
        "select",
        attrs={"id": uid},
        children=[el("option", str(n), attrs={"value": str(n)}) for n in sorted(set(choices) | {initial})],
    )
    node.value = str(initial)
    return node


class TldrWidget(_Widget):
    """Summarizes pasted text with a chat model (BitNet b1.58 2B-4T by default); refuses models
    without a chat template, and offers the download when the model is not in this browser yet."""

    title = "TL;DR"

    def __init__(
        self, container: Any, root_url: str, model: str | None = None, max_tokens: int = 64, offline: bool = False
    ) -> None:
        super().__init__(container, root_url, model, offline)
        uid = f"tldr-{id(self):x}"
        self.text = el(
            "textarea", attrs={"id": uid + "-text", "rows": "7", "placeholder": "Paste an article, an e-mail, notes…"}
        )
        self.download_button = el(
            "button", "Download", cls="primary", attrs={"type": "button", "data-role": "download"}
        )
        self.cancel_button = el("button", "Cancel", attrs={"type": "button", "hidden": ""})
        self.notice = el(
            "div",
            cls="notice",
            attrs={"hidden": "", "data-role": "notice"},
            children=[el("p"), el("div", cls="controls", children=[self.download_button, self.cancel_button])],
        )
        self.card.append(
            el("h2", "TL;DR"),
            self.model_line,
            self.notice,
            el("label", "Text to summarize", attrs={"for": uid + "-text"}),
            self.text,
            self._controls(uid, "Summarize", max_tokens),
            self.output,
            self.stats,
            self.status,
        )
        self.listeners.on(self.button, "click", lambda e: asyncio.ensure_future(self.summarize()))
        self.listeners.on(self.text, "input", self._on_typing)
        self.listeners.on(self.stop_button, "click", lambda e: self.client and self.client.abort())
        self.listeners.on(self.download_button, "click", lambda e: asyncio.ensure_future(self.download()))
        self.listeners.on(self.cancel_button, "click", lambda e: self.client and self.client.cancel_load())

    def _default_model_id(self) -> str | None:
        return TLDR_MODEL_ID

    def _set_running(self, running: bool) -> None:
        self.button.disabled = running
        self.stop_button.disabled = not running

    def _refuse(self, name: str) -> None:
        self.button.disabled = True
        self.text.disabled = True
        self.notice.hidden = True
        self.output.classList.add("error")
        set_text(self.output, "This model cannot summarize. " + completion_only_reason(name))
        set_text(self.status, "Pass model=… a chat model (one with a chat template) to use this box.")
        self._state("unsupported")

    def _chat_capable(self, info: dict[str, Any]) -> bool | None:
        """From engine info (template_kind) or a GGUF header (has_chat_template); None if unknown."""
        if info.get("template_kind"):
            return info["template_kind"] != "completion"
        if "has_chat_template" in info:
            return bool(info["has_chat_template"])
        return None

    async def start(self) -> None:
        if not await self._start_engine():
            return
        loaded = self.client.loaded
        if loaded is not None and loaded["key"] == self.model["key"]:
            self.info = loaded.get("info") or {}
        else:
            entries = (await self.client.list_models()).get("entries") or []
            cached = next((e for e in entries if e.get("key") == self.model["key"] and e.get("complete")), None)
            if cached is None and not self.model.get("bundled"):
                self._offer_download()
                return
            self.info = dict((cached or {}).get("header") or {})
        if self._chat_capable(self.info) is False:
            self._name_model()
            self._refuse(self.info.get("name") or self.model["name"])
            return
        await self._load_checked()

    def _offer_download(self) -> None:
        size = self.model.get("size") or self.model.get("size_hint")
        what = f"{format_bytes(size)} " if size else ""
        self.notice.firstChild.textContent = (
            f"{self.model['name']} is not in this browser yet. It is downloaded once ({what}from "
            f"{js.URL.new(self.model['url']).host}) and kept in this browser's storage; later visits "
            "load it from there, offline."
        )
        set_text(self.download_button, f"Download {what}".strip())
        self.notice.hidden = False
        set_text(self.status, "The model must be downloaded before the first summary.")
        self._state("download")

    async def download(self) -> None:
        if self.client is None or self.busy:
            return
        shortfall = await services.storage_shortfall(self.model.get("size") or self.model.get("size_hint"))
        if shortfall:
            self._fail("quota", shortfall)
            return
        await services.request_persistence()
        self.download_button.disabled = True
        self.cancel_button.hidden = False
        try:
            await self._load_checked()
        finally:
            self.download_button.disabled = False
            self.cancel_button.hidden = True

    async def _load_checked(self) -> None:
        """Load the model, stopping the download as soon as its header shows it has no chat template."""
        refused: list[str] = []

        def on_event(msg: dict[str, Any]) -> None:
            if msg["event"] == "header" and self._chat_capable(msg.get("info") or {}) is False and not refused:
                refused.append(str((msg.get("info") or {}).get("name") or self.model["name"]))
                self.client.cancel_load()
            else:
                self._on_load_event(msg)

        self._state("starting")
        set_text(self.status, f"Loading {self.model['name']}…")
        async with self.client.run_lock:
            result = await self.client.ensure_loaded(self.model, on_event)
        if refused or (result["event"] == "loaded" and self._chat_capable(result.get("info") or {}) is False):
            self._refuse(refused[0] if refused else str((result.get("info") or {}).get("name") or self.model["name"]))
            return
        if result["event"] != "loaded":
            self._fail(result.get("kind", "internal"), result.get("message", ""))
            if result.get("kind") == "cancelled" and not self.model.get("bundled"):
                self._offer_download()
            return
        self.info = result.get("info") or {}
        self._name_model()
        self.notice.hidden = True
        self.button.disabled = False
        set_text(self.status, "Ready.")
        self._state("ready")

    async def summarize(self) -> None:
        if self.busy or self.client is None or self.button.disabled:
            return
        max_tokens = int(self.max_tokens.value)
        text, cut = clip_to_context(
            str(self.text.value), self.info.get("context_length"), reserve_tokens=max_tokens + 64
        )
        if not text:
            set_text(self.status, "Paste some text first.")
            return
        clear(self.output)
        pieces = [0]

        def on_piece(piece: str) -> None:
            pieces[0] += 1
            append_text(self.output, piece)
            self.output.setAttribute("data-pieces", str(pieces[0]))

        note = " (text shortened to fit the model's context)…" if cut else "…"
        await self._generate("chat", summary_messages(text), max_tokens, on_piece, "Summarizing" + note)


class CodeWidget(_Widget):
    """Python code completion: the model continues the code in the box; Accept appends it."""

    title = "Python code completion"

    def __init__(
        self,
        container: Any,
        root_url: str,
        code: str,
        model: str | None = None,
        max_tokens: int = 48,
        offline: bool = False,
    ) -> None:
        super().__init__(container, root_url, model, offline)
        uid = f"code-{id(self):x}"
        self.code = el("textarea", cls="code", attrs={"id": uid + "-code", "rows": "8", "spellcheck": "false"})
        self.code.value = code
        self.accept_button = el("button", "Accept", attrs={"type": "button", "disabled": ""})
        self.output = el("pre", cls="output", attrs={"aria-live": "polite", "data-role": "output"})
        self.completion = el("span", cls="completion", attrs={"data-role": "completion"})
        self.card.append(
            el("h2", "Python code completion"),
            self.model_line,
            el("label", "Code to continue", attrs={"for": uid + "-code"}),
            self.code,
            self._controls(uid, "Complete", max_tokens, self.accept_button),
            self.output,
            self.stats,
            self.status,
        )
        self.listeners.on(self.button, "click", lambda e: asyncio.ensure_future(self.complete()))
        self.listeners.on(self.code, "input", self._on_typing)
        self.listeners.on(self.stop_button, "click", lambda e: self.client and self.client.abort())
        self.listeners.on(self.accept_button, "click", lambda e: self.accept())

    def _set_running(self, running: bool) -> None:
        self.button.disabled = running
        self.stop_button.disabled = not running
        self.accept_button.disabled = running or not str(self.completion.textContent)

    async def start(self) -> None:
        if not await self._start_engine():
            return
        async with self.client.run_lock:
            ok = await self._ensure_model()
        if ok:
            self.button.disabled = False
            set_text(self.status, "Ready: edit the code, then Complete.")
            self._state("ready")

    async def complete(self) -> None:
        if self.busy or self.client is None:
            return
        code = str(self.code.value)
        if not code.strip():
            set_text(self.status, "Write the start of some Python code first.")
            return
        max_tokens = int(self.max_tokens.value)
        context = self.info.get("context_length")
        kept, cut = clip_to_context(code[::-1], context, reserve_tokens=max_tokens + 8)  # keep the end
        prompt = kept[::-1] if cut else code
        clear(self.output)
        clear(self.completion)
        self.output.append(js.document.createTextNode(prompt), self.completion)

        def on_piece(piece: str) -> None:
            append_text(self.completion, piece)

        note = " (only the end of the code fits the model's context)…" if cut else "…"
        await self._generate("complete", prompt, max_tokens, on_piece, "Completing" + note)

    def accept(self) -> None:
        self.code.value = str(self.code.value) + str(self.completion.textContent)
        clear(self.output)
        clear(self.completion)
        self.accept_button.disabled = True
        set_text(self.status, "Added to the code.")


_widgets: list[_Widget] = []


def _mount(widget: _Widget) -> _Widget:
    _widgets.append(widget)
    task = asyncio.ensure_future(widget.start())
    task.add_done_callback(lambda t: _report(widget, t))
    return widget


def _container(selector: str, who: str) -> Any:
    container = js.document.querySelector(selector)
    if container is None:
        raise LookupError(f"{who}: no element matches {selector!r}")
    return container


def mount_tldr(
    selector: str, root: str = "./", model: str | None = None, max_tokens: int = 64, offline: bool = False
) -> TldrWidget:
    """Build a TL;DR box inside the element matching `selector`.

    root: URL of the bitnet-web site (where engine-worker.js, pyodide/ and models/ are), relative
    to the page. model: a models.json id or a GGUF URL (a chat model; default BitNet b1.58 2B-4T).
    offline: register the site's service worker, which precaches the whole app for offline use.
    """
    container = _container(selector, "mount_tldr")
    return _mount(TldrWidget(container, site_root(root), model, max_tokens, offline))


def mount_code(
    selector: str,
    root: str = "./",
    code: str | None = None,
    model: str | None = None,
    max_tokens: int = 48,
    offline: bool = False,
) -> CodeWidget:
    """Build a Python code-completion box inside the element matching `selector`.

    code: the starting code (default: the element's own text, e.g. `<div id="c">def f(x):</div>`).
    model: a models.json id or a GGUF URL (default: the site's default model, the bundled one).
    root, offline: as for mount_tldr.
    """
    container = _container(selector, "mount_code")
    start = str(container.textContent) if code is None else code
    start = start.strip("\n")
    return _mount(CodeWidget(container, site_root(root), start, model, max_tokens, offline))


def _report(widget: _Widget, task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        js.console.error(f"bitnet-web widget: {type(exc).__name__}: {exc}")
        widget._fail("internal", f"{type(exc).__name__}: {exc}")
