"""DOM helpers for the page (main thread, PyScript).

Safety rule: text from models, files and URLs is only ever set with `textContent` or appended as
Text nodes. Nothing in this package assigns `innerHTML`; elements are built with createElement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import js
from pyodide.ffi import create_proxy


def by_id(element_id: str) -> Any:
    node = js.document.getElementById(element_id)
    if node is None:
        raise LookupError(f"the page has no element #{element_id}")
    return node


def el(
    tag: str,
    text: str | None = None,
    *,
    cls: str | None = None,
    attrs: dict[str, str] | None = None,
    children: Iterable[Any] = (),
) -> Any:
    """A new element with text (as text, never parsed), class, attributes and children."""
    node = js.document.createElement(tag)
    if cls:
        node.className = cls
    for name, value in (attrs or {}).items():
        node.setAttribute(name, str(value))
    if text is not None:
        node.textContent = text
    for child in children:
        node.append(child)
    return node


def set_text(node: Any, text: str) -> None:
    node.textContent = text


def append_text(node: Any, text: str) -> None:
    node.append(js.document.createTextNode(text))


def clear(node: Any) -> None:
    while node.firstChild is not None:
        node.removeChild(node.firstChild)


def show(node: Any, visible: bool = True) -> None:
    node.hidden = not visible


class Listeners:
    """Event listeners backed by Python functions; keeps their proxies so they can be freed."""

    def __init__(self) -> None:
        self._bound: list[tuple[Any, str, Any]] = []

    def on(self, node: Any, event: str, handler: Callable[[Any], Any]) -> None:
        proxy = create_proxy(handler)
        node.addEventListener(event, proxy)
        self._bound.append((node, event, proxy))

    def off_node(self, node: Any) -> None:
        keep = []
        for bound in self._bound:
            if bound[0] == node:
                bound[0].removeEventListener(bound[1], bound[2])
                bound[2].destroy()
            else:
                keep.append(bound)
        self._bound = keep

    def clear(self) -> None:
        for node, event, proxy in self._bound:
            node.removeEventListener(event, proxy)
            proxy.destroy()
        self._bound = []


def render_failure(
    container: Any, title: str, message: str, advice: Iterable[str], detail: str = "", actions: Iterable[Any] = ()
) -> None:
    """A readable failure block: title, what happened, what to do (all as text), then `actions`
    (elements such as a button that fixes it; their listeners belong to the caller)."""
    clear(container)
    container.append(el("h2", title))
    if message:
        container.append(el("p", message, cls="failure-message"))
    items = list(advice)
    if items:
        container.append(el("ul", children=[el("li", a) for a in items]))
    buttons = list(actions)
    if buttons:
        container.append(el("div", cls="actions", children=buttons))
    if detail:
        container.append(el("details", children=[el("summary", "Details"), el("pre", detail)]))
    show(container)
