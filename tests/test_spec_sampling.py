"""Speculative sampling on the GPU (kernels/spec_sampling.py) against a numpy reference built from the
CPU sampler (text/sampler.py) and the host rule (model/speculation.py `accept_sampled`), with the
draw numbers the op documents: row r uses uniform(seed, c + 2r) and uniform(seed, c + 2r + 1).

Tokens must match exactly, except where float rounding can matter (f32 there, f64 here): a draw or a
top-p / min-p cut within 1e-5 of a boundary; the reference is then recomputed with the draws and the
cuts nudged both ways, and any of those answers is accepted (rarely needed: counted and bounded).
"""

from __future__ import annotations

import numpy as np
import pytest
from gpu_helpers import upload

from bitnet_web.kernels.spec_sampling import SpecSampleAccept
from bitnet_web.kernels.speculative import NO_BUDGET
from bitnet_web.model.speculation import accept_sampled
from bitnet_web.text.sampler import Sampler, SamplerSettings, distribution, uniform

pytestmark = pytest.mark.gpu


def target_p(row: np.ndarray, settings: SamplerSettings) -> np.ndarray:
    """p over the whole vocabulary for a penalized row: what Sampler.sample draws from."""
    p = np.zeros(row.shape[0])
    if settings.temperature == 0 or np.max(row) == np.inf:
        p[int(np.argmax(row))] = 1.0
        return p
    ids, probs = distribution(row, settings)
    p[ids] = probs
    return p


def reference_step(logits, draft, draft_len, settings, seed, counter, history, du=0.0) -> list[int]:
    """The tokens one verify step emits: accept_sampled row by row, then a plain draw."""
    penalizer = Sampler(settings)

    def u(n: int) -> float:
        return min(max(uniform(seed, n) + du, 0.0), 1 - 2**-24)

    emitted = []
    for j in range(draft_len + 1):
        row = penalizer._penalize(logits[j], list(history) + list(draft[:j]))
        p = target_p(row, settings)
        if j == draft_len:  # every drafted token kept: a draw from p in the sampler's order
            if settings.temperature == 0 or p.max() == 1.0:
                emitted.append(int(np.argmax(p)))
            else:
                ids, probs = distribution(row, settings)
                cum = np.cumsum(probs)
                index = int(np.searchsorted(cum, u(counter + 2 * j + 1) * cum[-1], side="right"))
                emitted.append(int(ids[min(index, len(ids) - 1)]))
            break
        kept, token = accept_sampled(int(draft[j]), p, u(counter + 2 * j), u(counter + 2 * j + 1))
        emitted.append(token)
        if not kept:
            break
    return emitted


def acceptable(logits, draft, draft_len, settings, seed, counter, history) -> list[list[int]]:
    """Reference answers: exact first, then with the draws or the cuts nudged by 1e-5."""
    answers = [reference_step(logits, draft, draft_len, settings, seed, counter, history)]
    for du in (-1e-5, 1e-5):
        answers.append(reference_step(logits, draft, draft_len, settings, seed, counter, history, du))
    if settings.temperature > 0:
        for dp in (-1e-5, 1e-5):
            nudged = SamplerSettings(
                **{
                    **settings.__dict__,
                    "top_p": min(max(settings.top_p + dp, 1e-6), 1.0),
                    "min_p": min(max(settings.min_p + dp, 0.0), 1.0),
                }
            )
            answers.append(reference_step(logits, draft, draft_len, nudged, seed, counter, history))
    return answers


class Harness:
    """The op with its input buffers, one verify step at a time."""

    def __init__(self, device, kernels, vocab: int, max_rows: int):
        self.device, self.vocab, self.max_rows = device, vocab, max_rows
        self.logits = device.buffer(4 * vocab * max_rows, label="verify logits")
        self.draft = device.buffer(4 * max_rows, label="draft")
        self.spec = device.buffer(16, label="spec state")
        self.out = upload(device, np.full(max_rows + 1, 0xDEAD, np.uint32), "out")
        self.op = SpecSampleAccept(kernels, self.logits, self.draft, self.spec, self.out, vocab, max_rows)

    def step(self, logits: np.ndarray, draft: list[int], draft_len: int, n_rows: int, ended: bool = False) -> list[int]:
        """`ended`: a step past the reply's end (its spec state's budget word is 0)."""
        self.device.upload(self.logits, 0, np.ascontiguousarray(logits, np.float32))
        self.device.upload(self.draft, 0, np.array(list(draft) + [0] * (self.max_rows - len(draft)), np.uint32))
        self.device.upload(self.spec, 0, np.array([draft_len, 0, 0, 0 if ended else NO_BUDGET], np.uint32))
        recorder = self.device.begin()
        self.op.record(recorder, n_rows)
        recorder.submit()
        out = self.device.read_sync(self.out, 0, 4 * (self.max_rows + 1)).view(np.uint32)
        return out[1 : 1 + int(out[0])].tolist()


