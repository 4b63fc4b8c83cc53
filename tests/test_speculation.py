"""Speculative decoding's host rules (model/speculation.py) against brute force and their defining properties."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web.model.speculation import (
    DraftIndex,
    SpeculationPolicy,
    accept_greedy,
    accept_sampled,
    draft_length,
    prompt_lookup_draft,
)


def brute_force_draft(history: list[int], k: int, ngram_max: int) -> list[int]:
    """Every (n, i) pair scored: longest n first, then the latest start; n tokens drafted after a
    match shorter than ngram_max, k after a full one."""
    best = None
    for n in range(1, ngram_max + 1):
        for i in range(len(history) - n):
            if history[i : i + n] == history[len(history) - n :] and (best is None or (n, i) > best):
                best = (n, i)
    if best is None:
        return []
    n, i = best
    drafted = list(history)  # an overlapping copy: past the history's end it copies what it drafted
    for j in range(k if n == ngram_max else min(n, k)):
        drafted.append(drafted[i + n + j])
    return drafted[len(history) :]


@pytest.mark.parametrize("seed", range(20))
def test_draft_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    history = rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist()
    for k in (1, 3, 8):
        assert prompt_lookup_draft(history, k) == brute_force_draft(history, k, 3)


def test_draft_copies_what_followed_the_latest_match() -> None:
    history = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert prompt_lookup_draft(history, 2) == [7, 8]  # the later "1 2 3" wins over the first
    assert prompt_lookup_draft([1, 2, 3], 4) == []  # no earlier occurrence of any suffix
    # past the history's end the copy goes on with its own tokens: a repeating text is drafted k ahead
    assert prompt_lookup_draft([4, 4, 4, 4], 3) == [4, 4, 4]
    assert prompt_lookup_draft([6, 1, 2, 6, 1, 2], 5) == [6, 1, 2, 6, 1]  # "6 1 2" at 0, period 3
    assert prompt_lookup_draft([1, 2, 3, 7, 1, 2, 3], 6) == [7, 1, 2, 3, 7, 1]  # period 4
    assert prompt_lookup_draft(history, 0) == []
    # a shorter match is weaker evidence: as many tokens drafted as it matched
    assert prompt_lookup_draft([4, 4], 3) == [4]  # a 1-gram
    assert prompt_lookup_draft([6, 1, 2, 1, 2], 5) == [1, 2]  # a 2-gram (no earlier "2 1 2")
    assert prompt_lookup_draft([9, 5, 8, 5], 4) == [8]
    assert [draft_length(n, 8) for n in range(4)] == [0, 1, 2, 8]
    assert [draft_length(n, 1) for n in range(4)] == [0, 1, 1, 1]


@pytest.mark.parametrize("seed", range(10))
def test_greedy_acceptance_reproduces_plain_greedy(seed: int) -> None:
    """Drive the rules with a deterministic 'model' (next token = a fixed function of the last
    three): speculative decoding must emit exactly the plain greedy sequence."""
    rng = np.random.default_rng(seed)
    table = rng.integers(0, 6, size=(6, 6, 6))

    def next_token(h: list[int]) -> int:
        return int(table[h[-3], h[-2], h[-1]])

    prompt = rng.integers(0, 6, size=8).tolist()
    plain = list(prompt)
    while len(plain) < 80:
        plain.append(next_token(plain))
    spec, accepted_total = list(prompt), 0
    while len(spec) < 80:
        draft = prompt_lookup_draft(spec, 4)
        rows = [spec + draft[:j] for j in range(len(draft) + 1)]
        accepted, tokens = accept_greedy(draft, [next_token(r) for r in rows])
        accepted_total += accepted
        spec.extend(tokens)
    assert spec[:80] == plain
    assert accepted_total > 0  # a period-<=216 sequence repeats: drafts must get accepted


def test_sampled_acceptance_keeps_the_distribution() -> None:
    """Accept-or-resample with a point-mass draft must give tokens distributed exactly as p."""
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    n = 60_000
    counts = np.zeros(6)
    accepted = 0
    for _ in range(n):
        ok, token = accept_sampled(2, p, rng.random(), rng.random())
        counts[token] += 1
        accepted += ok
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    assert abs(accepted / n - p[2]) < 4 * np.sqrt(p[2] * (1 - p[2]) / n)


@pytest.mark.parametrize("seed", range(6))
def test_draft_index_is_prompt_lookup_draft(seed: int) -> None:
    """The incremental index drafts what prompt_lookup_draft drafts, after every appended token."""
    rng = np.random.default_rng(seed)
    alphabet = [2, 3, 6, 40, 400, 5][seed]
    history = rng.integers(0, alphabet, size=int(rng.integers(1, 60))).tolist()  # indexed in bulk
    index = DraftIndex(history)
    for _ in range(120):
        for k in (1, 2, 5):
            assert index.draft(k) == prompt_lookup_draft(history, k), (history, k)
        token = int(rng.integers(0, alphabet))
        history.append(token)
        index.append(token)


def greedy_verify_steps(history: list[int], reply: list[int], k: int, drafted: list[int] | None = None) -> list[int]:
    """Tokens emitted by each verify step of greedy speculative decoding whose reply is `reply` (its
    first token already fed), with prompt_lookup_draft: the steps the policy counts. `drafted` gets
    each step's draft length."""
    text, i, emitted = list(history), 0, []
    while i < len(reply):
        draft = prompt_lookup_draft(text, k)
        n = 0
        while n < len(draft) and i + n < len(reply) and draft[n] == reply[i + n]:
            n += 1
        if i + n >= len(reply):
            break  # the step is not over when the reply ends
        text += reply[i : i + n + 1]
        emitted.append(n + 1)
        if drafted is not None:
            drafted.append(len(draft))
        i += n + 1
    return emitted


