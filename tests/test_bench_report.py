"""bench.speculation_policy_bench's report when a reply ends at once (its first token is the end of
text): the rates are 0 and the speed-ups unknown (None), not a ZeroDivisionError that ended a whole
`bench` run on the GPU machine (device call 28, the bundled model with a random prompt)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

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


def test_expected_speedup_prices_each_step_by_its_draft() -> None:
    """A workload's expected 2B-4T speed-up divides its tokens per verify step by the mean step's price:
    a step with a draft of d tokens costs a step of d + 1 rows (1 at d = 0) plus the padded rows' cost
    for k - d rows; without per-length counts every step is priced as a full draft."""
    from bitnet_web.bench import speculation_summary
    from bitnet_web.model.speculation import SpeculationPolicy

    costs = {"verify_cost_relative": {"1": 1.2, "2": 1.4, "4": 2.0}}
    row = {"tokens_per_verify_step": 3.0, "draft_length_counts": [1, 0, 2, 0, 1]}  # d = 0, 2, 2, 4
    old = {"tokens_per_verify_step": 2.0}
    got = speculation_summary(costs, {"code": {"by_speculate": {"0": {}, "4": row, "2": old}}})
    pad = SpeculationPolicy.PADDED_ROW_COST
    mean = (1.0 + 4 * pad + 2 * (1.4 + 2 * pad) + 2.0) / 4
    assert got["code"]["4"] == pytest.approx(3.0 / mean)
    assert got["code"]["2"] == pytest.approx(2.0 / 1.4) and "0" not in got["code"]
    # a quick bench measures a few sizes only (k = 1, 4): the others are interpolated
    quick = {"verify_cost_relative": {"1": 1.2, "4": 2.1}}
    got = speculation_summary(quick, {"code": {"by_speculate": {"4": row}}})
    mean = (1.0 + 4 * pad + 2 * (1.5 + 2 * pad) + 2.1) / 4
    assert got["code"]["4"] == pytest.approx(3.0 / mean)
