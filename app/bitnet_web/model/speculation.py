"""Speculative decoding's rules on the host: prompt-lookup drafts and how a verified draft is accepted.

A draft needs no second model: the tokens that followed the most recent earlier occurrence of the
text's last n-gram (n = NGRAM_MAX down to 1) are proposed as the next tokens. One forward pass over
[last token, draft...] (k + 1 rows) then scores every drafted position at once. These functions are
the reference the GPU kernels are tested against and what the acceptance statistics are computed
with; they import only numpy and the standard library. `SpeculationPolicy` decides, from the text,
when verify steps pay and when plain decode steps are faster.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

NGRAM_MAX = 3  # longest n-gram matched; shorter ones are tried when it has no earlier occurrence


def draft_length(matched: int, k: int, ngram_max: int = NGRAM_MAX) -> int:
    """Tokens drafted after a match of the text's last `matched` tokens: as many as matched while the
    match is shorter than ngram_max (one shared token says little of what follows), all k after a full
    ngram_max match. A verify step pays for the rows its draft fills, so a weak match costs little
    (9 bundled-model replies replayed on the host at the 2B-4T's step costs: 1.86x plain speed expected
    over 128 tokens at k = 6 against 1.59x with every draft 2 long; docs/performance.md, "Session 15")."""
    return k if matched >= ngram_max else min(matched, k)


def prompt_lookup_draft(history: Sequence[int], k: int, ngram_max: int = NGRAM_MAX) -> list[int]:
    """Up to `k` drafted tokens after `history` (the prompt and every token generated so far).

    For n = ngram_max .. 1: find the largest i < len(history) - n with history[i:i+n] equal to the
    last n tokens; the first n with a match decides; no match gives an empty draft. The draft,
    draft_length(n, k) tokens, copies what followed the match, history[i+n:], as an overlapping
    copy: where it reaches the history's end it goes on with its own tokens, so text that repeats
    with a period P = len(history) - (i + n) is drafted k tokens ahead, not only P: token j is
    history[i + n + j % P].
    """
    h = list(history)
    length = len(h)
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), 0, -1):
        tail = h[length - n :]
        for i in range(length - n - 1, -1, -1):
            if h[i : i + n] == tail:
                return periodic_copy(h, i + n, draft_length(n, k, ngram_max))
    return []


def periodic_copy(history: list[int], start: int, k: int) -> list[int]:
    """history[start:] continued by itself to k tokens (start < len(history))."""
    period = len(history) - start
    return [history[start + j % period] for j in range(k)]


def accept_greedy(draft: Sequence[int], chosen: Sequence[int]) -> tuple[int, list[int]]:
    """`chosen[j]`: the greedy token after row j of the verify pass (row 0 is the last accepted token,
    row j > 0 is draft[j-1]). Returns (accepted, tokens): how many drafted tokens equal what greedy
    decoding would have produced, and the tokens to emit: those plus the next greedy token, so every
    verify step emits at least one token and the text is exactly plain greedy decoding's."""
    accepted = 0
    while accepted < len(draft) and int(draft[accepted]) == int(chosen[accepted]):
        accepted += 1
    return accepted, [int(t) for t in draft[:accepted]] + [int(chosen[accepted])]


def accept_sampled(draft_token: int, p: np.ndarray, u_accept: float, u_draw: float) -> tuple[bool, int]:
    """One position of speculative sampling with a deterministic draft (a point mass on draft_token):
    accept it with probability p[draft_token]; otherwise draw from p with draft_token removed and
    renormalized. `p` is the target distribution (after every sampler setting), u_* uniform in [0, 1).
    The token emitted is then distributed exactly as p."""
    p = np.asarray(p, dtype=np.float64)
    if u_accept < p[draft_token]:
        return True, int(draft_token)
    residual = p.copy()
    residual[draft_token] = 0.0
    total = residual.sum()
    if total <= 0.0:  # p is a point mass on the draft: acceptance was certain
        return True, int(draft_token)
    cdf = np.cumsum(residual / total)
    return False, int(min(np.searchsorted(cdf, u_draw, side="right"), len(p) - 1))


class DraftIndex:
    """prompt_lookup_draft over a history that grows a token at a time, in O(ngram_max) per token: the
    start of the most recent occurrence of every n-gram (n <= ngram_max) that ends before the last
    token, which is the occurrence prompt_lookup_draft finds scanning backwards."""

    def __init__(self, history: Sequence[int] = (), ngram_max: int = NGRAM_MAX):
        self.ngram_max = ngram_max
        self.tokens = [int(t) for t in history]
        self.starts: dict[tuple[int, ...], int] = {}  # n-gram -> start of its latest occurrence (see above)
        before_last = self.tokens[:-1]
        for n in range(1, ngram_max + 1):  # in bulk (a long prompt): later starts overwrite earlier ones
            grams = zip(*(before_last[j:] for j in range(n)), strict=False)  # the shortest slice ends them
            self.starts.update(zip(grams, range(len(before_last)), strict=False))

    def append(self, token: int) -> None:
        tokens, end = self.tokens, len(self.tokens) - 1
        for n in range(1, min(self.ngram_max, end + 1) + 1):  # the old last token is no longer last
            self.starts[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        tokens.append(int(token))

    def draft(self, k: int) -> list[int]:
        """prompt_lookup_draft(history, k, ngram_max)."""
        tokens, length = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.ngram_max, length - 1), 0, -1):
            start = self.starts.get(tuple(tokens[length - n :]))
            if start is not None:
                return periodic_copy(tokens, start + n, draft_length(n, k, self.ngram_max))
        return []


