"""Stop strings: generated text cut at the first stop string, never showing part of one. Standard library only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class StopResult(NamedTuple):
    text: str  # safe to show now
    stopped: bool  # a stop string was found; `text` is everything before it


class StopMatcher:
    """Cuts generated text at the first stop string, without ever showing part of one.

    Text is fed piece by piece; a suffix that could still grow into a stop string is held back until
    the next piece settles it. After a match, everything else is discarded.
    """

    def __init__(self, stop_strings: Iterable[str]) -> None:
        stops = tuple(stop_strings)
        for i, stop in enumerate(stops):
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stop_strings[{i}] must be a non-empty string, got {stop!r}")
        self.stop_strings = stops
        self._held = ""
        self.stopped = False

    def push(self, piece: str) -> StopResult:
        if self.stopped:
            return StopResult("", True)
        text = self._held + piece
        first = self._first_match(text)
        # A suffix that may still grow into a stop string; if it starts before the match found,
        # that longer stop string could still end up first, so wait for more text.
        partial_at = len(text) - self._partial_suffix(text)
        if first != -1 and first <= partial_at:
            self._held = ""
            self.stopped = True
            return StopResult(text[:first], True)
        self._held = text[partial_at:]
        return StopResult(text[:partial_at], False)

    def flush(self) -> str:
        """End of generation: the held-back text, up to a stop string it holds (then `stopped`)."""
        text = "" if self.stopped else self._held
        self._held = ""
        first = self._first_match(text)
        if first != -1:
            self.stopped = True
            return text[:first]
        return text

    def _first_match(self, text: str) -> int:
        """Where the earliest stop string in `text` starts, or -1."""
        first = -1
        for stop in self.stop_strings:
            at = text.find(stop)
            if at != -1 and (first == -1 or at < first):
                first = at
        return first

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stop_strings:
            for length in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:length]):
                    best = length
                    break
        return best
