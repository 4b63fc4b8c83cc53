"""Sample the CPU time of every Chromium process and thread (from /proc) until killed, as JSON lines.

    python3 tools/device/proc_sample.py OUT.jsonl [--every 0.2]

Each line: {"t": epoch seconds, "p": {pid: [type, ticks, {tid: [thread name, ticks]}]}} with type the
process's --type= (gpu-process, renderer, utility, ...; "browser" for the main process) and ticks
utime + stime in clock ticks. tools/device/cpu_by_phase.py turns it into CPU time per page phase.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def _ticks(stat: str) -> tuple[str, int]:
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return name, int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def sample() -> dict:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a for a in f.read().split(b"\0") if a]
            if len(argv) == 1:  # Chromium's children rewrite their command line as one string
                argv = argv[0].split(b" ")
            if not argv or b"chrom" not in os.path.basename(argv[0]):
                continue
            kind = next((a[7:].decode() for a in argv if a.startswith(b"--type=")), "browser")
            with open(f"/proc/{pid}/stat") as f:
                _, ticks = _ticks(f.read())
            threads = {}
            for tid in os.listdir(f"/proc/{pid}/task"):
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        threads[tid] = list(_ticks(f.read()))
                except OSError:
                    pass
            out[pid] = [kind, ticks, threads]
        except (OSError, ValueError, IndexError):
            continue
    return out


def main() -> int:
    path = sys.argv[1]
    every = float(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[2] == "--every" else 0.2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(path, "w") as f:
        while True:
            s = sample()
            if s:
                f.write(json.dumps({"t": time.time(), "p": s}) + "\n")
                f.flush()
            time.sleep(every)


if __name__ == "__main__":
    sys.exit(main())
