"""The chat page's Storage panel: the models kept in browser storage (complete or partial), their
Delete buttons, the space used, and the request to make that storage persistent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..shared.progress import format_bytes
from . import services
from .chat_shell import Shell
from .dom import Listeners, clear, el, set_text


class StoragePanel:
    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.cached: list[dict[str, Any]] = []  # the worker's list of stored models
        self.listeners = Listeners()
        self.cache_listeners = Listeners()  # the delete buttons, rebuilt with the list
        self.on_change: Callable[[], None] = lambda: None  # the list changed (the model list shows it too)

    def bind(self) -> None:
        self.listeners.on(self.shell.n["persist"], "click", lambda e: asyncio.ensure_future(self.persist()))

    async def refresh(self) -> None:
        if self.shell.client is not None:
            self.render(await self.shell.client.list_models())

    def render(self, msg: dict[str, Any]) -> None:
        """Show the worker's `models` event."""
        n = self.shell.n
        self.cached = msg.get("entries") or []
        box = n["cache-list"]
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
            self.cache_listeners.on(button, "click", lambda e, key=key: asyncio.ensure_future(self.delete(key)))
            box.append(item)
        if not self.cached:
            box.append(el("li", "No models stored yet.", cls="muted"))
        est = msg.get("estimate") or {}
        summary = (
            f"Using {format_bytes(est.get('usage'))} of {format_bytes(est.get('quota'))} available to this site."
            if est
            else ""
        )
        set_text(n["storage-summary"], summary)
        self.on_change()

    def entry(self, key: str) -> dict[str, Any] | None:
        return next((e for e in self.cached if e["key"] == key), None)

    async def delete(self, key: str) -> None:
        if self.shell.client is not None:
            self.render(await self.shell.client.delete_model(key))

    async def persist(self, quiet: bool = False) -> None:
        granted = await services.request_persistence()
        text = {
            True: "Stored models are kept (persistent storage granted).",
            False: "The browser may evict stored models when space runs low (persistent storage was not granted).",
            None: "This browser cannot make storage persistent.",
        }[granted]
        self.shell.n["persist"].setAttribute("data-persisted", {True: "1", False: "0", None: ""}[granted])
        if not quiet or granted:
            set_text(self.shell.n["storage-summary"], text)
