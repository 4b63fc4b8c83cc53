"""The browser page side (PyScript main thread, no numpy): chat app, widget, DOM helpers, the worker client."""
