"""The speculation policy's rows of `bench` alone (bench.speculation_policy_bench), natively, on one
model: a random prompt decoded with plain steps, drafts of the default size at every step, the
default policy and draft-off steps only (greedy, sampled at temperature 1, greedy tokens through the
sampled path); and the verify-step costs of k = 1, 2, 4 (bench.verify_step_costs). With `--workloads
K,K..`: bench.speculation_workloads instead (the code and summary prompts, meant for the bundled model).

    python tools/device/policy_bench.py MODEL.gguf [--runs 3] [--tokens 128] [--workloads 2,4,7]

Prints one JSON object (the rows, without per-run lists).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "app"))

from bitnet_web.bench import speculation_policy_bench, speculation_workloads, verify_step_costs  # noqa: E402
from bitnet_web.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--workloads", default="", help="draft sizes of the workload rows (comma-separated)")
    args = parser.parse_args()
    engine = Engine()
    engine.load(args.model)
    try:
        if args.workloads:
            ks = tuple(int(k) for k in args.workloads.split(","))
            print(json.dumps(asyncio.run(speculation_workloads(engine, ks, args.tokens, args.runs))))
            return
        ids = np.random.default_rng(0).integers(0, engine.model.config.vocab_size, size=16).tolist()
        report = asyncio.run(speculation_policy_bench(engine, ids, args.tokens, args.runs))
        report["speculation_costs"] = asyncio.run(verify_step_costs(engine.model, (1, 2, 4), 32, ids))
    finally:
        engine.close()
    for rows in report.values():
        for row in rows.values() if isinstance(rows, dict) else ():
            if isinstance(row, dict):
                row.pop("tok_per_s_runs", None)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
