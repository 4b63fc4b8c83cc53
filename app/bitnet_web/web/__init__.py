"""The browser app: PyScript main-thread UI and the Pyodide engine worker.

`page/` runs on the main thread (PyScript, no numpy): `chat_app` (the chat page, which wires its
panels: `chat_shell`, `settings_panel`, `storage_panel`, `model_panel`, `conversation`), `widget` (the
embeddable widgets), both talking to the worker through `client.EngineClient`. `worker/` runs in a
Web Worker (plain Pyodide, booted by static/engine-worker.js): `main` owns the engine, `store` the
IndexedDB cache, `downloader` and `checkpoint_downloader` the resumable fetches. `shared/` is pure
Python (`protocol`, `failures`, `progress`, `settings`, ...), used by both sides and tested under CPython.
"""