@pytest.mark.parametrize("k", [1, 2, 4])
def test_policy_counts_the_greedy_verify_steps(k: int) -> None:
    """With a window as long as the reply, the policy's rate is the mean tokens per verify step of a
    host simulation of greedy speculative decoding over the same text."""
    rng = np.random.default_rng(k)
    prompt = rng.integers(0, 5, size=12).tolist()
    reply = rng.integers(0, 5, size=200).tolist()
    policy = SpeculationPolicy(k, window=10**6)
    policy.start(prompt)
    for token in reply:
        policy.push(token)
    drafted: list[int] = []
    steps = greedy_verify_steps(prompt, reply, k, drafted)
    assert list(policy.emitted) == steps and policy.rate == pytest.approx(np.mean(steps))
    assert list(policy.costs) == [policy.step_costs[d] for d in drafted]  # each step priced by its draft
    assert policy.cost < policy.verify_cost or k == 1  # weak matches drafted fewer than k tokens
    assert max(steps) > 1 and policy.speculating  # drafts were accepted; no window was full to switch


def test_policy_switches_off_on_new_text_and_back_on_when_it_repeats() -> None:
    """A reply that does not repeat (random tokens of 8 kinds: drafts after short matches, rarely
    right) turns verify steps off within a few windows of steps; a reply that then repeats a stretch of
    its prompt turns them back on, within about a window."""
    rng = np.random.default_rng(0)
    prompt = rng.permutation(1000)[:200].tolist()
    fresh = (1000 + rng.integers(0, 8, size=300)).tolist()
    policy = SpeculationPolicy(2)
    policy.start(prompt)
    for i, token in enumerate(fresh):
        policy.push(token)
        if i >= 3 * policy.window:
            assert not policy.speculating, i
    assert policy.switches == [(policy.switches[0][0], False)] and policy.rate < policy.cost
    for token in prompt[:150]:  # copies the prompt: drafts of 2 accepted each step
        policy.push(token)
    assert policy.speculating and policy.rate == pytest.approx(3.0)
    on_at = policy.switches[-1][0] - len(fresh)
    assert policy.switches[-1][1] and on_at <= 3 * (policy.window + 1)


@pytest.mark.parametrize("margin", [0.0, 0.25])
def test_policy_switches_at_its_thresholds(margin: float) -> None:
    """Text near the break-even point (random tokens of 3 kinds: ~1.4 tokens per step at k = 2): off
    only below the window's cost, on only at that cost + resume_margin; a margin means fewer switches."""
    rng = np.random.default_rng(1)
    policy = SpeculationPolicy(2, window=4, verify_cost=1.4, resume_margin=margin)
    policy.start([0, 1, 2])
    changes = []
    for token in rng.integers(0, 3, size=600).tolist():
        before = policy.speculating
        policy.push(token)
        if policy.speculating != before:
            changes.append((policy.speculating, policy.rate, policy.cost))
    assert sum(on for on, _, _ in changes) >= 2 and len(changes) == len(policy.switches)
    for on, rate, cost in changes:
        assert 1.0 < cost <= 1.4 and (rate >= cost + margin if on else rate < cost)
    if margin:
        no_margin = SpeculationPolicy(2, window=4, verify_cost=1.4, resume_margin=0.0)
        no_margin.start([0, 1, 2])
        for token in np.random.default_rng(1).integers(0, 3, size=600).tolist():
            no_margin.push(token)
        assert len(policy.switches) < len(no_margin.switches)


