"""The chat page's conversation: the message list, sending a turn (chat messages, or in completion mode
the running text) and streaming its reply, Stop, New chat, and the stats line under the messages.

`messages` holds the conversation without the system prompt. Streamed text is appended as Text
nodes; nothing from a model is interpreted as HTML."""

from __future__ import annotations

import asyncio
from typing import Any

import js

from ..shared.failures import describe
from ..shared.progress import cut_note, progress_text, stats_line
from ..shared.prompts import turn_request
from .chat_shell import Shell
from .client import warm_up_outcome
from .dom import Listeners, append_text, clear, el, set_text
from .model_panel import ModelPanel
from .settings_panel import SettingsPanel


class Conversation:
    def __init__(self, shell: Shell, models: ModelPanel, settings: SettingsPanel) -> None:
        self.shell = shell
        self.models = models
        self.settings = settings
        self.listeners = Listeners()
        self.messages: list[dict[str, str]] = []
        self.chat_id = 0  # New chat increments it: a reply that ends later belongs to a discarded chat
        self.pieces: list[str] = []  # of the reply streaming now (none yet: the prompt is being read)
        self.warm_ups = 0  # warm-ups the worker ran (test hook data-warm-ups)

    def bind(self) -> None:
        n, on = self.shell.n, self.listeners.on
        on(n["composer"], "submit", self._on_submit)
        on(n["prompt"], "keydown", self._on_keydown)
        on(n["prompt"], "input", self._on_typing)
        on(n["stop"], "click", lambda e: self.stop())
        on(n["new-chat"], "click", lambda e: self.new_chat())

    def set_mode(self, info: dict[str, Any]) -> None:
        """A model without a chat format continues text: say so where the person types."""
        completion = info.get("template_kind") == "completion"
        self.shell.n["prompt"].placeholder = (
            "Not a chat model: type the start to continue, e.g. def fibonacci(n):"
            if completion
            else "Message (Enter sends, Shift+Enter adds a line)"
        )
        self.shell.state(mode="completion" if completion else "chat")

    def _on_keydown(self, event: Any) -> None:
        if event.key == "Enter" and not event.shiftKey and not event.isComposing:
            event.preventDefault()
            asyncio.ensure_future(self.send())

    def _on_typing(self, event: Any) -> None:
        """Typing announces a reply: the GPU's clocks are raised meanwhile, so the reply starts at full
        speed rather than at an idle GPU's (EngineClient.typing, model/warm_up.py), unless Settings
        turns it off."""
        shell = self.shell
        if shell.generating or shell.loading or shell.client is None:
            return
        if not self.settings.switched_on("warm_up"):
            return
        if shell.n["app"].getAttribute("data-model") != "loaded":
            return
        shell.client.typing(self._warmed)

    def _warmed(self, msg: dict[str, Any]) -> None:
        """The worker's answer to a warm-up: counted (data-warm-ups) or, when it did not run, why
        (data-warm-up). A GPU lost meanwhile is the model panel's to say."""
        if msg["event"] != "warmed":
            if msg.get("kind") == "device_lost":
                self.models.device_lost(msg)
            return
        outcome = warm_up_outcome(msg)
        if outcome == "ran":
            self.warm_ups += 1
            self.shell.state(**{"warm-ups": str(self.warm_ups)})
        self.shell.state(**{"warm-up": outcome})

    def _on_submit(self, event: Any) -> None:
        event.preventDefault()
        asyncio.ensure_future(self.send())

    # -- one turn ---------------------------------------------------------------------------------

    async def send(self) -> None:
        shell, n = self.shell, self.shell.n
        client = shell.client
        text = str(n["prompt"].value)
        if not text.strip() or shell.generating or shell.loading or client is None:
            return
        settings = self.settings.read()
        if settings is None:
            return
        n["prompt"].value = ""
        info = self.models.info or {}
        kind, request = turn_request(info.get("template_kind"), self.settings.system_prompt(), self.messages, text)
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
                set_text(n["stats"], "")  # the prompt's progress; the status line says the reply is written
                if shell.phase in ("reading", "stopping_prompt"):
                    shell.reply_phase("writing" if shell.phase == "reading" else "stopping")
            pieces.append(piece)
            append_text(reply, piece)
            reply.setAttribute("data-pieces", str(len(pieces)))
            self._scroll()

        def on_event(msg: dict[str, Any]) -> None:
            if msg["event"] == "piece":
                on_piece(msg["text"])
            elif msg["event"] == "progress" and not pieces and chat_id == self.chat_id:  # a long prompt
                set_text(n["stats"], progress_text(msg["phase"], int(msg["done"]), msg.get("total"), None, None))

        shell.generating = True
        shell.state(busy="1")
        shell.set_busy_controls()
        shell.reply_phase("reading")
        set_text(n["stats"], "")  # the last reply's numbers
        self.pieces = pieces
        try:
            if kind == "complete":  # the worker keeps the most recent text that fits the context
                result = await client.request(
                    "complete", on_event, prompt=request, settings=settings, keep_recent=True, latest_chars=len(text)
                )
            else:
                result = await client.request("chat", on_event, messages=request, settings=settings)
        finally:
            shell.generating = False
            shell.state(busy="0")
            shell.set_busy_controls()
            shell.reply_phase("")  # whatever ended it (done, Stop, a failure, New chat): ready again
        if chat_id != self.chat_id:
            return  # New chat was pressed meanwhile: this reply, its bubble and its stats are gone
        if result["event"] == "done":
            self.messages.append({"role": "assistant", "content": "".join(pieces)})
            self._finish(reply, result, settings)
        else:
            self.messages.pop()  # the turn failed: the next one starts from the last good state
            self._fail(sent, reply, result, text, kind, bool(pieces))
        n["prompt"].focus()

    def _finish(self, reply: Any, result: dict[str, Any], settings: dict[str, Any]) -> None:
        reason = result.get("reason")
        reply.setAttribute("data-state", "aborted" if reason == "aborted" else "done")
        stats = {**(result.get("stats") or {}), "dropped_tokens": result.get("dropped_tokens") or 0}
        if reason == "aborted":
            reply.append(el("span", " [stopped]", cls="stopped"))
        else:
            note = cut_note(stats, settings, (self.models.info or {}).get("context_length"))
            if note:
                reply.setAttribute("data-cut", str(stats.get("stop_reason")))
                reply.append(el("span", f" [{note}]", cls="stopped cut"))
        set_text(self.shell.n["stats"], stats_line(stats, reason))
        self.models.show_stats(stats)

    def _fail(self, sent: Any, reply: Any, result: dict[str, Any], text: str, kind: str, any_piece: bool) -> None:
        n = self.shell.n
        reply.setAttribute("data-state", "error")
        f = describe(result.get("kind", "internal"), result.get("message", ""))
        if not any_piece and not str(n["prompt"].value):
            n["prompt"].value = text  # nothing came of it: the message is back in the box
        if f.kind == "too_long":  # refused, not sent: the message goes back, the error stays
            if kind == "complete":
                sent.querySelector(".msg.user").remove()
                set_text(sent.querySelector(".who"), "Not sent")
            else:
                sent.remove()
        reply.classList.add("error")
        append_text(reply, f"{f.title}: {f.message}")
        reply.scrollIntoView(js.Object.fromEntries([["block", "nearest"]]))
        set_text(n["stats"], "")
        if result.get("fatal"):
            self.shell.show_error(result)
        elif result.get("kind") == "device_lost":
            self.models.device_lost(result)

    def stop(self) -> None:
        if self.shell.generating and self.shell.client is not None:
            self.shell.client.abort()
            self.shell.reply_phase("stopping" if self.pieces else "stopping_prompt")

    def new_chat(self) -> None:
        shell = self.shell
        if shell.generating and shell.client is not None:
            shell.client.abort()
            shell.reply_phase("discarding")  # until the worker has stopped; Send waits for it too
        elif shell.ready_text:
            shell.status(shell.ready_text)  # not a load failure's note about the previous chat
        self.chat_id += 1
        self.messages = []
        clear(shell.n["messages"])
        set_text(shell.n["stats"], "")
        if shell.client is not None:
            shell.client.reset()
        self.models.show_stats(None)
        shell.n["prompt"].focus()

    # -- the message list -------------------------------------------------------------------------

    def _bubble(self, role: str, text: str) -> Any:
        node = el("div", cls=f"msg {role}", attrs={"data-role": role})
        node.append(el("div", "You" if role == "user" else "BitNet", cls="who"))
        body = el("div", text, cls="text")
        node.append(body)
        self.shell.n["messages"].append(node)
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
        self.shell.n["messages"].append(node)
        self._scroll()
        return node, body

    def _scroll(self) -> None:
        box = self.shell.n["messages"]
        box.scrollTop = box.scrollHeight
