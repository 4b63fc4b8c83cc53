"""The chat page's Model panel: the model list (bundled, stored, Custom URL), loading the chosen model
with progress and Cancel, the model-info box, and loading it again after the GPU device was lost.

A failed or cancelled load keeps the model in use: the worker swaps models only once the new one is
ready, and this panel then shows that model again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import js

from ..shared import hosts
from ..shared.checkpoints import LOSSY_FIELD, as_checkpoint
from ..shared.failures import describe
from ..shared.modelinfo import info_rows
from ..shared.progress import RateMeter, fraction, loaded_from, progress_text
from . import services
from .chat_shell import Shell
from .dom import Listeners, by_id, clear, el, render_failure, set_text, show
from .storage_panel import StoragePanel

LAST_MODEL_KEY = "bitnet-web:last-model"


class ModelPanel:
    def __init__(self, shell: Shell, storage: StoragePanel) -> None:
        self.shell = shell
        self.storage = storage
        self.listeners = Listeners()
        self.manifest: dict[str, Any] = {"models": []}
        self.info: dict[str, Any] | None = None  # the model's info as the box shows it
        self.stats: dict[str, Any] | None = None  # the last reply's stats, shown in the box too
        self.current: dict[str, Any] | None = None  # the usable model: key, name, info, source
        self.load_count = 0
        self.model_sources: list[str] = []  # the page's connect-src: where a Custom URL may point
        self.meter = RateMeter()
        self.on_ready: Callable[[dict[str, Any]], None] = lambda info: None  # a model was loaded

    def bind(self) -> None:
        n, on = self.shell.n, self.listeners.on
        on(n["load"], "click", lambda e: asyncio.ensure_future(self.load_selected()))
        on(n["cancel-load"], "click", lambda e: self.shell.client and self.shell.client.cancel_load())
        on(n["model-select"], "change", lambda e: self.on_select_change())

    def show_allowed_hosts(self) -> None:
        meta = js.document.querySelector('meta[http-equiv="Content-Security-Policy"]')
        self.model_sources = hosts.connect_sources(str(meta.content)) if meta is not None else []
        set_text(
            self.shell.n["custom-hosts"],
            f"This site may download models only from {hosts.describe(self.model_sources)} "
            "(its Content-Security-Policy); links elsewhere are refused.",
        )

    # -- the model list ---------------------------------------------------------------------------

    def _descriptors(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(manifest entry, its model descriptor) for every model the site lists."""
        root = self.shell.root_url
        return [(entry, services.model_descriptor(entry, root)) for entry in self.manifest.get("models", [])]

    def fill_select(self) -> None:
        select = self.shell.n["model-select"]
        clear(select)
        known = set()
        for entry, d in self._descriptors():
            known.add(d["key"])
            label = entry.get("name") or d["url"]
            if entry.get("bundled"):
                label = "Bundled: " + label  # first: a narrow list cuts the end
            select.append(el("option", label, attrs={"value": d["key"]}))
        for entry in self.storage.cached:
            if entry["key"] not in known:
                select.append(
                    el("option", f"Cached: {entry.get('name') or entry['key']}", attrs={"value": entry["key"]})
                )
        select.append(el("option", "Custom URL…", attrs={"value": services.CUSTOM}))
        self.on_select_change()

    def refill_select(self) -> None:
        """The stored models changed: list them, keeping the choice."""
        select = self.shell.n["model-select"]
        selected = str(select.value) if select.value else None
        self.fill_select()
        if selected is not None and any(str(o.value) == selected for o in select.options):
            select.value = selected
            self.on_select_change()

    def on_select_change(self) -> None:
        n = self.shell.n
        value = str(n["model-select"].value)
        show(n["custom-url-row"], value == services.CUSTOM)
        entry = next((e for e, d in self._descriptors() if d["key"] == value), None)
        set_text(n["model-desc"], (entry or {}).get("description") or "")

    def pick_start_model(self) -> None:
        last = js.localStorage.getItem(LAST_MODEL_KEY)
        complete = {e["key"] for e in self.storage.cached if e.get("complete")}
        bundled = {d["key"] for e, d in self._descriptors() if e.get("bundled")}
        select = self.shell.n["model-select"]
        if last is not None and (str(last) in complete or str(last) in bundled):
            select.value = str(last)
        elif self.manifest.get("models"):
            default = next(
                (m for m in self.manifest["models"] if m.get("id") == self.manifest.get("default")),
                self.manifest["models"][0],
            )
            select.value = services.model_descriptor(default, self.shell.root_url)["key"]
        self.on_select_change()

    def selected_model(self) -> dict[str, Any]:
        n = self.shell.n
        value = str(n["model-select"].value)
        if value == services.CUSTOM:
            # a folder URL (Hugging Face checkpoint) or a GGUF file URL
            model = as_checkpoint(services.custom_descriptor(str(n["custom-url"].value)))
            if self.model_sources and not hosts.allowed(model["url"], self.model_sources, str(js.location.origin)):
                raise hosts.BlockedHostError(hosts.blocked_message(model["url"], self.model_sources))
            if model.get("format") == "hf" and by_id("lossy-ternarize").checked:
                model[LOSSY_FIELD] = True  # explicit opt-in, labelled EXPERIMENTAL, LOSSY in the page
            return model
        for _, d in self._descriptors():
            if d["key"] == value:
                return d
        entry = self.storage.entry(value)
        if entry is not None:
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

    # -- loading ----------------------------------------------------------------------------------

    async def load_selected(self) -> None:
        shell, n = self.shell, self.shell.n
        if shell.loading or shell.client is None:
            return
        try:
            model = self.selected_model()
        except ValueError as e:  # refused before fetching (not a URL, a host the policy blocks)
            kind = "blocked_host" if isinstance(e, hosts.BlockedHostError) else "download"
            self.load_count += 1
            shell.state(loads=str(self.load_count), load=kind)
            if self.current is not None:
                self._keep_current({"kind": kind, "message": str(e)})
            else:
                shell.state(model="error")
                shell.notice(kind, str(e))
            return
        cached = self.storage.entry(model["key"])
        if not (cached and cached.get("complete")):
            needed = (model.get("size") or model.get("size_hint") or 0) - (cached or {}).get("stored", 0)
            shortfall = await services.storage_shortfall(needed)
            if shortfall:  # refused before downloading: a loaded model stays usable, and is named
                if self.current is not None:
                    self._keep_current({"kind": "quota", "message": shortfall})
                else:
                    shell.show_error({"kind": "quota", "message": shortfall})
                    shell.state(model="error")
                return
            if not model.get("bundled"):
                asyncio.ensure_future(self.storage.persist(quiet=True))
        shell.loading = True
        self.load_count += 1
        shell.hide_notice()
        shell.state(model="loading", source="", loads=str(self.load_count), load="running")
        shell.set_busy_controls()
        self.meter.reset()
        n["progress"].value = 0  # not the last load's full bar and phase
        n["progress"].removeAttribute("data-phase")
        set_text(n["progress-text"], "Starting…")
        show(n["progress"])
        show(n["cancel-load"])
        shell.status(f"Loading {model['name']}…")
        try:
            result = await shell.client.load(model, self._on_load_event)
        finally:
            shell.loading = False
            show(n["progress"], False)
            show(n["cancel-load"], False)
            shell.set_busy_controls()
        usable = result["event"] == "loaded" or result.get("kind") == "engine_missing"
        kept = not usable and self.current is not None and result.get("kind") != "device_lost"
        shell.state(load="ok" if result["event"] == "loaded" else str(result.get("kind") or "error"))
        if not kept:
            shell.state(source=str(result.get("source") or ""), key=model["key"] if usable else "")
        if result["event"] == "loaded":
            self.info = result.get("info") or {}
            self.stats = None
            source = str(result.get("source") or "")
            self.current = {"key": model["key"], "name": model["name"], "info": self.info, "source": source}
            self.render_info()
            self.on_ready(self.info)
            shell.state(model="loaded")
            js.localStorage.setItem(LAST_MODEL_KEY, model["key"])
            offline_copy = bool(result.get("offline_copy")) and _controlled_by_service_worker()
            set_text(n["progress-text"], loaded_from(source, offline_copy))
            shell.ready_text = f"{model['name']} is ready."
            shell.status(shell.ready_text)
            n["prompt"].focus()
        elif kept:
            self._keep_current(result)
        else:
            if result.get("info"):
                self.info = result["info"]
                self.render_info()
            shell.state(model="header" if result.get("kind") == "engine_missing" else "error")
            self.current = None
            shell.ready_text = ""  # no model can reply: New chat must not say one is ready
            if result.get("kind") == "engine_missing":
                js.localStorage.setItem(LAST_MODEL_KEY, model["key"])
            set_text(n["progress-text"], "")
            shell.show_error(result)
            shell.status(describe(result.get("kind", "internal"), "").title)
        shell.set_busy_controls()

    def _keep_current(self, result: dict[str, Any]) -> None:
        """A load failed or was cancelled: the model in use is still loaded. Say so, and show that
        model again."""
        shell, current = self.shell, self.current
        self.info = current["info"]
        self.render_info()
        shell.state(model="loaded", key=current["key"], source=current["source"])
        set_text(shell.n["progress-text"], f"{current['name']} is still loaded and ready.")
        message = str(result.get("message") or "").rstrip()
        if message and not message.endswith((".", "!", "?")):
            message += "."  # the note below is a sentence of its own
        shell.show_error({**result, "message": f"{message} ({current['name']} is still loaded and ready.)"})
        f = describe(result.get("kind", "internal"), "")
        shell.status(f"{f.title}. {current['name']} is still loaded.")
        shell.set_busy_controls()

    def _on_load_event(self, msg: dict[str, Any]) -> None:
        ev = msg["event"]
        if ev == "progress":
            done, total = int(msg["done"]), msg.get("total")
            if msg["phase"] == "download":
                self.meter.add(time.monotonic(), done)
                rate, eta = self.meter.rate(), self.meter.eta(total)
            else:
                rate = eta = None
            set_text(self.shell.n["progress-text"], progress_text(msg["phase"], done, total, rate, eta))
            frac = fraction(done, total)
            bar = self.shell.n["progress"]
            if frac is None:
                bar.removeAttribute("value")
            else:
                bar.max = 1
                bar.value = frac
            bar.setAttribute("data-phase", msg["phase"])
        elif ev == "header":
            self.info = msg["info"]
            self.render_info()
        elif ev == "log":
            self.log(msg.get("message", ""))

    def log(self, text: str) -> None:
        js.console.info(f"bitnet-web: {text}")
        set_text(self.shell.n["progress-text"], text)

    # -- the model-info box -----------------------------------------------------------------------

    def render_info(self) -> None:
        box = self.shell.n["model-info"]
        clear(box)
        for label, value in info_rows(self.info or {}, self.stats):
            box.append(el("dt", label))
            box.append(el("dd", value))

    def show_stats(self, stats: dict[str, Any] | None) -> None:
        """The last reply's numbers (context used, speed) in the box; None after New chat."""
        self.stats = stats
        self.render_info()

    # -- a lost GPU device ------------------------------------------------------------------------

    def device_lost(self, msg: dict[str, Any]) -> None:
        """The GPU device was lost and the worker dropped the model: say so and offer to load the
        same model again (from browser storage, on a fresh device) without a page refresh. The
        conversation is kept."""
        shell = self.shell
        key = str(shell.n["app"].getAttribute("data-key") or "")
        shell.state(model="lost")
        shell.ready_text = ""
        shell.set_busy_controls()
        shell.notice_listeners.clear()
        button = el("button", "Load the model again", cls="primary", attrs={"id": "reload-model", "type": "button"})
        shell.notice_listeners.on(button, "click", lambda e: asyncio.ensure_future(self._reload_model(key)))
        f = describe("device_lost", msg.get("message", ""))
        render_failure(shell.n["notice"], f.title, f.message, f.advice, msg.get("detail", ""), actions=[button])
        shell.n["notice"].setAttribute("data-kind", f.kind)
        shell.status(f.title)

    async def _reload_model(self, key: str) -> None:
        select = self.shell.n["model-select"]
        if any(str(o.value) == key for o in select.options):
            select.value = key
        elif key:
            select.value = services.CUSTOM
            self.shell.n["custom-url"].value = key
        self.on_select_change()
        await self.load_selected()


def _controlled_by_service_worker() -> bool:
    """The page (and so its worker's fetches) goes through the offline copy's service worker; on a
    first visit it does not yet, though the copy may already hold the file."""
    container = getattr(js.navigator, "serviceWorker", None)
    return container is not None and container.controller is not None
