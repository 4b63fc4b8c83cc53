"""The chat page's frame that every panel shares: element handles, the data-* hooks on #app, the
status line, the notice box and which controls are enabled while a model loads or a reply streams.

The status line says what the page is doing now. While a reply is under way that is its phase
(REPLY_STATUS, set by the conversation through `reply_phase`); when no reply is under way it is
`ready_text` (the loaded model is ready), so the end of a reply, Stop, a failure or New chat can
never leave a phase behind. Start-up, loading and failures set their own text with `status`."""

from __future__ import annotations

from typing import Any

from ..shared.failures import describe
from .client import EngineClient
from .dom import Listeners, by_id, render_failure, set_text, show

# the status line while a reply is under way, by phase (#app's data-phase says the phase)
REPLY_STATUS = {
    "reading": "Reading the prompt…",
    "writing": "Writing the reply…",
    "stopping": "Stopping after the current token…",
    "stopping_prompt": "Stopping after this part of the prompt…",  # the GPU finishes the part it is on
    "discarding": "Stopping the reply of the cleared chat…",  # New chat while a reply was under way
}

NODE_IDS = (
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


class Shell:
    """What the panels of the chat page share; it knows none of them."""

    def __init__(self, root_url: str) -> None:
        self.root_url = root_url
        self.client: EngineClient | None = None
        self.loading = False
        self.generating = False
        self.ready_text = ""  # the status line while a model is ready and no reply is under way
        self.phase = ""  # of the reply under way (a REPLY_STATUS key), "" when none is
        self.notice_listeners = Listeners()  # a button inside the notice (e.g. load the model again)
        self.n = {name: by_id(name) for name in NODE_IDS}

    def state(self, **attrs: str) -> None:
        """Set the test hooks on #app (data-engine, data-model, ...: see chat_app)."""
        for k, v in attrs.items():
            self.n["app"].setAttribute("data-" + k, v)

    def status(self, text: str) -> None:
        set_text(self.n["status"], text)

    def reply_phase(self, phase: str) -> None:
        """The reply's phase (a REPLY_STATUS key), or "" once no reply is under way: the status line
        then says the model is ready again."""
        self.phase = phase
        self.state(phase=phase)
        self.status(REPLY_STATUS[phase] if phase else self.ready_text)

    def set_busy_controls(self) -> None:
        loaded = self.n["app"].getAttribute("data-model") in ("loaded", "header")
        self.n["send"].disabled = self.generating or self.loading or not loaded
        self.n["prompt"].disabled = self.loading or not loaded
        self.n["stop"].disabled = not self.generating
        self.n["load"].disabled = self.loading or self.generating or self.client is None

    # -- the notice (or, for a fatal failure, the failure block that replaces the app) -------------

    def show_error(self, msg: dict[str, Any]) -> None:
        f = describe(msg.get("kind", "internal"), msg.get("message", ""))
        if f.fatal:
            render_failure(self.n["failure"], f.title, f.message, f.advice, msg.get("detail", ""))
            show(self.n["app"], False)
        else:
            self.notice_listeners.clear()  # a button of the previous notice goes with it
            render_failure(self.n["notice"], f.title, f.message, f.advice, msg.get("detail", ""))
            self.n["notice"].setAttribute("data-kind", f.kind)

    def notice(self, kind: str, message: str) -> None:
        self.show_error({"kind": kind, "message": message})

    def hide_notice(self) -> None:
        self.notice_listeners.clear()
        show(self.n["notice"], False)
        self.n["notice"].removeAttribute("data-kind")
