"""bench.speculation_policy_bench's report when a reply ends at once (its first token is the end of
text): the rates are 0 and the speed-ups unknown (None), not a ZeroDivisionError that ended a whole
`bench` run on the GPU machine (device call 28, the bundled model with a random prompt)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from bitnet_web.bench import speculation_policy_bench


class EndsAtOnce:
    """An engine whose every reply is empty: it ends with the end-of-text token it drew first."""

    def __init__(self) -> None:
        self.speculation_policy = object()
        self.model = SimpleNamespace(truncate=lambda n: None)
        self.generated_tokens: list[int] = []
        self.last_stats = None

    async def generate_tokens_async(self, ids, settings, max_tokens, speculate=0):
        self.last_stats = SimpleNamespace(
            decode_tok_per_s=0.0, speculate=speculate, n_generated=0, verify_steps=0, plain_steps=0,
            draft_proposed=0, draft_accepted=0,
        )  # fmt: skip
        for token in ():
            yield token


def test_a_reply_that_ends_at_once_has_no_speedup() -> None:
    engine = EndsAtOnce()
    policy = engine.speculation_policy
    report = asyncio.run(speculation_policy_bench(engine, [1, 2, 3], n_tokens=8, runs=2))
    for workload in ("sampled_t1", "greedy", "sampled_top1"):
        rows = report[workload]
        assert {mode: rows[mode]["speedup"] for mode in ("plain", "every_step", "policy")} == dict.fromkeys(
            ("plain", "every_step", "policy")
        )
        assert all(rows[mode]["tok_per_s"] == 0.0 and rows[mode]["tokens"] == 0 for mode in rows)
    assert engine.speculation_policy is policy  # restored
