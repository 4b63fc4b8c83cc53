"""A cached model file read from IndexedDB into wasm memory in the background, awaited by byte offset.

The engine parses the header as soon as its bytes are in and uploads each part of the model when
its bytes are (`Engine.load_async(..., ready=stream.wait)`), so reading and uploading overlap
instead of taking turns. A chunk's bytes are in once copied and checked (ModelStore.read_into); the
whole file is in only after the whole file's expected SHA-256 (if the entry has one) matched too:
the engine waits for that before it reports ready, so a damaged copy never becomes the loaded model.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .store import CorruptEntryError, ModelStore


class FileStream:
    """`data` (the whole file's size) filled in order by a background task; `await wait(n)`."""

    def __init__(
        self,
        store: ModelStore,
        meta: dict[str, Any],
        on_chunk: Callable[[int, int], None] | None = None,
    ) -> None:
        """`on_chunk(done, total)` runs after each chunk is in (progress and Cancel: an exception it
        raises ends the read, and every waiter gets it)."""
        total = int(meta["total"])
        try:
            self.data = np.empty(total, dtype=np.uint8)
        except MemoryError:
            raise MemoryError(f"could not reserve {total:,} bytes of WebAssembly memory for {meta['name']}") from None
        self.store, self.meta, self.total = store, meta, total
        self.filled = 0  # bytes copied into `data`, each chunk checked
        self._checked = False  # the read is complete (and the file's SHA-256, if known, matched)
        self.timings: dict[str, float] = {}
        self._on_chunk = on_chunk
        self._error: BaseException | None = None
        self._changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._read())

    @property
    def done(self) -> bool:
        """The whole file is in `data` and checked."""
        return self._checked

    @property
    def failed(self) -> BaseException | None:
        return self._error

    async def wait(self, n: int) -> None:
        """Return once the first n bytes are in `data` (the whole file: and checked); raise the
        reader's error if it failed first."""
        n = min(int(n), self.total)
        while self.filled < n or (n == self.total and not self._checked):
            if self._error is not None:
                raise self._error
            self._changed.clear()
            await self._changed.wait()

    async def finish(self) -> BaseException | None:
        """Let the read end (it is not cancelled) and return its error, if any."""
        if self._task is not None:
            await asyncio.wait([self._task])
        return self._error

    def fail(self, error: Exception) -> None:
        """End the read now with `error` (Cancel): a waiter gets it at once, not at the next chunk."""
        if self._error is None and not self.done:
            self._error = error
            self._changed.set()
            if self._task is not None:
                self._task.cancel()

    async def close(self) -> None:
        """Stop reading (a failed or cancelled load) and retrieve the task's outcome."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait([self._task])

    async def _read(self) -> None:
        expected = self.meta.get("sha256")
        hasher = hashlib.sha256() if expected else None
        data, total = self.data, self.total
        started = time.perf_counter()
        hash_s = [0.0]

        def chunk_in(done: int, _total: int) -> None:
            if self._on_chunk is not None:
                self._on_chunk(done, total)
            if hasher is not None:
                t0 = time.perf_counter()
                hasher.update(data[self.filled : done])
                hash_s[0] += time.perf_counter() - t0
                if done == total and hasher.hexdigest() != expected:
                    actual = hasher.hexdigest()
                    raise CorruptEntryError(
                        f"{self.meta['name']}: SHA-256 {actual[:16]}… does not match the expected {expected[:16]}…"
                    )
            self.filled = done
            self._changed.set()

        try:
            await self.store.read_into(self.meta, data, chunk_in, self.timings)
            self._checked = True
            self._changed.set()
        except BaseException as e:
            if self._error is None:  # (fail() set it already when it cancelled the task)
                self._error = e if isinstance(e, Exception) else RuntimeError("the read was stopped")
            self._changed.set()
            if not isinstance(e, Exception):
                raise
        finally:
            self.timings["read_s"] = time.perf_counter() - started
            self.timings["file_hash_s"] = hash_s[0]
