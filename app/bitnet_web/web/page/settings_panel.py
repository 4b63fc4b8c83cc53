"""The chat page's Settings panel: the form built from `shared.settings.FIELDS`, read back before each
turn (a bad value is named, its field highlighted and focused; once a send has found one, the form is
checked again as it is edited, so a corrected value clears the error), and the system prompt box.

Adding a setting is one new `Field` in shared/settings.py: the form, its parsing and the dict sent
to the worker follow from it."""

from __future__ import annotations

from typing import Any

from ..shared.settings import (
    DEFAULT_SYSTEM_PROMPT,
    FIELDS,
    FIELDS_BY_NAME,
    Field,
    SettingsError,
    format_number,
    parse_form,
)
from .chat_shell import Shell
from .dom import Listeners, by_id, clear, el, set_text


def field_id(f: Field) -> str:
    return "setting-" + f.name.replace("_", "-")


class SettingsPanel:
    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.listeners = Listeners()
        self.showing_error = False

    def build(self) -> None:
        box = self.shell.n["settings-fields"]
        clear(box)
        self.listeners.clear()
        self.listeners.on(box, "input", lambda event: self._recheck())
        for f in FIELDS:
            if f.kind is bool:
                box.append(self._switch(f))
                continue
            attrs = {
                "id": field_id(f),
                "name": f.name,
                "type": "number",
                "inputmode": "decimal",
                "spellcheck": "false",
                "min": format_number(f.low),
                "max": format_number(f.high),
                "step": "1" if f.kind is int else "0.05",
                "value": "" if f.default is None else format_number(f.default),
                # an emptied field uses the default: the placeholder shows which
                "placeholder": f.blank if f.default is None else format_number(f.default),
                "aria-describedby": field_id(f) + "-hint",
            }
            box.append(
                el(
                    "label",
                    children=[
                        el("span", f.label),
                        el("input", attrs=attrs),
                        el("small", f.hint, cls="muted", attrs={"id": field_id(f) + "-hint"}),
                    ],
                )
            )
        self.shell.n["system-prompt"].value = DEFAULT_SYSTEM_PROMPT

    def _switch(self, f: Field) -> Any:
        attrs = {"id": field_id(f), "name": f.name, "type": "checkbox", "aria-describedby": field_id(f) + "-hint"}
        if f.default:
            attrs["checked"] = ""
        return el(
            "label",
            cls="switch",
            children=[
                el("input", attrs=attrs),
                el("span", f.label),
                el("small", f.hint, cls="muted", attrs={"id": field_id(f) + "-hint"}),
            ],
        )

    def read(self, focus: bool = True) -> dict[str, Any] | None:
        """The settings as the worker takes them, or None after showing what is wrong (the panel
        opened and, with `focus`, the bad field focused)."""
        inputs = {f.name: by_id(field_id(f)) for f in FIELDS}
        for node in inputs.values():
            node.removeAttribute("aria-invalid")
        try:
            settings = parse_form({f.name: _form_text(f, inputs[f.name]) for f in FIELDS})
        except SettingsError as e:
            set_text(self.shell.n["settings-error"], str(e))
            self.showing_error = True
            by_id("settings-panel").open = True
            if e.field in inputs:
                inputs[e.field].setAttribute("aria-invalid", "true")
                if focus:
                    inputs[e.field].focus()
            return None
        set_text(self.shell.n["settings-error"], "")
        self.showing_error = False
        return settings

    def switched_on(self, name: str) -> bool:
        """A checkbox setting as it stands now (no other field is checked)."""
        return bool(by_id(field_id(FIELDS_BY_NAME[name])).checked)

    def _recheck(self) -> None:
        """An edit after an error: show the form's state now (cleared, or the next bad value), without
        moving the focus away from the field being typed in."""
        if self.showing_error:
            self.read(focus=False)

    def system_prompt(self) -> str:
        return str(self.shell.n["system-prompt"].value).strip()

    def set_completion_mode(self, completion: bool) -> None:
        box = self.shell.n["system-prompt"]
        box.disabled = completion  # a text-continuation model has no system role
        note = "Not used: this model has no chat format, it continues your text." if completion else ""
        box.title = note
        set_text(self.shell.n["system-note"], note)


def _form_text(f: Field, node: Any) -> str:
    if f.kind is bool:
        return "true" if node.checked else "false"
    return str(node.value)