SETTINGS = [
    SamplerSettings(temperature=0.8, top_k=40, top_p=0.95),
    SamplerSettings(temperature=1.0, top_k=64, top_p=1.0, repetition_penalty=1.3, repeat_last_n=16),
    SamplerSettings(temperature=1.5, top_k=7, top_p=0.5, min_p=0.05),
    SamplerSettings(temperature=0.6, top_k=20, min_p=0.1, repetition_penalty=0.8, repeat_last_n=5),
    SamplerSettings(temperature=0.0, repetition_penalty=2.0, repeat_last_n=64),  # greedy with a penalty
]


def random_step(rng, vocab: int, k: int, history: list[int]):
    """Logits for k + 1 rows where drafted tokens are often likely (so some are kept, some not), and
    tokens of the history and the draft are strong (so the penalty changes the outcome)."""
    draft_len = int(rng.integers(0, k + 1))
    logits = (rng.standard_normal((k + 1, vocab)) * rng.uniform(0.5, 3.0)).astype(np.float32)
    logits[:, list(set(history[-8:]))] += 3.0
    draft = rng.integers(0, vocab, k).tolist()
    for j in range(k):
        if rng.random() < 0.7:
            logits[j, draft[j]] += rng.uniform(2.0, 9.0)
    return logits, draft, draft_len


@pytest.mark.parametrize("vocab", [300, 20_000])
def test_steps_match_the_reference(device, kernels, vocab):
    """Several settings, draft lengths 0..k, 6 steps each: the GPU's counter and penalty ring carry
    from step to step, so each step's reference uses the tokens emitted before it."""
    k = 8 if vocab == 300 else 4
    harness = Harness(device, kernels, vocab, max_rows=k + 1)
    rng = np.random.default_rng(vocab)
    nudged = total = kept = 0
    lengths = set()
    for settings in SETTINGS if vocab == 300 else SETTINGS[:2]:
        seed = int(rng.integers(0, 2**63))
        history = rng.integers(0, vocab, 30).tolist()
        counter = int(rng.integers(0, 1000))
        harness.op.configure(settings, seed, counter, history)
        proposed = accepted = 0
        for _ in range(6):
            logits, draft, draft_len = random_step(rng, vocab, k, history)
            got = harness.step(logits, draft, draft_len, n_rows=k + 1)
            answers = acceptable(logits, draft, draft_len, settings, seed, counter, history)
            assert got in answers, (settings, draft_len, got, answers[0])
            nudged += got != answers[0]
            total += 1
            lengths.add(draft_len)
            proposed, accepted = proposed + draft_len, accepted + len(got) - 1
            kept += len(got) - 1
            history += got
            counter += 2 * len(got)
        ring = device.read_sync(harness.op.state, 0, harness.op.STATE_NBYTES).tobytes()
        logits, draft, draft_len = random_step(rng, vocab, k, history)
        assert harness.step(logits, draft, draft_len, n_rows=k + 1, ended=True) == []  # past the reply's end
        assert device.read_sync(harness.op.state, 0, harness.op.STATE_NBYTES).tobytes() == ring  # no draw taken
        state = device.read_sync(harness.op.state, 0, 8).view(np.uint32)
        assert state[0] == counter and state[1] == 0  # the GPU advanced its draw counter the same way
        assert harness.op.totals() == (proposed, accepted)
    assert nudged <= total // 10
    assert kept > 0 and len(lengths) > 2  # drafts were kept and lengths varied: the test says something


