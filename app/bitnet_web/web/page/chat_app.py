"""The chat page (static/index.html), main thread: starts it and wires its parts together.

The parts, each in its own module, dependencies one way (none imports chat_app):

    chat_shell      element handles, #app's data-* hooks, status line, notice, enabled controls
    settings_panel  the Settings form (from shared.settings.FIELDS) and the system prompt
    storage_panel   the models in browser storage, Delete, persistent storage
    model_panel     the model list, loading with progress and Cancel, the model-info box
    conversation    the messages, sending a turn and streaming its reply, Stop, New chat

The page never holds model bytes; nothing from a model or a file is interpreted as HTML.

URL parameters: `?autoload=0` skips loading the last used (or default) model at start; `?warmup=0`
sends no GPU warm-up while the person types, `?warmup=1` sends them on a CPU adapter too (tests).

Test hooks: `#app` carries data-engine ("starting" | "ready" | "missing" | "failed"), data-model
("none" | "loading" | "loaded" | "header" | "error" | "lost": the GPU device was lost), data-source
("network" | "cache" | "" for the last load), data-key (the usable model's URL), data-loads (loads
started so far), data-load (the last load's outcome: "running" | "ok" | its error kind; a failed load
leaves data-model "loaded" when the model loaded before it stays usable), data-busy ("1" while
generating), data-phase (the reply's phase, a key of chat_shell.REPLY_STATUS, "" when none),
data-warm-ups (GPU warm-ups run while typing) and data-warm-up ("ran", or why the last one did not);
each reply bubble carries data-pieces (streamed pieces received), data-state ("streaming" | "done" |
"aborted" | "error") and data-cut ("max_tokens" | "context_full": a visible note says the reply was
cut). In completion mode a prompt and its reply share one code block, as
inner .msg.user and .msg.assistant spans.
"""

from __future__ import annotations

import asyncio
from typing import Any

import js

from ..shared.failures import describe
from . import services
from .chat_shell import Shell
from .client import EngineClient, shared_client, site_root
from .conversation import Conversation
from .dom import by_id, render_failure, set_text, show
from .model_panel import ModelPanel
from .settings_panel import SettingsPanel
from .storage_panel import StoragePanel


class ChatApp:
    def __init__(self, root_url: str) -> None:
        self.shell = Shell(root_url)
        self.settings = SettingsPanel(self.shell)
        self.storage = StoragePanel(self.shell)
        self.models = ModelPanel(self.shell, self.storage)
        self.conversation = Conversation(self.shell, self.models, self.settings)
        self.storage.on_change = self.models.refill_select
        self.models.on_ready = self._on_model_ready

    @property
    def client(self) -> EngineClient | None:
        return self.shell.client

    async def start(self) -> None:
        shell, n = self.shell, self.shell.n
        shell.state(engine="starting", model="none", busy="0")
        shell.status("Checking WebGPU…")
        kind, gpu_text = await services.probe_webgpu()
        asyncio.ensure_future(self._offline())
        if kind is not None:
            shell.state(engine="failed")
            f = describe(kind, gpu_text)
            render_failure(n["failure"], f.title, f.message, f.advice)
            show(n["app"], False)
            shell.status(f.title)
            return
        self.settings.build()
        self.models.show_allowed_hosts()
        self.conversation.bind()
        self.models.bind()
        self.storage.bind()
        try:
            self.models.manifest = await services.fetch_json(shell.root_url + "models/models.json")
        except Exception as e:
            shell.notice("download", f"The model list could not be read: {e}")
        self.models.fill_select()
        shell.status("Starting the engine worker (Python + numpy)…")
        shell.client = shared_client(shell.root_url)
        shell.client.listeners.append(self._on_worker_event)
        ready = await shell.client.init()
        if ready["event"] == "error":
            shell.state(engine="failed")
            shell.show_error(ready)
            return
        shell.state(engine="ready" if ready.get("engine_available") else "missing")
        gpu = ready.get("gpu") or {}
        shell.status(
            f"Ready. {gpu_text}" if gpu.get("available") else f"Ready, but the worker sees no GPU: {gpu.get('error')}"
        )
        if ready.get("engine_error"):
            shell.notice("engine_missing", ready["engine_error"])
        if ready.get("store_error"):
            shell.notice("quota", f"Browser storage is unavailable: {ready['store_error']}")
        await self.storage.refresh()
        n["load"].disabled = False
        self.models.pick_start_model()
        if str(js.URLSearchParams.new(js.location.search).get("autoload")) != "0":
            await self.models.load_selected()
        else:
            shell.status("Ready: choose a model and press Load.")

    async def _offline(self) -> None:
        node = self.shell.n["offline-status"]
        text = await services.register_service_worker(self.shell.root_url)
        set_text(node, text)
        node.setAttribute("data-ready", "1" if text == "Available offline" else "0")

    def _on_model_ready(self, info: dict[str, Any]) -> None:
        self.conversation.set_mode(info)
        self.settings.set_completion_mode(info.get("template_kind") == "completion")

    def _on_worker_event(self, msg: dict[str, Any]) -> None:
        if msg["event"] == "models":
            self.storage.render(msg)
        elif msg["event"] == "log":
            self.models.log(msg.get("message", ""))
        elif msg["event"] == "fatal":
            self.shell.state(engine="failed")
            self.shell.show_error({**msg, "kind": msg.get("kind", "worker_start")})
        elif msg["event"] == "error" and msg.get("kind") == "device_lost":
            self.models.device_lost(msg)  # the GPU went away while no request was running


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