@pytest.mark.parametrize(
    ("k", "cheap", "dear"),
    [
        (1, ("wgpu-native", 2560), ("browser", 2560)),
        (2, ("wgpu-native", 512), ("wgpu-native", 2560)),
        (1, ("wgpu-native", 2560), ("wgpu-native", 2560, 0, 0.3)),  # 2B-4T at a short context and at ~4k
    ],
)
def test_policy_asks_more_tokens_per_step_where_verify_steps_cost_more(k, cheap, dear) -> None:
    """A verify step costs a little more decode steps in Chromium than natively, a verify row of a
    narrow model less than of a wide one (a narrow model's step is dispatch latency), and more at a long
    context (each row walks the KV cache): text that repeats just enough to pay on the cheaper setup
    (three copied tokens, then three drawn from 6 new ones: drafts after short matches, mostly wrong)
    keeps verify steps on there and turns them off on the dearer one."""
    cheap, dear = SpeculationPolicy.for_backend(k, *cheap), SpeculationPolicy.for_backend(k, *dear)
    assert (
        SpeculationPolicy.for_backend(k, "wgpu-native").verify_cost
        == SpeculationPolicy.for_backend(k, "wgpu-native", 2560).verify_cost
    )  # the default width is 2B-4T's
    rng = np.random.default_rng(0)
    prompt = list(range(200))
    reply = []
    for i in range(0, 180, 6):
        reply += prompt[i : i + 3] + (1000 + rng.integers(0, 6, size=3)).tolist()
    drafted: list[int] = []
    rate = float(np.mean(greedy_verify_steps(prompt, reply, k, drafted)))
    costs = [float(np.mean([policy.step_costs[d] for d in drafted])) for policy in (cheap, dear)]
    assert costs[0] <= rate < costs[1]
    for policy in (cheap, dear):
        policy.start(prompt)
        for token in reply:
            policy.push(token)
    assert cheap.speculating and not dear.speculating


@pytest.mark.parametrize("k", [1, 2, 4])
def test_policy_charges_verify_rows_for_attention_over_a_long_context(k) -> None:
    """Each row of a verify step walks the KV cache as its decode step does: with attention adding a
    share a of a short-context step, a verify step costs (short + (k + 1) a) / (1 + a) decode steps,
    rising with the context towards k + 1 (every row a whole step)."""
    short = SpeculationPolicy.for_backend(k, "wgpu-native", 2560)
    assert SpeculationPolicy.for_backend(k, "wgpu-native", 2560, attention_share=0.0).verify_cost == short.verify_cost
    costs = [
        SpeculationPolicy.for_backend(k, "wgpu-native", 2560, attention_share=a).verify_cost for a in (0.1, 0.3, 3)
    ]
    assert short.verify_cost < costs[0] < costs[1] < costs[2] < k + 1
    assert costs[1] == pytest.approx((short.verify_cost + (k + 1) * 0.3) / 1.3)


@pytest.mark.parametrize("k", [2, 6])
def test_a_narrow_models_verify_rows_pay_less_for_the_context_and_the_rows_past_the_draft(k) -> None:
    """A narrow model's steps are dispatch latency, not bytes: its rows' KV walks and the launches of
    rows past the draft are charged in proportion to its width (the bundled 512-wide model measured
    1.05-1.14 decode steps a verify step where the bytes alone said 1.17-1.71). 2B-4T's width keeps the
    full charges."""
    a = 0.3

    def cost(dim: int, share: float, d: int) -> float:
        return SpeculationPolicy.for_backend(k, "wgpu-native", dim, attention_share=share).step_costs[d]

    wide_extra = cost(2560, a, k) - cost(2560, 0.0, k)
    narrow_extra = cost(512, a, k) - cost(512, 0.0, k)
    assert 0 < narrow_extra < wide_extra / 3
    assert cost(512, 0.0, 0) == pytest.approx(1 + SpeculationPolicy.PADDED_ROW_COST * k * 512 / 2560)
    assert cost(2560, 0.0, 0) == pytest.approx(1 + SpeculationPolicy.PADDED_ROW_COST * k)
    assert cost(4096, a, k) == pytest.approx(
        (1 + SpeculationPolicy.VERIFY_ROW_COST * k * 4096 / 2560 + (k + 1) * a) / (1 + a)
    )  # wider than 2B-4T: the bytes' full charge, no more


