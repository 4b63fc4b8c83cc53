"""The chat page (static/index.html), main thread.

State the page keeps: the conversation (`self.messages`, without the system prompt), the model
list, and the engine worker client. The page never holds model bytes. Streaming text is appended
as Text nodes; nothing from a model or a file is interpreted as HTML.

URL parameters: `?autoload=0` skips loading the last used (or default) model at start.

Test hooks: `#app` carries data-engine ("starting" | "ready" | "missing" | "failed"), data-model
("none" | "loading" | "loaded" | "header" | "error" | "lost": the GPU device was lost), data-source
("network" | "cache" | "" for the last load), data-key (the usable model's URL), data-loads (loads
started so far), data-load (the last load's outcome: "running" | "ok" | its error kind; a failed load
leaves data-model "loaded" when the model loaded before it stays usable) and data-busy ("1" while
generating); each reply bubble carries data-pieces (streamed pieces received), data-state
("streaming" | "done" | "aborted" | "error") and data-cut ("max_tokens" | "context_full": a visible
note says the reply was cut). In completion mode a prompt and its reply share one code block, as
inner .msg.user and .msg.assistant spans.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import js

from ..shared import hosts
from ..shared.checkpoints import LOSSY_FIELD, as_checkpoint
from ..shared.failures import describe
from ..shared.modelinfo import info_rows
from ..shared.progress import RateMeter, cut_note, fraction, progress_text, stats_line
from ..shared.prompts import turn_request
from ..shared.settings import DEFAULT_SYSTEM_PROMPT, FIELDS, SettingsError, format_number, parse_form
from . import services
from .client import EngineClient, shared_client, site_root
from .dom import Listeners, append_text, by_id, clear, el, render_failure, set_text, show

LAST_MODEL_KEY = "bitnet-web:last-model"


class ChatApp:
    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.client: EngineClient | None = None
        self.listeners = Listeners()
        self.cache_listeners = Listeners()  # the delete buttons, rebuilt with the list
        self.notice_listeners = Listeners()  # a button inside the notice (e.g. load the model again)
        self.messages: list[dict[str, str]] = []
        self.manifest: dict[str, Any] = {"models": []}
        self.cached: list[dict[str, Any]] = []
        self.info: dict[str, Any] | None = None
        self.stats: dict[str, Any] | None = None
        self.loading = False
        self.load_count = 0
        self.generating = False
        self.current: dict[str, Any] | None = None  # the usable model: key, name, info, source
        self.ready_text = ""  # the status line while a model is ready (back after Stop, New chat)
        self.chat_id = 0  # New chat increments it: a reply that ends later belongs to a discarded chat
        self.model_sources: list[str] = []  # the page's connect-src: where a Custom URL may point
        self.meter = RateMeter()
        self.n = {
            name: by_id(name)
            for name in (
                "app",
                "status",
                "offline-status",
                "failure",
                "notice",
                "messages",
                "stats",
                "composer",
                "prompt",
                "send",
                "stop",
                "new-chat",
                "model-select",
                "model-desc",
                "custom-url-row",
                "custom-url",
                "load",
                "cancel-load",
                "progress",
                "progress-text",
                "model-info",
                "system-prompt",
                "system-note",
                "custom-hosts",
                "settings-fields",
                "settings-error",
                "storage-summary",
                "persist",
                "cache-list",
            )
        }

    # -- start ------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._state(engine="starting", model="none", busy="0")
        self._status("Checking WebGPU…")
        kind, gpu_text = await services.probe_webgpu()
        asyncio.ensure_future(self._offline())
        if kind is not None:
            self._state(engine="failed")
            f = describe(kind, gpu_text)
            render_failure(self.n["failure"], f.title, f.message, f.advice)
            show(self.n["app"], False)
            self._status(f.title)
            return
        self._build_settings()
        self._show_allowed_hosts()
        self._bind()
        try:
            self.manifest = await services.fetch_json(self.root_url + "models/models.json")
        except Exception as e:
            self._notice("download", f"The model list could not be read: {e}")
        self._fill_model_select()
        self._status("Starting the engine worker (Python + numpy)…")
        self.client = shared_client(self.root_url)
        self.client.listeners.append(self._on_worker_event)
        ready = await self.client.init()
        if ready["event"] == "error":
            self._state(engine="failed")
            self._show_error(ready)
            return
        self._state(engine="ready" if ready.get("engine_available") else "missing")
        gpu = ready.get("gpu") or {}
        self._status(
            f"Ready. {gpu_text}" if gpu.get("available") else f"Ready, but the worker sees no GPU: {gpu.get('error')}"
        )
        if ready.get("engine_error"):
            self._notice("engine_missing", ready["engine_error"])
        if ready.get("store_error"):
            self._notice("quota", f"Browser storage is unavailable: {ready['store_error']}")
        await self._refresh_cache()
        self.n["load"].disabled = False
        self._pick_start_model()
        if str(js.URLSearchParams.new(js.location.search).get("autoload")) != "0":
            await self.load_selected()
        else:
            self._status("Ready: choose a model and press Load.")

    def _state(self, **attrs: str) -> None:
        for k, v in attrs.items():
            self.n["app"].setAttribute("data-" + k, v)

    def _status(self, text: str) -> None:
        set_text(self.n["status"], text)

    async def _offline(self) -> None:
        text = await services.register_service_worker(self.root_url)
        set_text(self.n["offline-status"], text)
        self.n["offline-status"].setAttribute("data-ready", "1" if text == "Available offline" else "0")

    # -- building the form ------------------------------------------------------------------------

    def _build_settings(self) -> None:
        box = self.n["settings-fields"]
        clear(box)
        for f in FIELDS:
            field_id = "setting-" + f.name.replace("_", "-")
            attrs = {
                "id": field_id,
                "name": f.name,
                "type": "number",
                "inputmode": "decimal",
                "spellcheck": "false",
                "min": format_number(f.low),
                "max": format_number(f.high),
                "step": "1" if f.kind is int else "0.05",
                "value": "" if f.default is None else format_number(f.default),
                # an emptied field uses the default: the placeholder shows which
                "placeholder": "random" if f.default is None else format_number(f.default),
                "aria-describedby": field_id + "-hint",
            }
            box.append(
                el(
                    "label",
                    children=[
                        el("span", f.label),
                        el("input", attrs=attrs),
                        el("small", f.hint, cls="muted", attrs={"id": field_id + "-hint"}),
                    ],
                )
            )
        self.n["system-prompt"].value = DEFAULT_SYSTEM_PROMPT

    def _show_allowed_hosts(self) -> None:
        meta = js.document.querySelector('meta[http-equiv="Content-Security-Policy"]')
        self.model_sources = hosts.connect_sources(str(meta.content)) if meta is not None else []
        set_text(
            self.n["custom-hosts"],
            f"This site may download models only from {hosts.describe(self.model_sources)} "
            "(its Content-Security-Policy); links elsewhere are refused.",
        )

    def _bind(self) -> None:
        on = self.listeners.on
        on(self.n["composer"], "submit", self._on_submit)
        on(self.n["prompt"], "keydown", self._on_keydown)
        on(self.n["stop"], "click", lambda e: self.stop())
        on(self.n["new-chat"], "click", lambda e: self.new_chat())
        on(self.n["load"], "click", lambda e: asyncio.ensure_future(self.load_selected()))
        on(self.n["cancel-load"], "click", lambda e: self.client and self.client.cancel_load())
        on(self.n["model-select"], "change", lambda e: self._on_model_change())
        on(self.n["persist"], "click", lambda e: asyncio.ensure_future(self._persist()))

    def _fill_model_select(self) -> None:
        select = self.n["model-select"]
        clear(select)
        known = set()
        for entry in self.manifest.get("models", []):
            d = services.model_descriptor(entry, self.root_url)
            known.add(d["key"])
            label = entry.get("name") or d["url"]
            if entry.get("bundled"):
                label = "Bundled: " + label  # first: a narrow list cuts the end
            select.append(el("option", label, attrs={"value": d["key"]}))
        for entry in self.cached:
            if entry["key"] not in known:
                select.append(
                    el("option", f"Cached: {entry.get('name') or entry['key']}", attrs={"value": entry["key"]})
                )
        select.append(el("option", "Custom URL…", attrs={"value": services.CUSTOM}))
        self._on_model_change()

    def _on_model_change(self) -> None:
        value = str(self.n["model-select"].value)
        show(self.n["custom-url-row"], value == services.CUSTOM)
        entry = next(
            (m for m in self.manifest.get("models", []) if services.model_descriptor(m, self.root_url)["key"] == value),
            None,
        )
        set_text(self.n["model-desc"], (entry or {}).get("description") or "")

    def _pick_start_model(self) -> None:
        last = js.localStorage.getItem(LAST_MODEL_KEY)
        complete = {e["key"] for e in self.cached if e.get("complete")}
        bundled = {
            services.model_descriptor(m, self.root_url)["key"]
            for m in self.manifest.get("models", [])
            if m.get("bundled")
        }
        if last is not None and (str(last) in complete or str(last) in bundled):
            self.n["model-select"].value = str(last)
        elif self.manifest.get("models"):
            default = next(
                (m for m in self.manifest["models"] if m.get("id") == self.manifest.get("default")),
                self.manifest["models"][0],
            )
            self.n["model-select"].value = services.model_descriptor(default, self.root_url)["key"]
        self._on_model_change()

    def _selected_model(self) -> dict[str, Any]:
        value = str(self.n["model-select"].value)
        if value == services.CUSTOM:
            # a folder URL (Hugging Face checkpoint) or a GGUF file URL
            model = as_checkpoint(services.custom_descriptor(str(self.n["custom-url"].value)))
            if self.model_sources and not hosts.allowed(model["url"], self.model_sources, str(js.location.origin)):
                raise hosts.BlockedHostError(hosts.blocked_message(model["url"], self.model_sources))
            if model.get("format") == "hf" and by_id("lossy-ternarize").checked:
                model[LOSSY_FIELD] = True  # explicit opt-in, labelled EXPERIMENTAL, LOSSY in the page
            return model
        for entry in self.manifest.get("models", []):
            d = services.model_descriptor(entry, self.root_url)
            if d["key"] == value:
                return d
        for entry in self.cached:
            if entry["key"] == value:
                return {
                    "key": entry["key"],
                    "url": entry["url"],
                    "name": entry.get("name"),
                    "size": None,
                    "size_hint": entry.get("total"),
                    "sha256": None,
                    "bundled": False,
                }
        raise ValueError("choose a model first")

    # -- loading a model --------------------------------------------------------------------------

    async def load_selected(self) -> None:
        if self.loading or self.client is None:
            return
        try:
            model = self._selected_model()
        except ValueError as e:  # refused before fetching (not a URL, a host the policy blocks)
            kind = "blocked_host" if isinstance(e, hosts.BlockedHostError) else "download"
            self.load_count += 1
            self._state(loads=str(self.load_count), load=kind)
            if self.current is not None:
                self._keep_current({"kind": kind, "message": str(e)})
            else:
                self._state(model="error")
                self._notice(kind, str(e))
            return
        cached = next((e for e in self.cached if e["key"] == model["key"]), None)
        if not (cached and cached.get("complete")):
            needed = (model.get("size") or model.get("size_hint") or 0) - (cached or {}).get("stored", 0)
            shortfall = await services.storage_shortfall(needed)
            if shortfall:
                self._show_error({"kind": "quota", "message": shortfall})
                if self.current is None:  # a loaded model stays usable
                    self._state(model="error")
                return
            if not model.get("bundled"):
                asyncio.ensure_future(self._persist(quiet=True))
        self.loading = True
        self.load_count += 1
        self._hide_notice()
        self._state(model="loading", source="", loads=str(self.load_count), load="running")
        self._set_busy_controls()
        self.meter.reset()
        show(self.n["progress"])
        show(self.n["cancel-load"])
        self._status(f"Loading {model['name']}…")
        try:
            result = await self.client.load(model, self._on_load_event)
        finally:
            self.loading = False
            show(self.n["progress"], False)
            show(self.n["cancel-load"], False)
            self._set_busy_controls()
        usable = result["event"] == "loaded" or result.get("kind") == "engine_missing"
        kept = not usable and self.current is not None and result.get("kind") != "device_lost"
        self._state(load="ok" if result["event"] == "loaded" else str(result.get("kind") or "error"))
        if not kept:
            self._state(source=str(result.get("source") or ""), key=model["key"] if usable else "")
        if result["event"] == "loaded":
            self.info = result.get("info") or {}
            self.stats = None
            source = str(result.get("source") or "")
            self.current = {"key": model["key"], "name": model["name"], "info": self.info, "source": source}
            self._render_info()
            self._mode_hint()
            self._state(model="loaded")
            js.localStorage.setItem(LAST_MODEL_KEY, model["key"])
            if source == "cache":
                where = "Loaded from browser storage."
            elif result.get("offline_copy") and _controlled_by_service_worker():
                where = "Loaded from the app's offline copy (no network needed)."
            else:
                where = "Downloaded from the network and loaded."
            set_text(self.n["progress-text"], where)
            self.ready_text = f"{model['name']} is ready."
            self._status(self.ready_text)
            self.n["prompt"].focus()
        elif kept:
            self._keep_current(result)
        else:
            if result.get("info"):
                self.info = result["info"]
                self._render_info()
            self._state(model="header" if result.get("kind") == "engine_missing" else "error")
            self.current = None
            if result.get("kind") == "engine_missing":
                js.localStorage.setItem(LAST_MODEL_KEY, model["key"])
            set_text(self.n["progress-text"], "")
            self._show_error(result)
            self._status(describe(result.get("kind", "internal"), "").title)
        self._set_busy_controls()

    def _keep_current(self, result: dict[str, Any]) -> None:
        """A load failed or was cancelled: the worker swaps models only once the new one is ready,
        so the model in use is still loaded. Say so, and show that model again."""
        current = self.current
        self.info = current["info"]
        self._render_info()
        self._state(model="loaded", key=current["key"], source=current["source"])
        set_text(self.n["progress-text"], f"{current['name']} is still loaded and ready.")
        self._show_error(
            {**result, "message": f"{result.get('message', '')} ({current['name']} is still loaded and ready.)"}
        )
        f = describe(result.get("kind", "internal"), "")
        self._status(f"{f.title}. {current['name']} is still loaded.")
        self._set_busy_controls()

    def _on_load_event(self, msg: dict[str, Any]) -> None:
        ev = msg["event"]
        if ev == "progress":
            done, total = int(msg["done"]), msg.get("total")
            if msg["phase"] == "download":
                self.meter.add(time.monotonic(), done)
                rate, eta = self.meter.rate(), self.meter.eta(total)
            else:
                rate = eta = None
            set_text(self.n["progress-text"], progress_text(msg["phase"], done, total, rate, eta))
            frac = fraction(done, total)
            bar = self.n["progress"]
            if frac is None:
                bar.removeAttribute("value")
            else:
                bar.max = 1
                bar.value = frac
            bar.setAttribute("data-phase", msg["phase"])
        elif ev == "header":
            self.info = msg["info"]
            self._render_info()
        elif ev == "log":
            self._log(msg.get("message", ""))

    def _on_worker_event(self, msg: dict[str, Any]) -> None:
        if msg["event"] == "models":
            self._render_cache(msg)
        elif msg["event"] == "log":
            self._log(msg.get("message", ""))
        elif msg["event"] == "fatal":
            self._state(engine="failed")
            self._show_error({**msg, "kind": msg.get("kind", "worker_start")})
        elif msg["event"] == "error" and msg.get("kind") == "device_lost":
            self._device_lost(msg)  # the GPU went away while no request was running

    def _log(self, text: str) -> None:
        js.console.info(f"bitnet-web: {text}")
        set_text(self.n["progress-text"], text)

    def _mode_hint(self) -> None:
        """A model without a chat format continues text: say so where the person types."""
        completion = (self.info or {}).get("template_kind") == "completion"
        self.n["prompt"].placeholder = (
            "This model continues text (it is not chat-tuned): type the start, e.g. def fibonacci(n):"
            if completion
            else "Message (Enter sends, Shift+Enter adds a line)"
        )
        self._state(mode="completion" if completion else "chat")
        self.n["system-prompt"].disabled = completion  # a text-continuation model has no system role
        note = "Not used: this model has no chat format, it continues your text." if completion else ""
        self.n["system-prompt"].title = note
        set_text(self.n["system-note"], note)

    def _render_info(self) -> None:
        box = self.n["model-info"]
        clear(box)
        for label, value in info_rows(self.info or {}, self.stats):
            box.append(el("dt", label))
            box.append(el("dd", value))

    # -- chat -------------------------------------------------------------------------------------

    def _on_keydown(self, event: Any) -> None:
        if event.key == "Enter" and not event.shiftKey and not event.isComposing:
            event.preventDefault()
            asyncio.ensure_future(self.send())

    def _on_submit(self, event: Any) -> None:
        event.preventDefault()
        asyncio.ensure_future(self.send())

    def _settings(self) -> dict[str, Any] | None:
        inputs = {f.name: by_id("setting-" + f.name.replace("_", "-")) for f in FIELDS}
        for node in inputs.values():
            node.removeAttribute("aria-invalid")
        try:
            settings = parse_form({name: str(node.value) for name, node in inputs.items()})
        except SettingsError as e:
            set_text(self.n["settings-error"], str(e))
            by_id("settings-panel").open = True
            if e.field in inputs:
                inputs[e.field].setAttribute("aria-invalid", "true")
                inputs[e.field].focus()
            return None
        set_text(self.n["settings-error"], "")
        return settings

    async def send(self) -> None:
        text = str(self.n["prompt"].value)
        if not text.strip() or self.generating or self.loading or self.client is None:
            return
        settings = self._settings()
        if settings is None:
            return
        self.n["prompt"].value = ""
        system = str(self.n["system-prompt"].value).strip()
        kind, request = turn_request((self.info or {}).get("template_kind"), system, self.messages, text)
        self.messages.append({"role": "user", "content": text})
        if kind == "complete":  # the prompt and its continuation are one piece of text: one code block
            sent, reply = self._exchange(text)
        else:
            sent, reply = self._bubble("user", text).parentNode, self._bubble("assistant", "")
        reply.setAttribute("data-state", "streaming")
        reply.setAttribute("data-pieces", "0")
        pieces: list[str] = []
        chat_id = self.chat_id

        def on_piece(piece: str) -> None:
            if chat_id != self.chat_id:
                return  # New chat was pressed: the rest of this reply is discarded
            if not pieces:
                set_text(self.n["stats"], "Writing the reply…")
            pieces.append(piece)
            append_text(reply, piece)
            reply.setAttribute("data-pieces", str(len(pieces)))
            self._scroll()

        self.generating = True
        self._state(busy="1")
        self._set_busy_controls()
        set_text(self.n["stats"], "Reading the prompt…")
        on_event = lambda m: on_piece(m["text"]) if m["event"] == "piece" else None  # noqa: E731
        try:
            if kind == "complete":  # the worker keeps the most recent text that fits the context
                result = await self.client.request(
                    "complete", on_event, prompt=request, settings=settings, keep_recent=True, latest_chars=len(text)
                )
            else:
                result = await self.client.chat(request, settings, on_piece)
        finally:
            self.generating = False
            self._state(busy="0")
            self._set_busy_controls()
        if chat_id != self.chat_id:
            return  # New chat was pressed meanwhile: this reply, its bubble and its stats are gone
        self._status(self.ready_text)  # e.g. after "Stopping after the current token…"
        if result["event"] == "done":
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            reason = result.get("reason")
            reply.setAttribute("data-state", "aborted" if reason == "aborted" else "done")
            self.stats = {**(result.get("stats") or {}), "dropped_tokens": result.get("dropped_tokens") or 0}
            if reason == "aborted":
                reply.append(el("span", " [stopped]", cls="stopped"))
            else:
                note = cut_note(self.stats, settings, (self.info or {}).get("context_length"))
                if note:
                    reply.setAttribute("data-cut", str(self.stats.get("stop_reason")))
                    reply.append(el("span", f" [{note}]", cls="stopped cut"))
            set_text(self.n["stats"], stats_line(self.stats, reason))
            self._render_info()
        else:
            self.messages.pop()  # the turn failed: the next one starts from the last good state
            reply.setAttribute("data-state", "error")
            f = describe(result.get("kind", "internal"), result.get("message", ""))
            if not pieces and not str(self.n["prompt"].value):
                self.n["prompt"].value = text  # nothing came of it: the message is back in the box
            if f.kind == "too_long":  # refused, not sent: the message goes back, the error stays
                if kind == "complete":
                    sent.querySelector(".msg.user").remove()
                    set_text(sent.querySelector(".who"), "Not sent")
                else:
                    sent.remove()
            reply.classList.add("error")
            append_text(reply, f"{f.title}: {f.message}")
            reply.scrollIntoView(js.Object.fromEntries([["block", "nearest"]]))
            set_text(self.n["stats"], "")
            if result.get("fatal"):
                self._show_error(result)
            elif result.get("kind") == "device_lost":
                self._device_lost(result)
        self.n["prompt"].focus()

    def stop(self) -> None:
        if self.generating and self.client is not None:
            self.client.abort()
            self._status("Stopping after the current token…")

    def new_chat(self) -> None:
        if self.generating and self.client is not None:
            self.client.abort()
        self.chat_id += 1
        self.messages = []
        clear(self.n["messages"])
        set_text(self.n["stats"], "")
        if self.ready_text:
            self._status(self.ready_text)
        if self.client is not None:
            self.client.reset()
        self.stats = None
        self._render_info()
        self.n["prompt"].focus()

    def _bubble(self, role: str, text: str) -> Any:
        node = el("div", cls=f"msg {role}", attrs={"data-role": role})
        node.append(el("div", "You" if role == "user" else "BitNet", cls="who"))
        body = el("div", text, cls="text")
        node.append(body)
        self.n["messages"].append(node)
        self._scroll()
        return body

    def _exchange(self, text: str) -> tuple[Any, Any]:
        """Completion mode: the typed text and the model's continuation in one monospace block (the
        inner .msg.user / .msg.assistant spans keep the same hooks as chat bubbles)."""
        node = el("div", cls="msg exchange", attrs={"data-role": "exchange"})
        node.append(el("div", "Your text, continued by BitNet", cls="who"))
        code = el("pre", cls="code")
        user = el("span", cls="msg user", attrs={"data-role": "user"})
        user.append(el("span", text, cls="text"))
        assistant = el("span", cls="msg assistant", attrs={"data-role": "assistant"})
        body = el("span", cls="text")
        assistant.append(body)
        code.append(user)
        code.append(assistant)
        node.append(code)
        self.n["messages"].append(node)
        self._scroll()
        return node, body

    def _scroll(self) -> None:
        box = self.n["messages"]
        box.scrollTop = box.scrollHeight

    def _set_busy_controls(self) -> None:
        loaded = self.n["app"].getAttribute("data-model") in ("loaded", "header")
        self.n["send"].disabled = self.generating or self.loading or not loaded
        self.n["prompt"].disabled = self.loading or not loaded
        self.n["stop"].disabled = not self.generating
        self.n["load"].disabled = self.loading or self.generating or self.client is None

    # -- storage ----------------------------------------------------------------------------------

    async def _refresh_cache(self) -> None:
        if self.client is not None:
            self._render_cache(await self.client.list_models())

    def _render_cache(self, msg: dict[str, Any]) -> None:
        from ..shared.progress import format_bytes

        self.cached = msg.get("entries") or []
        box = self.n["cache-list"]
        self.cache_listeners.clear()
        clear(box)
        for entry in sorted(self.cached, key=lambda e: e.get("name") or ""):
            total, stored = entry.get("total"), entry.get("stored") or 0
            state = "complete" if entry.get("complete") else f"partial, {format_bytes(stored)} of {format_bytes(total)}"
            button = el("button", "Delete", attrs={"type": "button", "data-key": entry["key"]})
            item = el(
                "li",
                attrs={"data-key": entry["key"], "data-complete": "1" if entry.get("complete") else "0"},
                children=[
                    el("span", entry.get("name") or entry["key"], cls="name"),
                    el("span", f"{format_bytes(total if entry.get('complete') else stored)}, {state}", cls="muted"),
                    button,
                ],
            )
            key = entry["key"]
            self.cache_listeners.on(button, "click", lambda e, key=key: asyncio.ensure_future(self._delete(key)))
            box.append(item)
        if not self.cached:
            box.append(el("li", "No models stored yet.", cls="muted"))
        est = msg.get("estimate") or {}
        summary = (
            f"Using {format_bytes(est.get('usage'))} of {format_bytes(est.get('quota'))} available to this site."
            if est
            else ""
        )
        set_text(self.n["storage-summary"], summary)
        selected = str(self.n["model-select"].value) if self.n["model-select"].value else None
        self._fill_model_select()
        if selected is not None and any(str(o.value) == selected for o in self.n["model-select"].options):
            self.n["model-select"].value = selected
            self._on_model_change()

    async def _delete(self, key: str) -> None:
        if self.client is not None:
            self._render_cache(await self.client.delete_model(key))

    async def _persist(self, quiet: bool = False) -> None:
        granted = await services.request_persistence()
        text = {
            True: "Stored models are kept (persistent storage granted).",
            False: "The browser may evict stored models when space runs low (persistent storage was not granted).",
            None: "This browser cannot make storage persistent.",
        }[granted]
        self.n["persist"].setAttribute("data-persisted", {True: "1", False: "0", None: ""}[granted])
        if not quiet or granted:
            set_text(self.n["storage-summary"], text)

    # -- messages ---------------------------------------------------------------------------------

    def _show_error(self, msg: dict[str, Any]) -> None:
        f = describe(msg.get("kind", "internal"), msg.get("message", ""))
        if f.fatal:
            render_failure(self.n["failure"], f.title, f.message, f.advice, msg.get("detail", ""))
            show(self.n["app"], False)
        else:
            self.notice_listeners.clear()  # a button of the previous notice goes with it
            render_failure(self.n["notice"], f.title, f.message, f.advice, msg.get("detail", ""))
            self.n["notice"].setAttribute("data-kind", f.kind)

    def _notice(self, kind: str, message: str) -> None:
        self._show_error({"kind": kind, "message": message})

    def _hide_notice(self) -> None:
        self.notice_listeners.clear()
        show(self.n["notice"], False)
        self.n["notice"].removeAttribute("data-kind")

    def _device_lost(self, msg: dict[str, Any]) -> None:
        """The GPU device was lost and the worker dropped the model: say so and offer to load the
        same model again (from browser storage, on a fresh device) without a page refresh. The
        conversation is kept."""
        key = str(self.n["app"].getAttribute("data-key") or "")
        self._state(model="lost")
        self._set_busy_controls()
        self.notice_listeners.clear()
        button = el("button", "Load the model again", cls="primary", attrs={"id": "reload-model", "type": "button"})
        self.notice_listeners.on(button, "click", lambda e: asyncio.ensure_future(self._reload_model(key)))
        f = describe("device_lost", msg.get("message", ""))
        render_failure(self.n["notice"], f.title, f.message, f.advice, msg.get("detail", ""), actions=[button])
        self.n["notice"].setAttribute("data-kind", f.kind)
        self._status(f.title)

    async def _reload_model(self, key: str) -> None:
        select = self.n["model-select"]
        if any(str(o.value) == key for o in select.options):
            select.value = key
        elif key:
            select.value = services.CUSTOM
            self.n["custom-url"].value = key
        self._on_model_change()
        await self.load_selected()


def _controlled_by_service_worker() -> bool:
    """The page (and so its worker's fetches) goes through the offline copy's service worker; on a
    first visit it does not yet, though the copy may already hold the file."""
    container = getattr(js.navigator, "serviceWorker", None)
    return container is not None and container.controller is not None


_app: ChatApp | None = None


def start(root: str = "./") -> None:
    """Entry point from static/index.html's <script type="py">."""
    global _app
    _app = ChatApp(site_root(root))
    task = asyncio.ensure_future(_app.start())
    task.add_done_callback(_report_crash)


def _report_crash(task: asyncio.Task) -> None:
    if task.cancelled() or task.exception() is None:
        return
    import traceback

    exc = task.exception()
    text = "".join(traceback.format_exception(exc))
    js.console.error(text)
    try:
        f = describe("internal", f"{type(exc).__name__}: {exc}")
        render_failure(by_id("failure"), f.title, f.message, f.advice, text[-3000:])
    except Exception:
        pass
