"""Progress numbers for the page: bytes, speed over a recent window, time left. Pure Python."""

from __future__ import annotations

from collections import deque
from typing import Any

PHASE_LABELS = {
    "download": "Downloading",
    "read": "Reading from browser storage",
    "verify": "Checking",
    "parse": "Parsing",
    "convert": "Converting the checkpoint",
    "upload": "Uploading to the GPU",
    "prefill": "Reading the prompt",  # a generation's first phase: done, total are prompt tokens
}


def format_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class RateMeter:
    """Bytes per second over the last `window_s` seconds of (time, bytes done) samples."""

    def __init__(self, window_s: float = 4.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def reset(self) -> None:
        self._samples.clear()

    def add(self, t: float, done: int) -> None:
        if self._samples and done < self._samples[-1][1]:
            self._samples.clear()  # a restarted download: old samples would give a negative speed
        self._samples.append((t, done))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float | None:
        if len(self._samples) < 2:
            return None
        (t0, d0), (t1, d1) = self._samples[0], self._samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def eta(self, total: int | None) -> float | None:
        rate = self.rate()
        if total is None or not rate or rate <= 0 or not self._samples:
            return None
        return max(0, total - self._samples[-1][1]) / rate


def progress_text(phase: str, done: int, total: int | None, rate: float | None, eta: float | None) -> str:
    """One line such as "Downloading 12.0 MB of 1.2 GB (1%), 8.0 MB/s, 2 min 28 s left"."""
    label = PHASE_LABELS.get(phase, phase.capitalize())
    if phase == "prefill":
        return f"{label}: {done:,} of {total or done:,} tokens"
    if phase == "parse" and total and total < 100_000:
        return f"Checking the model file: step {done} of {total}"
    if phase == "upload" and total and total < 100_000:
        return f"Uploading to the GPU: part {done} of {total} ({100 * done / total:.0f}%)"
    if phase == "convert" and total and total < 100_000:  # counts of tensors, not bytes
        return f"{label}: {done} of {total}"
    parts = [f"{label} {format_bytes(done)}"]
    if total:
        parts[0] += f" of {format_bytes(total)} ({100 * done / total:.0f}%)"
    if rate:
        parts.append(f"{format_bytes(rate)}/s")
    if eta is not None and total and done < total:
        parts.append(f"{format_duration(eta)} left")
    return ", ".join(parts)


def fraction(done: int, total: int | None) -> float | None:
    if not total:
        return None
    return min(1.0, max(0.0, done / total))


def stats_line(stats: dict[str, Any], reason: str | None = None) -> str:
    """ "42 tokens, 12.3 tok/s, first token after 0.41 s" (plus "stopped")."""
    parts = []
    n = stats.get("n_generated")
    if n is not None:
        parts.append(f"{int(n)} token{'' if int(n) == 1 else 's'}")
    speed = stats.get("decode_tok_per_s")
    if speed:
        parts.append(f"{float(speed):.1f} tok/s")
    ttft = stats.get("ttft_s")
    if ttft is not None and n != 0:
        parts.append(f"first token after {float(ttft):.2f} s")
    if reason == "aborted":
        parts.append("stopped while reading the prompt" if n == 0 else "stopped")
    if stats.get("n_dropped_messages"):
        k = int(stats["n_dropped_messages"])
        parts.append(f"{k} oldest message{'' if k == 1 else 's'} left out to fit the context")
    if stats.get("dropped_tokens"):
        parts.append(f"the oldest {int(stats['dropped_tokens']):,} tokens of the text left out to fit the context")
    return ", ".join(parts)


def cut_note(stats: dict[str, Any], settings: dict[str, Any], context: int | None) -> str:
    """Why a reply ended before the model finished it, or "" when it finished."""
    reason = stats.get("stop_reason")
    if reason == "max_tokens":
        return f"cut at Max tokens ({settings.get('max_tokens')}): raise it in Settings for longer replies"
    if reason == "context_full":
        size = f" ({int(context):,} tokens)" if context else ""
        return f"cut: the model's context{size} is full; the oldest text is dropped on the next turn"
    return ""


def loaded_from(source: str, offline_copy: bool) -> str:
    """Where a loaded model came from, as the Model panel says it: browser storage (source "cache"),
    the app's offline copy (the service worker's cache, read without the network), or a download."""
    if source == "cache":
        return "Loaded from browser storage."
    if offline_copy:
        return "Loaded from the app's offline copy (no network needed)."
    return "Downloaded from the network and loaded."
