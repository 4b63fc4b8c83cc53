"""The test site server: dist/ + /_test/, request log, fault injection."""

from __future__ import annotations

import functools
import io
import os
import shutil
import socket
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import build  # noqa: E402  (the repo's build.py: its server is part of what is tested)

__all__ = ["SiteServer", "build"]


# ------------------------------------------------------------------------------------------------
# The site server
# ------------------------------------------------------------------------------------------------


class SiteHandler(build.DistRequestHandler):
    """dist/ at /, the tests' files at /_test/; records requests; injects faults per path:
    status (answer that HTTP status), delay_s (wait before answering), ignore_range (answer 200
    with the whole file), drop_after (cut the connection after that many body bytes, pause_s
    after sending them; with reset=True the cut is a TCP reset, as a network failure, rather than
    the server closing), short_by (announce the whole Content-Length, send that many bytes less and
    close: a response shorter than its Content-Length), body (answer 200 with these bytes instead of
    the file, content_type e.g. an HTML page from a captive portal), hold (a threading.Event: with
    drop_after, the transfer stalls after those bytes until the test sets the event, then sends the
    rest: a download kept in progress for as long as a test needs)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def translate_path(self, path: str) -> str:
        clean = path.split("?", 1)[0].split("#", 1)[0]
        if clean.startswith("/_test/"):
            name = clean[len("/_test/") :]
            # sub-folders are allowed (e.g. a checkpoint at /_test/hf/ORG/NAME/resolve/main/), but no
            # empty, hidden or ".." segment: nothing outside test_files is ever served
            if any(not part or part.startswith(".") for part in name.split("/")):
                return str(self.server.test_files / ".invalid")
            return str(self.server.test_files / name)
        return super().translate_path(path)

    def send_head(self):
        clean = self.path.split("?", 1)[0]
        fault = self.server.take_fault(clean)
        self.server.record(
            {
                "method": self.command,
                "path": clean,
                "range": self.headers.get("Range"),
                "if_range": self.headers.get("If-Range"),
            }
        )
        self._drop_after = None
        self._drop_reset = False
        if fault:
            time.sleep(fault.get("delay_s", 0))  # a slow server: keeps a download in progress
            if fault.get("status"):
                self.send_error(fault["status"])
                return None
            if fault.get("body") is not None:
                self._range = None  # (the handler lives as long as its keep-alive connection)
                self.send_response(200)
                self.send_header("Content-Type", fault.get("content_type", "text/html; charset=utf-8"))
                self.send_header("Content-Length", str(len(fault["body"])))
                self.end_headers()
                return io.BytesIO(fault["body"])
            if fault.get("ignore_range") and "Range" in self.headers:
                del self.headers["Range"]
            self._drop_after = fault.get("drop_after")
            self._drop_reset = bool(fault.get("reset"))
            self._hold = fault.get("hold")
            self._drop_pause_s = fault.get("pause_s", 1.0)
        f = super().send_head()
        if fault and fault.get("short_by") is not None and f is not None:
            length = (self._range[1] - self._range[0] + 1) if self._range else os.fstat(f.fileno()).st_size
            self._drop_after = max(0, length - int(fault["short_by"]))
        return f

    def copyfile(self, source, outputfile) -> None:
        if self._drop_after is None:
            return super().copyfile(source, outputfile)
        # send the first bytes, let the browser hand them to the page, then cut the connection
        # mid-body (a dropped network); without the pause Chromium may report the error first
        try:
            outputfile.write(source.read(self._drop_after))
            outputfile.flush()
            if self._hold is not None:  # a stall, then the rest of the body
                self._hold.wait(timeout=120)
                shutil.copyfileobj(source, outputfile)
                return
        except OSError:
            return  # the browser went away (a cancelled download, a closed tab)
        time.sleep(self._drop_pause_s)
        self.close_connection = True
        if self._drop_reset:  # closing with a zero linger time sends RST instead of FIN
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class SiteServer(build.DistServer):
    def __init__(self, dist: Path, test_files: Path, port: int = 0) -> None:
        self.test_files = test_files
        self.requests: list[dict[str, Any]] = []
        self.faults: dict[str, list[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", port), functools.partial(SiteHandler, directory=str(dist)))
        self.url = f"http://127.0.0.1:{self.server_port}/"
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    def record(self, entry: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(entry)

    def add_fault(self, path: str, **fault: Any) -> None:
        """Apply `fault` to the next request for `path` (once per call)."""
        with self._lock:
            self.faults.setdefault(path, []).append(fault)

    def take_fault(self, path: str) -> dict[str, Any] | None:
        with self._lock:
            queue = self.faults.get(path)
            return queue.pop(0) if queue else None

    def requests_for(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self.requests if r["path"] == path]

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
