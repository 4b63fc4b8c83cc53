"""Sampling settings as the page edits them: parsing, bounds, and conversion for the engine.

The page holds settings as a plain dict (it crosses to the worker as JSON); the worker turns it into
the engine's `SamplerSettings`, passing only the fields that dataclass has.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple


class Field(NamedTuple):
    """One setting. A new one is one line in FIELDS: the Settings panel shows it (a number field, or a
    checkbox for kind bool), parse_form reads it, and the worker gets it in the settings dict."""

    name: str
    label: str
    kind: type  # int, float or bool
    default: Any
    low: float
    high: float
    hint: str
    blank: str = ""  # what an empty field means, where the default is None (shown as its placeholder)


FIELDS = (
    Field("temperature", "Temperature", float, 0.7, 0.0, 2.0, "0 = always the most likely token"),
    Field("top_k", "Top-k", int, 40, 0, 1000, "0 = no limit"),
    Field("top_p", "Top-p", float, 0.9, 0.0, 1.0, "1 = no limit"),
    Field("max_tokens", "Max tokens", int, 256, 1, 8192, "length of one reply"),
    Field("repetition_penalty", "Repetition penalty", float, 1.1, 0.5, 2.0, "1 = off"),
    Field("seed", "Seed", int, None, 0, 2**32 - 1, "empty = random", "random"),
    # the engine's largest draft is kernels/speculative.py SPECULATE_MAX (a test checks they agree)
    Field(
        "speculate",
        "Speculative decoding (draft tokens)",
        int,
        None,
        0,
        8,
        "empty = automatic, 0 = off; faster on repeated text, greedy replies unchanged",
        "auto",
    ),
    # read by the page, not the engine: EngineClient.typing (model/warm_up.py)
    Field(
        "warm_up",
        "Warm up the GPU while I type",
        bool,
        True,
        0,
        1,
        "an idle GPU runs the next reply's first tokens slowly; off saves a little power",
    ),
)
FIELDS_BY_NAME = {f.name: f for f in FIELDS}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


class SettingsError(ValueError):
    """A settings value that is not a number or out of range; names the field (`field`: its name)."""

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def format_number(value: float) -> str:
    """A bound or default as a person writes it: 4294967295, 0.7 (never 4.29497e+09)."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def parse_value(name: str, text: str) -> Any:
    """Parse one form value; empty means the default. Raises SettingsError naming the field."""
    return parse_field(FIELDS_BY_NAME[name], text)


def parse_field(f: Field, text: str) -> Any:
    """`parse_value` for a given Field (a checkbox's value is "true" or "false")."""
    text = text.strip()
    if text == "":
        return f.default
    if f.kind is bool:
        if text.lower() not in ("true", "false"):
            raise SettingsError(f"{f.label}: {text!r} is not true or false", f.name)
        return text.lower() == "true"
    try:
        value = f.kind(float(text)) if f.kind is int else f.kind(text)
        if f.kind is int and float(text) != int(float(text)):
            raise ValueError
    except ValueError:
        raise SettingsError(
            f"{f.label}: {text!r} is not {'a whole number' if f.kind is int else 'a number'}", f.name
        ) from None
    if value != value or not f.low <= value <= f.high:
        raise SettingsError(f"{f.label}: {text} is outside {format_number(f.low)} to {format_number(f.high)}", f.name)
    return value


def parse_form(values: dict[str, str]) -> dict[str, Any]:
    """All fields from their form texts (missing ones take the default)."""
    return {f.name: parse_value(f.name, values.get(f.name, "")) for f in FIELDS}


def to_engine_settings(settings: dict[str, Any], settings_cls: type) -> Any:
    """An instance of the engine's settings dataclass from the page's dict (unknown keys dropped)."""
    names = {f.name for f in dataclasses.fields(settings_cls)}
    kwargs = {k: v for k, v in settings.items() if k in names and v is not None}
    return settings_cls(**kwargs)


def speculate_option(settings: dict[str, Any], method: Callable) -> tuple[dict[str, int], str]:
    """The keyword for an engine call (`Engine.generate_tokens_async`, `chat_async`, ...) that drafts
    up to `settings["speculate"]` tokens per step (0 = off): {"speculate": K} when `method` takes it;
    {} for None (the engine's own choice), or with a note for the log when drafting was asked for
    and this engine cannot do it."""
    k = settings.get("speculate")
    if k is None:
        return {}, ""
    try:
        parameters = inspect.signature(method).parameters
    except (TypeError, ValueError):  # a callable without a signature: do not guess
        parameters = {}
    if "speculate" in parameters:
        return {"speculate": int(k)}, ""
    if not k:
        return {}, ""  # off, and this engine never drafts
    return {}, f"speculative decoding ({k} draft tokens) is not available in this engine build: generating without it"


def greedy(max_tokens: int) -> dict[str, Any]:
    """Settings that make generation deterministic (used by the widget and the tests)."""
    return {
        **DEFAULTS,
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "repetition_penalty": 1.0,
        "max_tokens": max_tokens,
        "seed": 0,
    }
