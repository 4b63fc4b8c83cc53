"""The browser app: PyScript main-thread UI and the Pyodide engine worker.

Main thread (PyScript): `chat_app` (the chat page), `widget` (the embeddable TL;DR box), both
talking to the worker through `client.EngineClient`. Worker (plain Pyodide in a Web Worker, booted
by static/engine-worker.js): `worker` owns the engine, `model_store` the IndexedDB cache and
`download` the resumable fetch. `protocol`, `failures`, `progress` and `settings` are pure Python
(no `js` import), shared by both sides and tested under CPython.
"""
