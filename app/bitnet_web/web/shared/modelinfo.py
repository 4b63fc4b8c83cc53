"""Model facts for the page, from a GGUF header or from the engine. Pure Python.

Everything here may come from an untrusted file: values are turned into plain strings and numbers,
and the page inserts them as text (never as HTML).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the page imports this module without numpy; only the worker parses GGUF
    from ...formats.gguf_reader import GGUFFile

_TEXT_LIMIT = 200  # a hostile file may carry megabytes of "name"


def _text(value: object) -> str | None:
    if isinstance(value, str):
        return value if len(value) <= _TEXT_LIMIT else value[:_TEXT_LIMIT] + "…"
    return None


def _int(value: object) -> int | None:
    try:
        return int(value) if value is not None and not isinstance(value, (str, bytes, list)) else None
    except (TypeError, ValueError):
        return None


def header_info(gguf: GGUFFile, file_size: int | None) -> dict[str, Any]:
    """What the page shows about a model before (or without) the engine: from the header alone."""
    from ...formats.ggml import Keys

    md = gguf.metadata
    arch = gguf.architecture
    by_type: dict[str, int] = {}
    for t in gguf.tensors.values():
        by_type[t.ggml_type.name] = by_type.get(t.ggml_type.name, 0) + t.n_elements
    tokens = md.get(Keys.TOKENS)
    template = md.get(Keys.CHAT_TEMPLATE)
    return {
        "name": _text(md.get(Keys.NAME)),
        "arch": _text(arch),
        "n_params": sum(t.n_elements for t in gguf.tensors.values()),
        "n_tensors": len(gguf.tensors),
        "weight_types": {k: v for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
        "file_size": file_size,
        "context_length": _int(md.get(f"{arch}.context_length")) if isinstance(arch, str) else None,
        "vocab_size": len(tokens) if isinstance(tokens, list) else None,
        "has_chat_template": isinstance(template, str),
        "gguf_version": gguf.version,
        # an ordinary checkpoint ternarized on load (hf_checkpoint's opt-in): the page must say so
        "lossy": md.get("bitnet_web.lossy_ternarization") is True,
    }


def format_count(n: int | None) -> str:
    if n is None:
        return "?"
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def info_rows(info: dict[str, Any], stats: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """(label, value) rows for the model-info panel, from header_info or engine.info (+ last_stats)."""
    from .progress import format_bytes

    rows = []
    if info.get("name"):
        rows.append(("Name", str(info["name"])))
    if info.get("lossy"):
        rows.append(
            (
                "Quality",
                "EXPERIMENTAL, LOSSY: an ordinary checkpoint ternarized on load; expect degraded or meaningless output",
            )
        )
    rows.append(("Architecture", str(info.get("arch") or "?")))
    rows.append(("Parameters", format_count(_int(info.get("n_params")))))
    if info.get("file_size"):
        rows.append(("File size", format_bytes(_int(info["file_size"]))))
    if info.get("weight_types"):
        rows.append(("Weights", ", ".join(f"{k} {format_count(v)}" for k, v in info["weight_types"].items())))
    if info.get("vocab_size"):
        rows.append(("Vocabulary", f"{int(info['vocab_size']):,}"))
    if info.get("template_kind"):
        rows.append(("Chat format", str(info["template_kind"])))
    ctx = _int(info.get("context_length"))
    used = _int((stats or {}).get("context_used"))
    if ctx or used is not None:
        rows.append(
            (
                "Context",
                f"{used if used is not None else 0:,} of {ctx:,} tokens used" if ctx else f"{used:,} tokens used",
            )
        )
    return rows