class SpeculationPolicy:
    """Whether the next steps of a speculative reply should verify drafts of `k` tokens or decode one
    token each: verify steps cost more than a decode step and pay only where the text repeats.

    Decided from the reply's steps, never from timing, so a seeded sampled reply repeats: the decode
    loop pushes every token of the reply in order and reports each real verify step's tokens
    (`verify_step`); those steps are counted as they are. Over the tokens of plain (draft-off) steps
    the policy follows the verify steps that greedy speculative decoding would run over the text
    (DraftIndex drafts as the GPU does), counting the tokens each would emit: a step emits its drafted
    tokens up to the first one the text disagrees with, plus one. So it knows what verifying would
    have gained and turns verify steps back on as soon as the text starts to repeat. (A sampled verify
    step keeps a drafted token only with probability p(x), so there the simulated count can be higher
    than what the real steps then give; the real steps turn verifying off again.)

    A verify step costs what the rows its draft fills cost (draft_length: a weak match drafts few
    tokens, and the rows past the draft exit at once): `step_costs[d]` decode steps for a draft of d
    tokens, `verify_cost` = step_costs[k]. Over the last `window` counted steps, `rate` = tokens per
    step and `cost` = their mean price. Verify steps stop when the rate falls below the cost, and
    resume when it reaches cost + `resume_margin`. The decode loop's next submit follows it (the steps already queued
    keep their kind: how many tokens the switch lags depends on the batching, a setting, not on timing).
    """

    # A verify step over k + 1 rows costs about 1 + VERIFY_ROW_COST * k decode steps on a model of width
    # VERIFY_ROW_COST_DIM (2B-4T shape, H100, natively: 1.11-1.19 at k = 1, 1.23-1.31 at 2, 1.77-1.87 at 4;
    # docs/performance.md, "Session 11"). A row's extra work grows with the model's width while a step's
    # dispatch latency does not, so the cost per row scales with dim / VERIFY_ROW_COST_DIM: the bundled
    # model (dim 512) measured 1.0-1.1 at k = 1..4. At longer contexts every row also walks the KV cache
    # (for_backend's attention_share): 2B-4T at k = 2 measured 1.36 at context 64, 1.49 / 1.69 / 1.76 at
    # 1k / 2k / 4k ("Session 12"), where the estimate gives 1.40, 1.50, 1.59, 1.73.
    VERIFY_ROW_COST = 0.2
    VERIFY_ROW_COST_DIM = 2560
    # What a verify step costs on top of that where the backend pays more per step: Chromium on the H100,
    # k = 2, the bundled model 1.14-1.24 decode steps against ~1.0 natively (session 11); the 2B-4T shape
    # 1.49-1.54 against 1.42 (session 8, before verify steps took one pass).
    BACKEND_VERIFY_COST = {"browser": 0.1}
    # A verify step dispatches k + 1 rows whatever its draft; the rows past the draft exit at once but
    # still cost their workgroups' launch: 2B-4T shape, H200, 9 rows at a draft of d against d + 1 rows:
    # +0.31 ms at d = 0 (8 such rows), +0.17 at d = 4, +0.03 at d = 7, of a 1.33 ms decode step
    # (`tools/bench_kernels.py --verify-steps --padded 8`, docs/performance.md "Session 15").
    PADDED_ROW_COST = 0.03
    # Steps the rate is taken over: enough that one lucky step does not decide (at k = 2, 8 steps
    # reach 1.4 tokens per step only with 4 drafted tokens accepted), few enough that a reply that
    # stops repeating costs at most ~8 verify steps (~2.3 decode steps at k = 2 and 1.29x per step).
    WINDOW = 8
    # A gap between the thresholds, so a rate near the break-even point does not switch every few
    # tokens (a switch costs no readback, but the queued steps lag it by up to two submits).
    RESUME_MARGIN = 0.25

    def __init__(
        self,
        k: int,
        window: int = WINDOW,
        verify_cost: float | None = None,
        resume_margin: float = RESUME_MARGIN,
        ngram_max: int = NGRAM_MAX,
        step_costs: Sequence[float] | None = None,
    ):
        """`step_costs`: decode steps per verify step with a draft of 0..k tokens; else from
        `verify_cost` (the price of a full draft, default 1 + VERIFY_ROW_COST * k), linear in the draft
        from one decode step."""
        if k < 1 or window < 1:
            raise ValueError(f"speculation policy: k and window must be >= 1, got k={k}, window={window}")
        self.k, self.window, self.resume_margin, self.ngram_max = k, window, resume_margin, ngram_max
        if step_costs is None:
            full = 1.0 + self.VERIFY_ROW_COST * k if verify_cost is None else verify_cost
            step_costs = [1.0 + (full - 1.0) * d / k for d in range(k + 1)]
        if len(step_costs) != k + 1:
            raise ValueError(f"speculation policy: {len(step_costs)} step costs for drafts of 0..{k} tokens")
        self.step_costs = [float(c) for c in step_costs]
        self.verify_cost = self.step_costs[k]
        self.start([])

    @classmethod
    def for_backend(
        cls,
        k: int,
        backend: str,
        dim: int = VERIFY_ROW_COST_DIM,
        queued_steps: int = 0,
        attention_share: float = 0.0,
    ) -> SpeculationPolicy:
        """The policy for drafts of `k` tokens on a GPU backend (gpu.Device.backend) and a model of width
        `dim`: its verify-step cost estimated for both. `queued_steps`: how many steps the decode loop
        queues ahead (steps per submit x submits in flight), which is how late a switch takes effect; the
        rate is then taken over at least that many steps, so a burst shorter than the lag does not
        switch a whole submit of steps to the wrong kind. `attention_share`: what attention over the
        cached context adds to a decode step, as a fraction of a short-context step
        (BitNetModel.attention_share); a verify step pays it once per row."""
        extra = cls.BACKEND_VERIFY_COST.get(backend, 0.0)
        row = cls.VERIFY_ROW_COST * dim / cls.VERIFY_ROW_COST_DIM
        # A narrower model's steps are bound by dispatch latency, not by bytes: its rows' walks over the
        # KV cache and the launches of rows past the draft cost it proportionally less (the bundled model,
        # 512 wide: verify steps of k = 1..8 measured 1.05-1.14 decode steps natively after a 100-token
        # context, where bytes alone gave 1.17-1.71; docs/performance.md "Session 23").
        narrow = min(1.0, dim / cls.VERIFY_ROW_COST_DIM)
        a = max(0.0, attention_share) * narrow
        padded = cls.PADDED_ROW_COST * narrow
        # a draft of d tokens: 1 + d rows, each with its own walk over the cached context, and k - d
        # rows that exit at once
        costs = [(1.0 + extra + row * d + padded * (k - d) + (d + 1) * a) / (1.0 + a) for d in range(k + 1)]
        return cls(k, window=max(cls.WINDOW, queued_steps), step_costs=costs)

    def start(self, history: Sequence[int]) -> None:
        """A new reply: `history` is the text so far, ending with the first verify step's input token."""
        self.index = DraftIndex(history, self.ngram_max)
        self.draft = self.index.draft(self.k)  # the counted step's drafted tokens
        self.matched = 0  # of them, those the text agreed with so far
        self.emitted: deque[int] = deque(maxlen=self.window)  # tokens of the last counted steps
        self.costs: deque[float] = deque(maxlen=self.window)  # and their prices (step_costs)
        self.speculating = True  # optimistic until a window of steps says otherwise
        self.pushed = 0  # tokens of the reply pushed
        self.switches: list[tuple[int, bool]] = []  # (tokens pushed, speculating) at each change

    @property
    def rate(self) -> float:
        """Tokens per counted verify step over the window (0 until one step is counted)."""
        return sum(self.emitted) / len(self.emitted) if self.emitted else 0.0

    def push(self, token: int, verified: bool = False) -> None:
        """The next token of the reply. `verified`: a real verify step emitted it, and that step is
        counted by `verify_step` instead of the text's simulated step ending at this token."""
        self.pushed += 1
        self.index.append(token)
        if self.matched < len(self.draft) and token == self.draft[self.matched]:
            self.matched += 1  # an accepted drafted token: the counted step goes on
            return
        tokens, drafted = self.matched + 1, len(self.draft)  # the step's own token ends it
        self.draft, self.matched = self.index.draft(self.k), 0
        if not verified:
            self._count(tokens, drafted)

    def verify_step(self, n_emitted: int, draft_len: int | None = None) -> None:
        """A real verify step drafted `draft_len` tokens (default k) and emitted `n_emitted` (pushed
        next, with verified=True): what a verify step yields, counted as it is (for sampled replies,
        fewer than the text agrees with)."""
        self._count(n_emitted, self.k if draft_len is None else min(draft_len, self.k))

    @property
    def cost(self) -> float:
        """Mean price of the counted steps over the window, in decode steps (0 until one is counted)."""
        return sum(self.costs) / len(self.costs) if self.costs else 0.0

    def _count(self, tokens: int, drafted: int) -> None:
        self.emitted.append(tokens)
        self.costs.append(self.step_costs[drafted])
        if len(self.emitted) < self.window:
            return
        rate, cost = self.rate, self.cost
        if self.speculating and rate < cost:
            self.speculating = False
        elif not self.speculating and rate >= cost + self.resume_margin:
            self.speculating = True
        else:
            return
        self.switches.append((self.pushed, self.speculating))