def test_fewer_rows_than_allocated(device, kernels):
    """A step recorded over n_rows < max_rows; draft_len past n_rows - 1 is clamped to it."""
    vocab, k = 500, 2
    harness = Harness(device, kernels, vocab, max_rows=9)
    rng = np.random.default_rng(5)
    settings = SamplerSettings(temperature=1.0, top_k=30, repetition_penalty=1.5, repeat_last_n=8)
    history = rng.integers(0, vocab, 12).tolist()
    harness.op.configure(settings, 99, 0, history)
    logits = np.zeros((9, vocab), np.float32)
    logits[: k + 1] = rng.standard_normal((k + 1, vocab))
    draft = [int(np.argmax(logits[j])) for j in range(k)] + [1] * 6
    logits[0, draft[0]] = logits[1, draft[1]] = 30.0  # kept for sure
    logits[3:] = np.nan  # rows the step must not look at
    got = harness.step(logits, draft, draft_len=7, n_rows=k + 1)
    assert got[:2] == draft[:2] and len(got) == 3
    assert got in acceptable(logits, draft, k, settings, 99, 0, history)


def test_a_row_without_a_valid_logit_emits_token_zero_and_flags_it(device, kernels):
    """As the GPU sampler: an all-NaN row (a broken forward pass) is never a kept draft or a draw."""
    vocab = 200
    harness = Harness(device, kernels, vocab, max_rows=3)
    harness.op.configure(SamplerSettings(temperature=1.0, top_k=40), 3, 0, [])
    logits = np.zeros((3, vocab), np.float32)
    logits[0, 17] = 50.0  # drafted token 0 is kept
    logits[1] = np.nan
    assert harness.step(logits, [17, 5], 2, 3) == [17, 0]
    assert device.read_sync(harness.op.state, 0, 8).view(np.uint32).tolist() == [4, 1]


def test_reproducible_and_seed_dependent(device, kernels):
    vocab, k = 300, 4
    harness = Harness(device, kernels, vocab, max_rows=k + 1)
    settings = SamplerSettings(temperature=1.2, top_k=50, top_p=0.98)

    def run(seed: int) -> list[list[int]]:
        rng = np.random.default_rng(0)  # the same logits and drafts every run
        harness.op.configure(settings, seed, 0, [])
        outputs = []
        for _ in range(8):
            logits, draft, draft_len = random_step(rng, vocab, k, [1])
            outputs.append(harness.step(logits, draft, draft_len, k + 1))
        return outputs

    first = run(1234)
    assert run(1234) == first
    assert run(1235) != first


@pytest.mark.slow
@pytest.mark.parametrize("draft_p", ["high", "low"])
def test_first_token_is_distributed_as_p(device, kernels, draft_p):
    """Speculative sampling must not change the distribution: over many draws (the GPU's counter
    moves on every step), the first emitted token's frequencies match p (chi-square), and the
    drafted token is kept with probability p(draft)."""
    vocab, steps = 8, 2000
    logits = np.zeros((2, vocab), np.float32)
    logits[0] = [2.0, 1.2, 0.5, 0.0, -0.3, -1.0, 0.9, 1.5]
    logits[1] = np.linspace(-1, 1, vocab)
    settings = SamplerSettings(temperature=0.9, top_k=8, top_p=1.0)
    p = target_p(logits[0], settings)
    drafted = int(np.argmax(p)) if draft_p == "high" else int(np.argmin(p))
    harness = Harness(device, kernels, vocab, max_rows=2)
    device.upload(harness.logits, 0, logits)
    device.upload(harness.draft, 0, np.array([drafted, 0], np.uint32))
    device.upload(harness.spec, 0, np.array([1, 0, 0, NO_BUDGET], np.uint32))
    results = device.buffer(8 * steps, label="results")
    harness.op.configure(settings, 2024, 0, [])
    recorder = device.begin()
    for i in range(steps):  # out[0], out[1] of every step, without a readback in between
        harness.op.record(recorder, 2)
        recorder.copy(harness.out, 0, results, 8 * i, 8)
    recorder.submit()
    pairs = device.read_sync(results, 0, 8 * steps).view(np.uint32).reshape(steps, 2)
    counts = np.bincount(pairs[:, 1], minlength=vocab)
    chi2 = float(((counts - steps * p) ** 2 / (steps * p)).sum())
    assert chi2 < 24.3  # 7 degrees of freedom: p = 0.001
    kept = int(np.count_nonzero(pairs[:, 0] == 2))  # two tokens emitted: the drafted one was kept
    assert abs(kept / steps - p[drafted]) < 4 * np.sqrt(p[drafted] * (1 - p[drafted]) / steps)
    assert np.all((pairs[:, 0] == 2) == (pairs[:, 1] == drafted))  # a rejected draft is never drawn