def test_policy_takes_its_rate_over_the_steps_the_decode_loop_queues() -> None:
    """With 16 x 2 steps queued (the page), a switch lags by up to 32 steps, so the rate is taken over
    32: a fresh stretch of 12 tokens inside a reply that copies its prompt turns verify steps off under
    an 8-step window and not under the queue's."""
    short = SpeculationPolicy.for_backend(2, "browser", 2560)
    queued = SpeculationPolicy.for_backend(2, "browser", 2560, queued_steps=32)
    assert (short.window, queued.window) == (SpeculationPolicy.WINDOW, 32)
    assert SpeculationPolicy.for_backend(2, "browser", 2560, queued_steps=2).window == SpeculationPolicy.WINDOW
    prompt = list(range(300))
    reply = prompt[:150] + list(range(1000, 1012)) + prompt[150:290]
    for policy in (short, queued):
        policy.start(prompt)
        for token in reply:
            policy.push(token)
    assert [on for _, on in short.switches][:1] == [False] and queued.switches == []


def test_policy_counts_real_verify_steps_as_they_are() -> None:
    """A sampled verify step may keep fewer drafted tokens than the text agrees with: over tokens of
    real verify steps the policy counts what those steps emitted (verify_step), not the simulation,
    so a reply that copies its prompt turns verify steps off when the real steps emit one token each,
    and keeps them on when the same tokens come from draft-off steps (the simulation: 3 per step)."""
    prompt = list(range(100))
    reply = prompt[:60]
    assert float(np.mean(greedy_verify_steps(prompt, reply, 2))) > 2.5
    simulated, real = SpeculationPolicy(2, window=4), SpeculationPolicy(2, window=4)
    for policy in (simulated, real):
        policy.start(prompt)
    for token in reply:
        simulated.push(token)
        real.verify_step(1)  # each real step emitted one token: its draft was rejected
        real.push(token, verified=True)
    assert simulated.speculating and simulated.switches == []
    assert not real.speculating and real.switches == [(3, False)]


def test_policy_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="k and window must be >= 1"):
        SpeculationPolicy(0)
    with pytest.raises(ValueError, match="k and window must be >= 1"):
        SpeculationPolicy(2, window=0)


def test_policy_prices_a_verify_step_by_its_draft() -> None:
    """A verify step pays for the rows its draft fills, and a little for the rows past it (they exit
    at once): for_backend's price rises by a row's cost per drafted token from one decode step (plus
    the backend's extra), and a real verify step is charged for the draft it had."""
    native, browser = SpeculationPolicy.for_backend(4, "wgpu-native"), SpeculationPolicy.for_backend(4, "browser")
    row, padded = SpeculationPolicy.VERIFY_ROW_COST, SpeculationPolicy.PADDED_ROW_COST
    assert native.step_costs == pytest.approx([1.0 + row * d + padded * (4 - d) for d in range(5)])
    assert browser.step_costs == pytest.approx([1.1 + row * d + padded * (4 - d) for d in range(5)])
    assert native.verify_cost == pytest.approx(1.0 + row * 4)
    assert SpeculationPolicy(4, verify_cost=2.0).step_costs == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0])
    policy = SpeculationPolicy(4, window=2)
    policy.start([1, 2, 3])
    policy.verify_step(2, draft_len=1)
    policy.verify_step(1, draft_len=0)
    assert list(policy.costs) == [policy.step_costs[1], policy.step_costs[0]]
    assert policy.speculating  # 1.5 tokens per step against a mean price of 1.1
    policy.verify_step(1, draft_len=4)
    policy.verify_step(2, draft_len=4)
    assert not policy.speculating and policy.rate < policy.cost == policy.verify_cost
    with pytest.raises(ValueError, match="step costs"):
        SpeculationPolicy(2, step_costs=[1.0, 1.2])
