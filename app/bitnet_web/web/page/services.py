"""Page services shared by the chat app and the widget (main thread): WebGPU probe, the model
list, storage checks, persistent storage, the service worker."""

from __future__ import annotations

from typing import Any

import js

from ..shared.progress import format_bytes

CUSTOM = "custom"


async def probe_webgpu() -> tuple[str | None, str]:
    """(failure kind or None, a sentence about the adapter or the problem)."""
    gpu = getattr(js.navigator, "gpu", None)
    if gpu is None:
        secure = bool(getattr(js.window, "isSecureContext", True))
        why = "navigator.gpu is missing" + (
            ""
            if secure
            else " because the page is not served from "
            "https:// or http://localhost / 127.0.0.1 (WebGPU needs a secure context)"
        )
        return "no_webgpu", f"This browser does not expose WebGPU ({why})."
    try:
        adapter = await gpu.requestAdapter()
    except Exception as e:
        return "no_adapter", f"navigator.gpu.requestAdapter() failed: {e}"
    if adapter is None:
        return "no_adapter", "navigator.gpu.requestAdapter() found no usable GPU adapter."
    info = getattr(adapter, "info", None)
    name = (
        " / ".join(str(getattr(info, k, "") or "") for k in ("vendor", "architecture")).strip(" /")
        if info is not None
        else ""
    )
    return None, f"WebGPU adapter: {name or 'unnamed'}"


async def fetch_json(url: str) -> Any:
    resp = await js.fetch(url)
    if not resp.ok:
        raise OSError(f"{url}: HTTP {int(resp.status)}")
    return (await resp.json()).to_py()


def model_descriptor(entry: dict[str, Any], root_url: str) -> dict[str, Any]:
    """What the worker needs to load a model: its absolute URL is also its cache key."""
    url = str(js.URL.new(entry["url"], root_url).href)
    return {
        "key": url,
        "url": url,
        "name": entry.get("name") or url,
        "size": entry.get("size"),
        "size_hint": entry.get("size_hint"),
        "sha256": entry.get("sha256"),
        "bundled": bool(entry.get("bundled")),
    }


def custom_descriptor(url: str) -> dict[str, Any]:
    """A model from a URL the person typed; raises ValueError when it is not http(s)."""
    text = url.strip()
    try:
        parsed = js.URL.new(text, js.document.baseURI)
    except Exception:
        raise ValueError(f"{text!r} is not a URL") from None
    if str(parsed.protocol) not in ("http:", "https:"):
        raise ValueError(f"{text!r}: only http:// and https:// URLs can be downloaded")
    href = str(parsed.href)
    name = href.rstrip("/").rsplit("/", 1)[-1] or href
    return {"key": href, "url": href, "name": name, "size": None, "size_hint": None, "sha256": None, "bundled": False}


async def storage_shortfall(needed: int | None) -> str | None:
    """A message when `needed` more bytes will not fit in this site's storage quota, else None."""
    storage = getattr(js.navigator, "storage", None)
    if not needed or storage is None:
        return None
    try:
        est = await storage.estimate()
        quota, usage = int(est.quota), int(est.usage)
    except Exception:
        return None
    free = quota - usage
    if needed <= free:
        return None
    return (
        f"The model needs {format_bytes(needed)} of browser storage; this site may use "
        f"{format_bytes(max(0, free))} more (quota {format_bytes(quota)}, used {format_bytes(usage)})."
    )


async def request_persistence() -> bool | None:
    """Ask that this site's storage not be evicted under pressure (a big model costs a lot to
    fetch again). None when the browser has no such API."""
    storage = getattr(js.navigator, "storage", None)
    if storage is None or not hasattr(storage, "persist"):
        return None
    try:
        if await storage.persisted():
            return True
        return bool(await storage.persist())
    except Exception:
        return None


async def is_persisted() -> bool | None:
    storage = getattr(js.navigator, "storage", None)
    if storage is None or not hasattr(storage, "persisted"):
        return None
    try:
        return bool(await storage.persisted())
    except Exception:
        return None


async def register_service_worker(root_url: str) -> str:
    """Register sw.js (it precaches the app, Pyodide and the bundled model); returns a status line."""
    container = getattr(js.navigator, "serviceWorker", None)
    if container is None:
        return "Offline use unavailable (no service worker support in this context)"
    try:
        from ..shared.jsutil import js_obj

        await container.register(root_url + "sw.js", js_obj({"scope": root_url}))
        await container.ready
    except Exception as e:
        return f"Offline use unavailable: {e}"
    return "Available offline"
