"""Small Pyodide FFI helpers shared by the page and the worker (importable only under Pyodide).

Proxy rule (browser-notes.md): a Python callable handed to JS must be destroyed or it leaks. The
helpers here avoid Python callbacks where JS can do the job (an IndexedDB request resolves a JS
Promise directly) and use `create_once_callable` where one call is certain.
"""

from __future__ import annotations

from typing import Any

import js  # noqa: F401  (Pyodide only)
from pyodide.ffi import JsProxy, create_once_callable, to_js


def js_obj(value: Any) -> Any:
    """A Python dict/list (possibly holding JS objects) as a plain JS object/array."""
    return to_js(value, dict_converter=js.Object.fromEntries, create_pyproxies=False)


def event_promise(target: JsProxy, ok: str, fail: tuple[str, ...] = ("error",)) -> JsProxy:
    """A JS Promise resolved by `target`'s `on<ok>` event and rejected by any `on<fail>` event.

    The event handlers are the Promise's own resolve/reject functions, so no Python proxy outlives
    this call (the executor is a once-callable, freed after its single call).
    """

    def executor(resolve, reject):
        setattr(target, "on" + ok, resolve)
        for name in fail:
            setattr(target, "on" + name, reject)

    return js.Promise.new(create_once_callable(executor))


def sleep_promise(seconds: float) -> JsProxy:
    def executor(resolve, reject):
        js.setTimeout(resolve, int(seconds * 1000))

    return js.Promise.new(create_once_callable(executor))


def hex_digest(array_buffer: JsProxy) -> str:
    """Hex string of a small ArrayBuffer (a SHA-256 digest)."""
    return js.Uint8Array.new(array_buffer).to_bytes().hex()


async def sha256_hex(data: JsProxy) -> str:
    """SHA-256 of a JS ArrayBuffer or typed array, computed natively by WebCrypto."""
    return hex_digest(await js.crypto.subtle.digest("SHA-256", data))


def error_name(err: Any) -> str:
    """The `name` of a JS error/DOMException (or of the JsException wrapping one)."""
    js_error = getattr(err, "js_error", err)
    name = getattr(js_error, "name", None)
    return str(name) if name is not None else type(err).__name__


def error_message(err: Any) -> str:
    js_error = getattr(err, "js_error", err)
    message = getattr(js_error, "message", None)
    return str(message) if message else str(err)


class WebLock:
    """`async with WebLock(name):` holds a Web Lock (navigator.locks) for the block, so two tabs
    never write the same cache entry at once; a no-op where the API is missing.

    The lock is held by a JS Promise that the block's exit resolves; the grant callback is a
    once-callable (called exactly once, by the browser, when the lock is granted).
    """

    def __init__(self, name: str, on_wait=None) -> None:
        self.name = name
        self.on_wait = on_wait
        self._release = None
        self._done = None

    async def __aenter__(self) -> WebLock:
        import asyncio

        locks = getattr(js.navigator, "locks", None)
        if locks is None:
            return self
        granted = asyncio.get_event_loop().create_future()
        holder: list = []

        def hold(resolve, reject):
            holder.append(resolve)

        release_promise = js.Promise.new(create_once_callable(hold))
        self._release = holder[0]

        def on_grant(lock):
            if not granted.done():
                granted.set_result(True)
            return release_promise

        if self.on_wait is not None:
            state = await locks.query()
            if any(str(h.name) == self.name for h in state.held):
                self.on_wait()
        self._done = locks.request(self.name, create_once_callable(on_grant))
        await granted
        return self

    async def __aexit__(self, *exc) -> None:
        if self._release is not None:
            self._release()
            self._release = None
            await self._done


# ------------------------------------------------------------------------------------------------
# Leak accounting (used by the long-session browser test; cheap enough to call from DevTools)
# ------------------------------------------------------------------------------------------------
#
# Pyodide has no public "live proxies" counter. Two internal counters of its runtime module
# (`pyodide._module`, the same ones Pyodide's own test suite uses to find leaks) cover both
# directions of the FFI:
#
# - PyProxies (Python objects handed to JS: create_proxy, callbacks, returned objects). After
#   `enable_pyproxy_allocation_tracing()` every PyProxy created is recorded in
#   `pyproxy_alloc_map` and removed when it is destroyed (explicitly, or by a once-callable after
#   its call). The map holds each proxy strongly, so a proxy that only JS garbage collection would
#   free also stays counted: the count is an upper bound, and a count that does not grow over N
#   requests shows that no request leaves a proxy behind, GC or not (a FinalizationRegistry count
#   would depend on when the collector runs).
# - JS references held by Python (every JsProxy: DOM nodes, GPU objects, promises), counted by
#   `_hiwire_num_refs()`. A JsProxy is released when its Python object dies, so `gc.collect()`
#   runs first: what remains is reachable from Python.


def start_proxy_census() -> None:
    """Start recording PyProxy allocations in this interpreter (page or worker); only proxies
    created from now on are counted."""
    import pyodide_js  # noqa: PLC0415

    pyodide_js._module.enable_pyproxy_allocation_tracing()


def proxy_census() -> dict[str, int]:
    """{"pyproxies": PyProxies created since start_proxy_census() and not destroyed, "js_refs":
    JS values Python still references} for this interpreter (see the comment above)."""
    import gc  # noqa: PLC0415

    import pyodide_js  # noqa: PLC0415

    gc.collect()
    module = pyodide_js._module
    return {"pyproxies": int(module.pyproxy_alloc_map.size), "js_refs": int(module._hiwire_num_refs())}


def expose_interpreter(name: str = "bitnetPyodide") -> None:
    """Make this page's interpreter reachable from DevTools and the browser tests as
    `globalThis[name]` (the worker's is `self.pyodide`, set by engine-worker.js). Nothing is
    gained by a script on the page that it did not already have: it runs with the page's rights."""
    import pyodide_js  # noqa: PLC0415

    setattr(js.globalThis, name, pyodide_js)


def forbid_eval_from_now_on() -> None:
    """Add a Content-Security-Policy without 'unsafe-eval' to the page.

    PyScript 0.6 compiles its hook functions with `Function()` while it starts, so the page's own
    policy (its <meta> tag, and build.py's header) must allow 'unsafe-eval'; without it core.js
    throws EvalError and the page never starts. Once the app's Python runs, that is no longer
    needed: a second policy, the first minus 'unsafe-eval', is added. A page enforces every policy
    it has (a request must pass all of them), so from here on eval(), new Function() and string
    timers are refused in this page for good, while everything else stays as allowed before.
    """
    meta = js.document.querySelector('meta[http-equiv="Content-Security-Policy"]')
    if meta is None:
        return
    policy = str(meta.content)
    if "'unsafe-eval'" not in policy:
        return
    strict = js.document.createElement("meta")
    strict.httpEquiv = "Content-Security-Policy"
    strict.content = " ".join(policy.replace("'unsafe-eval'", "").split())
    strict.setAttribute("data-added-by", "bitnet-web")
    js.document.head.append(strict)
