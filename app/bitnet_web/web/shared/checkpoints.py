"""Hugging Face checkpoint folders as the page sees them: descriptors and cache listing (pure Python, no numpy).

`as_checkpoint(descriptor)` turns a model URL that names a folder (https://huggingface.co/ORG/NAME,
.../tree/REV, a .../resolve/REV/ base, any URL ending in '/') into a checkpoint descriptor: key and url
are the folder's base URL (ending in '/'), format 'hf'. The worker fetches and converts it
(worker/checkpoint_downloader.py).
"""

from __future__ import annotations

from typing import Any

from ...convert.hf_urls import checkpoint_base_url, checkpoint_name

FORMAT = "hf"
LOSSY_FIELD = "allow_lossy_ternarization"  # in the page's model descriptor: the person's explicit opt-in


def as_checkpoint(descriptor: dict[str, Any]) -> dict[str, Any]:
    """The page's model descriptor for a URL: a checkpoint folder's if the URL names one, else unchanged."""
    base = checkpoint_base_url(str(descriptor.get("url") or ""))
    if base is None:
        return descriptor
    return {**descriptor, "key": base, "url": base, "name": checkpoint_name(base), "format": FORMAT}


def is_checkpoint_model(model: dict[str, Any]) -> bool:
    """True for a checkpoint descriptor, also one rebuilt from a cache entry (its url is the base URL)."""
    url = str(model.get("url") or "")
    return model.get("format") == FORMAT or (bool(url) and checkpoint_base_url(url) == url)


def part_keys(group: dict[str, Any]) -> list[str]:
    """The cache keys of a group's files."""
    return [group["key"] + f["name"] for f in group.get("files") or []]


def visible_entries(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cache entries as the cache manager lists them: a checkpoint's files are inside its group's row."""
    parts = {k for e in entries if e.get("format") == FORMAT for k in part_keys(e)}
    return [e for e in entries if e["key"] not in parts]
