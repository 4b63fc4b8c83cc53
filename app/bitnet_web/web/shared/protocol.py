"""Messages between the page and the engine worker.

Every message is one JSON string (postMessage of a str): no JS proxies cross the boundary, nothing
leaks, and both sides parse the same way. Model bytes never travel in messages: the worker fetches,
caches and loads them itself, so the page holds no copy.

Page -> worker: {"op": ..., "id": int, ...}
  init                                   -> ready
  list_models                            -> models
  delete_model  key                      -> models
  load          model {key,url,name,size,sha256}, id -> progress*, header?, loaded | error
                (a checkpoint folder also has format "hf" and maybe allow_lossy_ternarization: shared/checkpoints.py)
  cancel_load                            (the running load ends with error kind "cancelled", in any phase;
                                          the model loaded before stays loaded)
  chat          messages, settings, id   -> progress* (phase "prefill"), piece*, done | error
                (settings: shared/settings.py FIELDS; "speculate" K > 0 drafts K tokens per step, or logs
                that this engine cannot and generates without drafts)
  complete      prompt, settings, id     -> progress* (phase "prefill"), piece*, done | error
                keep_recent, latest_chars (optional: keep the most recent text that fits the context,
                the last latest_chars characters being the new message; error kind "too_long" if it
                alone does not fit)
  abort                                  (the running generation ends after its current token, or while
                                          the prompt is read, after its current prefill chunk)
  reset                                  (forget the KV cache)
  warm_up       force                    -> warmed (raise the GPU's clocks before a reply: the page sends it
                                          while the person types; skipped while a load, a reply or another
                                          warm-up runs, and on a CPU adapter unless force)

Worker -> page: {"event": ..., "id": int | None, ...}
  ready     engine_available, engine_error, gpu {available, adapter, features, error}
  models    entries [{key,name,url,total,stored,complete,updated}], estimate {usage, quota}
  progress  phase ("download"|"read"|"verify"|"convert"|"parse"|"upload"; "prefill": prompt tokens
            read of those to compute, after each prefill chunk but the last), done, total, note
  header    info (from the GGUF header: name, arch, n_params, file_size, context_length, ...)
  loaded    info (engine.info when the engine is present), source ("network"|"cache"), offline_copy
            (the "network" fetch was answered by the service worker's offline copy), key
  piece     text
  done      stats (engine.last_stats), reason ("end"|"aborted"), dropped_tokens (keep_recent)
  warmed    stats (Engine.warm_up_async's: seconds, submits, heads, stopped) or skipped (why not)
  error     kind, title, message, advice [str], detail
  fatal     kind, message (the worker could not start)
"""

from __future__ import annotations

import json
from typing import Any

OPS = frozenset(
    {"init", "list_models", "delete_model", "load", "cancel_load", "chat", "complete", "abort", "reset", "warm_up"}
)
EVENTS = frozenset(
    {"ready", "models", "progress", "header", "loaded", "piece", "done", "error", "fatal", "log", "warmed"}
)


class ProtocolError(ValueError):
    """A message that is not valid JSON or lacks its op/event name."""


def _clean(value: Any) -> Any:
    """A JSON-safe copy: numpy scalars as Python numbers, NaN/inf as null (JSON has neither)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, (str, int, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_clean(v) for v in value]
    item = getattr(value, "item", None)
    return _clean(item()) if callable(item) else str(value)


def encode(message: dict[str, Any]) -> str:
    return json.dumps(_clean(message), separators=(",", ":"), allow_nan=False)


def decode(raw: object, *, key: str, allowed: frozenset[str]) -> dict[str, Any]:
    """Parse one message; `key` is "op" (worker side) or "event" (page side)."""
    if not isinstance(raw, str):
        raise ProtocolError(f"message is a {type(raw).__name__}, expected a JSON string")
    try:
        message = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ProtocolError(f"message is not JSON ({e}): {raw[:80]!r}") from None
    if not isinstance(message, dict) or message.get(key) not in allowed:
        raise ProtocolError(f"message has no known {key!r}: {raw[:80]!r}")
    return message
