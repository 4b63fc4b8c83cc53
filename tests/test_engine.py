"""The Engine API on lavapipe: generation against the numpy ReferenceModel, sampling, abort, chat with
prefix reuse, reset, stop strings, and bad input / device failures that must leave it able to load again.

Greedy checks are teacher-forced: one reference pass over prompt + generated tokens gives the
reference's logits before every generated token, and each generated token must be the reference's
argmax wherever the reference's top-2 gap exceeds the tolerance of tests/test_model.py (3% of the
logit range; below that an int8 rounding flip may legitimately pick the other token).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from bitnet_web import gpu  # noqa: E402
from bitnet_web.bench import replies_after_pauses  # noqa: E402
from bitnet_web.convert.synthetic import random_bitnet_writer  # noqa: E402
from bitnet_web.engine import Engine, EngineError  # noqa: E402
from bitnet_web.formats.ggml import GGUFError, Keys  # noqa: E402
from bitnet_web.formats.gguf_reader import GGUFFile, open_gguf
from bitnet_web.model.config import ModelConfigError  # noqa: E402
from bitnet_web.model.forward import BitNetModel  # noqa: E402
from bitnet_web.model.reference import ReferenceModel  # noqa: E402
from bitnet_web.text.sampler import SamplerSettings  # noqa: E402

pytestmark = pytest.mark.gpu

MAX_TOL = 0.03  # of the reference's logit range (see tests/test_model.py)
VOCAB = 1000
# Untied head: with a tied one, random models mostly repeat their input token and greedy tests say little.
PREFILL_CHUNK = 16  # the engine fixture's, loaded from tiny_path (tests/conftest.py)
TINY = dict(
    dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=VOCAB, context_length=256, untied=True, seed=5
)
PROMPT = [5, 300, 301, 77, 900, 12, 13, 14]
GREEDY = SamplerSettings(temperature=0)  # the engine decodes this on the GPU (argmax, pipelined)
TOP1 = SamplerSettings(temperature=1.0, top_k=1)  # also greedy, but sampled on the CPU from read-back logits


@pytest.fixture(scope="module")
def ref(tiny_path) -> ReferenceModel:
    return ReferenceModel(open_gguf(tiny_path))


@pytest.fixture
def loaded(engine, tiny_path) -> Engine:
    """The module engine with the tiny model loaded (a test before may have unloaded it)."""
    if engine.model is None or engine.name != os.path.basename(tiny_path):
        engine.load(tiny_path)
    return engine


def teacher_forced_logits(ref: ReferenceModel, prompt: list[int], generated: list[int]) -> np.ndarray:
    """The reference's logits before each generated token: [len(generated), vocab]."""
    logits = ref.logits(prompt + generated)
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def assert_greedy(ref: ReferenceModel, prompt: list[int], generated: list[int]) -> None:
    logits = teacher_forced_logits(ref, prompt, generated)
    tol = MAX_TOL * float(np.ptp(logits))
    for step, (row, token) in enumerate(zip(logits, generated, strict=True)):
        best = int(row.argmax())
        assert token == best or row[token] >= row[best] - tol, (
            f"step {step}: generated {token} (reference logit {row[token]:.3f}) but the reference's argmax "
            f"is {best} ({row[best]:.3f}), more than {tol:.3f} higher"
        )


def generate(engine: Engine, settings: SamplerSettings = GREEDY, **kwargs) -> tuple[str, list[int]]:
    text = "".join(engine.generate(settings=settings, **kwargs))
    return text, list(engine.generated_tokens)


@pytest.mark.parametrize(
    "settings,on_gpu,choice", [(GREEDY, True, "gpu_argmax"), (TOP1, True, "gpu_sample"), (TOP1, False, "cpu_sample")]
)
def test_greedy_generation_equals_reference_greedy(loaded, ref, settings, on_gpu, choice):
    loaded.gpu_sampling = on_gpu
    try:
        text, tokens = generate(loaded, settings, tokens=PROMPT, max_tokens=16)
    finally:
        loaded.gpu_sampling = True
    stats = loaded.last_stats
    assert stats.token_choice == choice
    assert stats.stop_reason == "max_tokens" and stats.n_generated == 16 == len(tokens)
    assert stats.n_prompt_tokens == len(PROMPT)
    assert_greedy(ref, PROMPT, tokens)
    assert text == loaded.tokenizer.decode(tokens)
    assert len(set(tokens)) > 4, "the test model should not just repeat one token"


def test_seeded_sampling_is_reproducible(loaded, ref):
    settings = SamplerSettings(temperature=5.0, top_k=40, top_p=0.95, seed=1234)
    first = generate(loaded, settings, tokens=PROMPT, max_tokens=16)
    loaded.reset()
    second = generate(loaded, settings, tokens=PROMPT, max_tokens=16)
    assert first == second
    other = generate(
        loaded, SamplerSettings(temperature=5.0, top_k=40, top_p=0.95, seed=99), tokens=PROMPT, max_tokens=16
    )
    # Two seeds agree on all 16 draws with probability prod(sum p^2) over the steps: make sure that is
    # negligible for this model before asserting they differ.
    logits = teacher_forced_logits(ref, PROMPT, first[1]).astype(np.float64) / settings.temperature
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    assert np.prod((p**2).sum(axis=1) / 0.95**2) < 1e-6
    assert other[1] != first[1]
    # Every sampled token lies in the reference's top-k (up to near-ties at the k-th logit).
    kth = np.sort(logits * settings.temperature, axis=1)[:, -settings.top_k]
    chosen = (logits * settings.temperature)[np.arange(16), first[1]]
    assert (chosen >= kth - MAX_TOL * np.ptp(logits * settings.temperature)).all()


@pytest.mark.parametrize(
    "settings",
    [
        SamplerSettings(temperature=5.0, top_k=40, top_p=0.95, seed=1234),
        SamplerSettings(temperature=0.8, top_k=64, top_p=0.9, min_p=0.01, seed=7),
        SamplerSettings(temperature=2.0, top_k=3, top_p=1.0, seed=2**50 + 3),
        SamplerSettings(temperature=1.0, top_k=40, repetition_penalty=1.3, repeat_last_n=16, seed=11),
        SamplerSettings(temperature=0.0, repetition_penalty=1.5, repeat_last_n=64),
    ],
)
def test_gpu_sampling_draws_the_cpu_samplers_tokens(loaded, settings):
    """Both paths use the stream sampler.uniform(seed, n) and the same cuts: the GPU (queued steps,
    nothing read back but ids) must give the CPU sampler's tokens for the same seed."""
    runs = {}
    for on_gpu in (True, False):
        loaded.gpu_sampling = on_gpu
        loaded.reset()
        try:
            runs[on_gpu] = generate(loaded, settings, tokens=PROMPT, max_tokens=24)
        finally:
            loaded.gpu_sampling = True
        assert loaded.last_stats.token_choice == ("gpu_sample" if on_gpu else "cpu_sample")
        assert loaded.last_stats.n_generated == 24
    assert runs[True] == runs[False]
    assert len(set(runs[True][1])) > 3  # a sampler stuck on one token would also "agree"


def test_each_readback_is_asked_for_before_the_next_submit_and_every_one_ends(loaded, monkeypatch):
    """A browser maps a buffer only after all work submitted before the request (WebGPU's queue
    timeline), so the decode loops (plain and speculative) and a watched prefill ask for each
    staging buffer's readback (gpu.Device.start_read) right after the submit that writes it, before
    any later submit; and every read asked for is awaited or cancelled (a reply stopped early leaves
    steps queued), so no buffer stays mapped into the next reply."""
    from bitnet_web.gpu.native import NativeDevice, NativeRecorder

    events: list[tuple[str, object]] = []
    real = NativeRecorder.submit, NativeDevice.start_read, NativeDevice.cancel_read, NativeDevice.read_staging
    real_copy = NativeRecorder.copy
    staged: dict[int, object] = {}  # recorder id -> the staging buffer its commands write

    def copy(self, src, src_offset, dst, dst_offset, nbytes):
        if dst.usage & gpu.MAP_READ:
            staged[id(self)] = dst
        return real_copy(self, src, src_offset, dst, dst_offset, nbytes)

    def submit(self):
        events.append(("submit", staged.pop(id(self), None)))
        return real[0](self)

    async def read_staging(self, staging, nbytes):
        events.append(("read", staging))
        return await real[3](self, staging, nbytes)

    monkeypatch.setattr(NativeRecorder, "submit", submit)
    monkeypatch.setattr(NativeRecorder, "copy", copy)
    monkeypatch.setattr(NativeDevice, "start_read", lambda self, b: events.append(("start", b)) or real[1](self, b))
    monkeypatch.setattr(NativeDevice, "cancel_read", lambda self, b: events.append(("cancel", b)) or real[2](self, b))
    monkeypatch.setattr(NativeDevice, "read_staging", read_staging)
    loaded.model.DECODE_BATCHING = (3, 2)  # several steps a submit, two submits queued: a stop leaves some
    try:
        for speculate in (0, 2):
            loaded.reset()
            reply = loaded.generate(tokens=PROMPT, settings=GREEDY, max_tokens=20, speculate=speculate)
            next(reply), next(reply)
            reply.close()  # the consumer stops early (Stop): steps are still queued
            generate(loaded, tokens=PROMPT * 3, max_tokens=7, speculate=speculate)  # the next reply works
        loaded.reset()
        loaded._run(loaded.model.prefill(PROMPT * 4, chunk=8, progress=lambda done, total: None))
    finally:
        loaded.model.__dict__.pop("DECODE_BATCHING", None)
    started = [b for kind, b in events if kind == "start"]
    assert len(started) >= 8
    for i, (kind, buffer) in enumerate(events):
        if kind == "start":  # the submit just before it wrote this buffer: no other submit in between
            assert events[i - 1] == ("submit", buffer), events[max(0, i - 3) : i + 1]
    # each start is ended, in order, by one read or one cancel of the same buffer
    open_reads: list[object] = []
    for kind, buffer in events:
        if kind == "start":
            assert buffer not in open_reads
            open_reads.append(buffer)
        elif kind in ("read", "cancel") and buffer in open_reads:
            open_reads.remove(buffer)
    assert open_reads == []
    assert any(kind == "cancel" for kind, _ in events)  # a stopped reply left queued steps


def test_the_next_submit_is_recorded_while_the_host_waits_for_a_readback(loaded, monkeypatch):
    """With steps queued, the decode loop records the submit that refills the queue before it awaits
    the oldest readback (the host is idle then), so after the readback only a submit stands between
    the GPU and its next work; the reply is the same as recording it afterwards (the batching test
    below compares batchings)."""
    from bitnet_web.gpu.native import NativeDevice, NativeRecorder

    events: list[str] = []
    record, submit, read = BitNetModel._record_gpu_steps, NativeRecorder.submit, NativeDevice.read_staging

    def recording(self, *args, **kwargs):
        events.append("record")
        return record(self, *args, **kwargs)

    def submitting(self):
        events.append("submit")
        return submit(self)

    async def reading(self, staging, nbytes):
        events.append("read")
        return await read(self, staging, nbytes)

    verify_record = BitNetModel._record_verify_steps

    def recording_verify(self, *args, **kwargs):
        events.append("record")
        return verify_record(self, *args, **kwargs)

    monkeypatch.setattr(BitNetModel, "_record_gpu_steps", recording)
    monkeypatch.setattr(BitNetModel, "_record_verify_steps", recording_verify)
    monkeypatch.setattr(NativeRecorder, "submit", submitting)
    monkeypatch.setattr(NativeDevice, "read_staging", reading)
    model = loaded.model
    model.DECODE_BATCHING = (3, 2)

    async def reply(speculate: int) -> list[int]:
        model.truncate(0)
        await model.prefill(PROMPT[:-1])
        events.clear()
        if speculate:
            steps = model.decode_speculative(PROMPT[-1], speculate, limit=25)
        else:
            steps = model.decode_greedy(PROMPT[-1], limit=25)
        tokens = []
        async for token in steps:
            tokens.append(token)
            if len(tokens) == 25:
                break
        await steps.aclose()
        return tokens

    try:
        for speculate in (0, 2):  # plain decode steps, then verify steps (every step verifies: no policy)
            tokens = loaded._run(reply(speculate))
            assert len(tokens) == 25
            refills = 0
            for i, event in enumerate(events):
                if event == "read" and "submit" in events[i + 1 :]:
                    refills += 1
                    before = [e for e in events[:i] if e in ("record", "submit")]
                    assert before[-1] == "record", (speculate, events[max(0, i - 4) : i + 2])  # not yet submitted
            assert refills >= 3, (speculate, events)
            assert events.count("record") <= events.count("submit") + 1  # at most one recorded ahead unused
    finally:
        model.__dict__.pop("DECODE_BATCHING", None)
        loaded.reset()


def test_the_queue_is_refilled_before_the_tokens_read_are_yielded(loaded, monkeypatch):
    """In a browser a submit's readback arrives about when the next submit is done, so the GPU would wait
    for whatever the caller does with the tokens: each read refills the queue before its first token is
    yielded (decode and verify steps), except where a token read is in stop_ids (the caller probably
    stops there: nothing more is queued for it). The tokens are plain decoding's either way."""
    submits = [0]
    submit = type(loaded.device.begin()).submit

    def counting(self):
        submits[0] += 1
        return submit(self)

    monkeypatch.setattr(type(loaded.device.begin()), "submit", counting)
    model = loaded.model
    model.DECODE_BATCHING = (2, 2)

    async def reply(speculate: int, stop_ids=()) -> tuple[list[int], list[int]]:
        model.truncate(0)
        await model.prefill(PROMPT[:-1])
        if speculate:
            steps = model.decode_speculative(PROMPT[-1], speculate, stop_ids=stop_ids)
        else:
            steps = model.decode_greedy(PROMPT[-1], stop_ids=stop_ids)
        submits[0] = 0
        tokens, seen = [], []
        async for token in steps:
            tokens.append(token)
            seen.append(submits[0])
            if len(tokens) == 12:
                break
        await steps.aclose()
        return tokens, seen

    try:
        plain, seen = loaded._run(reply(0))
        # two submits of 2 steps queued before the first read; its tokens come with a third one queued
        assert seen[:2] == [3, 3] and seen[2:4] == [4, 4], seen
        stopped, seen = loaded._run(reply(0, stop_ids=[plain[1]]))
        assert stopped == plain and seen[:2] == [2, 2], seen  # a stop id read: refilled after the yields
        drafted, seen = loaded._run(reply(2))
        assert drafted[: len(plain)] == plain
        assert seen[0] == 3, seen  # verify steps likewise
    finally:
        model.__dict__.pop("DECODE_BATCHING", None)
        loaded.reset()


async def consume(agen) -> None:
    async for _ in agen:
        pass


async def zip_range(agen, n: int):
    """The first `n` items of `agen`, each with its index."""
    i = 0
    async for item in agen:
        yield item, i
        i += 1
        if i == n:
            return


def test_the_first_token_is_chosen_on_the_gpu_and_the_reply_queues_behind_the_prompt(loaded, monkeypatch):
    """Where the GPU chooses the tokens, it chooses the first one too, in the prompt's last submit, and
    the decode steps are submitted before the host learns it (no round trip between the prompt and
    the reply; no logits read back). The tokens are those of the host-chosen first token: greedy,
    and seeded sampling (its draw stream and repetition penalty continue across the first token),
    with and without drafts."""
    from bitnet_web.text.sampler import Sampler

    device, model = loaded.device, loaded.model
    events: list[str] = []
    recorder_type = type(device.begin())
    submit, read_staging, read = recorder_type.submit, type(device).read_staging, type(device).read

    def logged_submit(self):
        events.append("submit")
        return submit(self)

    async def logged_read_staging(self, staging, nbytes):
        events.append(f"read {staging.label}")
        return await read_staging(self, staging, nbytes)

    async def logged_read(self, *args, **kwargs):
        events.append("read logits")
        return await read(self, *args, **kwargs)

    monkeypatch.setattr(recorder_type, "submit", logged_submit)
    monkeypatch.setattr(type(device), "read_staging", logged_read_staging)
    monkeypatch.setattr(type(device), "read", logged_read)
    sampled = SamplerSettings(temperature=0.9, top_k=20, repetition_penalty=1.3, repeat_last_n=64, seed=7)
    n = 12

    async def host_first(settings: SamplerSettings, k: int) -> list[int]:
        """The reply with the first token chosen on the host from read-back logits (the route before)."""
        model.truncate(0)
        sampler = Sampler(settings)
        first = sampler.sample(await model.prefill(PROMPT), PROMPT)
        history, limit = [*PROMPT, first], n - 1
        policy = loaded._speculation_policy(k) if k else None
        if settings.temperature == 0:
            steps = model.decode_speculative(first, k, limit, policy=policy) if k else model.decode_greedy(first, limit)
        elif k:
            args = (settings, sampler.seed, sampler.draws, history, limit, policy)
            steps = model.decode_speculative_sampled(first, k, *args)
        else:
            steps = model.decode_sampled(first, settings, sampler.seed, sampler.draws, history, limit)
        tokens = [first]
        async for token in steps:
            tokens.append(token)
            if len(tokens) == n:
                break
        await steps.aclose()
        return tokens

    try:
        # a reply of one token queues no decode step; a loop read past its limit still goes on exactly
        model.truncate(0)
        events.clear()
        loaded._run(consume(loaded.generate_tokens_async(PROMPT, GREEDY, max_tokens=1)))
        assert events.count("submit") == 1 and loaded.generated_tokens == loaded._run(host_first(GREEDY, 0))[:1]

        async def past_limit() -> list[int]:
            model.truncate(0)
            steps = model.decode_greedy(await model.prefill(PROMPT, choose=model.argmax), limit=0)
            tokens = [token async for token, _ in zip_range(steps, 5)]
            await steps.aclose()
            return tokens

        assert loaded._run(past_limit()) == loaded._run(host_first(GREEDY, 0))[:5]
        for settings in (GREEDY, sampled):
            for k in (0, 3):
                model.truncate(0)
                events.clear()
                loaded._run(consume(loaded.generate_tokens_async(PROMPT, settings, max_tokens=n, speculate=k)))
                ids, eos = list(loaded.generated_tokens), loaded.last_stats.stop_reason == "eos"
                assert "read logits" not in events, events
                first_read = events.index("read first token")
                assert events[:first_read].count("submit") >= 2, events  # the prompt's and the reply's
                if settings is sampled and k:  # the penalty window, as this reply left it
                    op = model._spec_samplers[k]
                    state = device.read_sync(op.state, 0, 4 * (op.RING_AT + 64)).view(np.uint32)
                    length, head = int(state[2]), int(state[3])
                    ring = [int(state[op.RING_AT + (head + 64 - length + e) % 64]) for e in range(length)]
                expected = loaded._run(host_first(settings, k))
                assert ids == expected[: len(ids)] and len(ids) + eos >= 1, (settings, k, ids, expected)
                if settings is sampled and k:  # it holds the first token, copied in on the GPU
                    reply = expected[: len(ids) + eos]  # the GPU emits a stop token too
                    assert ring == [*PROMPT, *reply][-length:] and length == min(64, len(PROMPT) + len(reply))
    finally:
        loaded.reset()


def test_read_ends_reply():
    from bitnet_web.kernels.speculative import NO_BUDGET
    from bitnet_web.model.decode import read_ends_reply

    # steps of stride 4: n_emitted, up to 2 tokens, the draft length
    words = np.array([2, 10, 11, 1, 1, 12, 0, 0], dtype=np.uint32)
    assert not read_ends_reply(words, 2, 4, NO_BUDGET, frozenset({99}))
    assert read_ends_reply(words, 2, 4, NO_BUDGET, frozenset({12}))  # a stop token emitted
    assert not read_ends_reply(words, 2, 4, NO_BUDGET, frozenset({0}))  # a word past n_emitted is no token
    assert read_ends_reply(words, 2, 4, 3, frozenset())  # the budget's last tokens
    assert not read_ends_reply(words, 2, 4, 4, frozenset())
    assert read_ends_reply(np.array([2, 10, 11, 1, 0, 0, 0, 0], dtype=np.uint32), 2, 4, NO_BUDGET, frozenset())


def test_a_reply_starts_with_a_short_submit(loaded, monkeypatch):
    """The GPU waits for a reply's first submit to be recorded: it holds at most FIRST_SUBMIT_STEPS
    steps, the later ones the batching's full count, for decode and for verify steps alike."""
    from bitnet_web.model.decode import FIRST_SUBMIT_STEPS

    sizes: list[tuple[str, int]] = []
    record, verify_record = BitNetModel._record_gpu_steps, BitNetModel._record_verify_steps

    def recording(self, chooser, pos, k, staging):
        sizes.append(("decode", k))
        return record(self, chooser, pos, k, staging)

    def recording_verify(self, k, n_steps, *args, **kwargs):
        sizes.append(("verify", n_steps))
        return verify_record(self, k, n_steps, *args, **kwargs)

    monkeypatch.setattr(BitNetModel, "_record_gpu_steps", recording)
    monkeypatch.setattr(BitNetModel, "_record_verify_steps", recording_verify)
    model = loaded.model
    model.DECODE_BATCHING = (2 * FIRST_SUBMIT_STEPS, 2)

    async def reply(speculate: int) -> None:
        model.truncate(0)
        await model.prefill(PROMPT[:-1])
        steps = model.decode_speculative(PROMPT[-1], speculate) if speculate else model.decode_greedy(PROMPT[-1])
        n = 0
        async for _ in steps:
            n += 1
            if n == 6 * FIRST_SUBMIT_STEPS:
                break
        await steps.aclose()

    try:
        for kind, speculate in (("decode", 0), ("verify", 2)):
            sizes.clear()
            loaded._run(reply(speculate))
            assert sizes[0] == (kind, FIRST_SUBMIT_STEPS), sizes
            assert sizes[1] == (kind, 2 * FIRST_SUBMIT_STEPS), sizes
    finally:
        model.__dict__.pop("DECODE_BATCHING", None)
        loaded.reset()


@pytest.mark.parametrize("batching", [(1, 1), (1, 3), (4, 2), (5, 3)])
@pytest.mark.slow
def test_decode_batching_does_not_change_tokens_or_bookkeeping(loaded, batching):
    """Steps queued ahead of the host, several to a submit (BitNetModel.DECODE_BATCHING: steps per
    submit, submits in flight), run at positions the host has not recorded yet: any batching must give
    the same tokens, up to the context end, and leave the cache holding exactly prompt + reply (what a
    following turn reuses), whether the reply ends at max_tokens inside a submit or at the context."""
    context = loaded.config.context_length
    sampled = SamplerSettings(temperature=1.0, top_k=20, seed=3)
    # the reply must reach the context end: no end-of-text id or template stop string may end it first
    stops = loaded.tokenizer.stop_ids, loaded.template
    loaded.tokenizer.stop_ids, loaded.template = frozenset(), None
    try:
        expected_full = generate(loaded, GREEDY, tokens=PROMPT, max_tokens=context)
        assert loaded.last_stats.stop_reason == "context_full"
        loaded.reset()
        expected_sampled = generate(loaded, sampled, tokens=PROMPT, max_tokens=10)
        loaded.model.DECODE_BATCHING = batching
        loaded.reset()
        assert generate(loaded, GREEDY, tokens=PROMPT, max_tokens=context) == expected_full
        assert loaded.last_stats.stop_reason == "context_full" and loaded.model.n_cached == context
        for settings, expected in ((GREEDY, expected_full[1][:10]), (sampled, expected_sampled[1])):
            loaded.reset()
            part = generate(loaded, settings, tokens=PROMPT, max_tokens=10)
            assert part[1] == expected
            assert loaded.model.cached_tokens[: len(PROMPT) + 9] == PROMPT + part[1][:9]
            follow = generate(loaded, settings, tokens=PROMPT + part[1] + [7], max_tokens=3)
            assert loaded.last_stats.n_reused_tokens >= len(PROMPT) + 9
            loaded.reset()
            assert generate(loaded, settings, tokens=PROMPT + part[1] + [7], max_tokens=3) == follow
    finally:
        loaded.model.__dict__.pop("DECODE_BATCHING", None)
        loaded.tokenizer.stop_ids, loaded.template = stops


@pytest.mark.slow
def test_long_prefill_chunks_with_a_short_logits_buffer(tiny_path, ref):
    """Prefill chunks longer than the logits buffer (LOGITS_ROWS): queued chunks skip the head, and
    all-logits calls run in pieces of logits_rows; both must still match the reference."""
    from bitnet_web.model.forward import LOGITS_ROWS

    engine = Engine(prefill_chunk=100)
    try:
        engine.load(tiny_path)
        assert engine.model.logits_rows == LOGITS_ROWS < 100
        ids = (PROMPT * 30)[:230]  # 3 chunks of 100 (2 queued without a head), logits in 4 pieces
        logits = engine.logits(ids)
        expected = ref.logits(ids)
        assert logits.shape == expected.shape == (230, VOCAB)
        np.testing.assert_allclose(logits, expected, atol=MAX_TOL * float(np.ptp(expected)))
        engine.reset()
        text, tokens = generate(engine, GREEDY, tokens=ids, max_tokens=6)
        assert_greedy(ref, ids, tokens)
    finally:
        engine.close()


def test_prefill_reports_each_chunk_and_abort_ends_it_with_a_usable_cache(loaded, ref):
    """on_prefill sees every chunk before the last as the GPU finishes it (the module engine's chunk
    is 16); abort() there ends the turn with no token, and the rows already computed are valid: the
    next request reuses them and still matches the reference."""
    ids = (PROMPT * 10)[:70]  # 16, 32, 48, 64 queued, then the last 6 with the logits
    seen: list[tuple[int, int]] = []
    loaded.reset()
    loaded.on_prefill = lambda done, total: seen.append((done, total))
    try:
        _, tokens = generate(loaded, GREEDY, tokens=ids, max_tokens=4)
        assert seen == [(16, 70), (32, 70), (48, 70), (64, 70)]
        assert_greedy(ref, ids, tokens)

        def stop_at_32(done: int, total: int) -> None:
            if done == 32:
                loaded.abort()

        loaded.reset()
        loaded.on_prefill = stop_at_32
        text, tokens = generate(loaded, GREEDY, tokens=ids, max_tokens=4)
        assert (text, tokens) == ("", [])
        assert loaded.last_stats.stop_reason == "aborted" and loaded.last_stats.n_generated == 0
        cached = loaded.model.n_cached
        assert 32 <= cached <= 48, cached  # at most the chunk queued behind the one it stopped after
    finally:
        loaded.on_prefill = None
    _, tokens = generate(loaded, GREEDY, tokens=ids, max_tokens=4)
    assert loaded.last_stats.n_reused_tokens == cached
    assert_greedy(ref, ids, tokens)


def test_sync_api_works_inside_a_running_event_loop(loaded):
    """Jupyter and async apps call the sync API from code a running loop drives, where
    run_until_complete refuses to start: the same tokens must come back there."""
    expected = generate(loaded, GREEDY, tokens=PROMPT, max_tokens=6)

    async def from_a_coroutine():
        loaded.reset()
        return generate(loaded, GREEDY, tokens=PROMPT, max_tokens=6), loaded.logits(PROMPT[:3]).shape

    got, logits_shape = asyncio.run(from_a_coroutine())
    assert got == expected and len(got[1]) == 6
    assert logits_shape == (3, VOCAB)


def test_abort_inside_the_iteration_stops_within_one_token(loaded):
    pieces, generated_at_abort = [], None
    for piece in loaded.generate(tokens=PROMPT, settings=GREEDY, max_tokens=50):
        pieces.append(piece)
        if generated_at_abort is None:
            loaded.abort()
            generated_at_abort = len(loaded.generated_tokens)
    assert loaded.last_stats.stop_reason == "aborted"
    assert len(loaded.generated_tokens) == generated_at_abort < 50
    assert "".join(pieces) == loaded.tokenizer.decode(loaded.generated_tokens)
    # the flag does not leak into the next request
    generate(loaded, tokens=PROMPT, max_tokens=5)
    assert loaded.last_stats.n_generated == 5 and loaded.last_stats.stop_reason == "max_tokens"


def test_multi_turn_chat_reuses_the_cached_prefix(loaded, tiny_path):
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    prompt1 = loaded.encode_chat(turn1)
    reply1, _ = generate(loaded, messages=turn1, max_tokens=6)
    turn2 = turn1 + [{"role": "assistant", "content": reply1}, {"role": "user", "content": "And then?"}]
    prompt2 = loaded.encode_chat(turn2)
    assert prompt2[: len(prompt1)] == prompt1  # the chat contract: a new turn extends the old prompt
    reply2, tokens2 = generate(loaded, messages=turn2, max_tokens=8)
    stats = loaded.last_stats
    assert stats.n_prompt_tokens == len(prompt2)
    assert stats.n_reused_tokens >= len(prompt1)
    assert stats.prefill_tok_per_s > 0

    fresh = Engine(prefill_chunk=16)
    try:
        fresh.load(tiny_path)
        assert generate(fresh, messages=turn2, max_tokens=8) == (reply2, tokens2)
        assert fresh.last_stats.n_reused_tokens == 0
    finally:
        fresh.close()


def test_reset_forgets_the_cached_context(loaded):
    first = generate(loaded, tokens=PROMPT, max_tokens=6)
    again = generate(loaded, tokens=PROMPT, max_tokens=6)
    assert loaded.last_stats.n_reused_tokens == len(PROMPT) - 1
    loaded.reset()
    assert loaded.model.n_cached == 0
    after_reset = generate(loaded, tokens=PROMPT, max_tokens=6)
    assert loaded.last_stats.n_reused_tokens == 0
    assert first == again == after_reset


def test_a_warm_up_keeps_the_gpu_busy_and_leaves_every_reply_unchanged(loaded):
    """Engine.warm_up (the chat page raises the GPU's clocks with it while the person types) runs LM-head
    passes for about the time asked, changes nothing a reply reads (the model's logits, the cached
    context, the reply and its reuse of the cache), and ends at once when a reply starts."""
    first = generate(loaded, tokens=PROMPT, max_tokens=6)
    model = loaded.model
    logits_before = loaded._run(loaded.device.read(model.logits))
    cached_before = list(model.cached_tokens)
    stats = loaded.warm_up(0.05)
    assert stats["seconds"] >= 0.05 and not stats["stopped"]
    assert 1 <= stats["submits"] <= stats["heads"]
    busy = model.warm_up().busy  # its arithmetic ran after every head pass and wrote nothing
    assert busy.workgroups >= 1
    np.testing.assert_array_equal(loaded._run(loaded.device.read(busy.sink)).view(np.float32), 0.0)
    np.testing.assert_array_equal(loaded._run(loaded.device.read(model.logits)), logits_before)
    assert model.cached_tokens == cached_before
    assert generate(loaded, tokens=PROMPT, max_tokens=6) == first
    assert loaded.last_stats.n_reused_tokens == len(PROMPT) - 1

    async def reply_during_a_warm_up() -> tuple[dict, list[int]]:
        warm = asyncio.ensure_future(loaded.warm_up_async(60.0))
        await asyncio.sleep(0.02)  # its first submits are queued
        async for _ in loaded.generate_tokens_async(PROMPT, GREEDY, 6):
            pass
        return await warm, list(loaded.generated_tokens)

    stats, tokens = loaded._run(reply_during_a_warm_up())
    assert stats["stopped"] and stats["seconds"] < 60 and stats["submits"] >= 1
    assert tokens == first[1]


def test_the_bench_times_replies_after_pauses_with_and_without_a_warm_up(loaded):
    """bench.replies_after_pauses (the CLI's `bench --pauses`, the bench page's pauses=): every row timed,
    and each warm-up ran (LM-head passes) without being cut short."""
    report = loaded._run(replies_after_pauses(loaded, rounds=1, idle_s=0.05, n_tokens=4))
    for k in (0, 6):
        row = report[f"speculate_{k}"]
        assert set(row) == {"after_a_reply", "after_idle", "after_idle_and_warm_up"}
        assert all(len(ms) == 1 and ms[0] > 0 for ms in row.values()), row
    assert len(report["warm_ups"]) == 2
    assert all(w["heads"] >= 1 and not w["stopped"] and w["seconds"] >= 0.3 for w in report["warm_ups"])


def test_stop_string_ends_the_reply_before_it(loaded):
    full_text, tokens = generate(loaded, tokens=PROMPT, max_tokens=16)
    stop = loaded.tokenizer.decode(tokens[6:8])  # text that first shows up mid-reply
    assert stop and full_text.index(stop) > 0
    text, _ = generate(loaded, tokens=PROMPT, max_tokens=16, stop_strings=[stop])
    assert loaded.last_stats.stop_reason == "stop_string"
    assert text == full_text[: full_text.index(stop)]
    assert loaded.last_stats.n_generated < 16


# Bad input: a clear error, and the engine loads a good model afterwards -----------------------------


def write_variant(folder, name: str, change) -> str:
    path = str(folder / f"{name}.gguf")
    writer = random_bitnet_writer(path, **TINY)
    change(writer)
    writer.write()
    return path


def drop_tensor(name: str):
    def change(writer) -> None:
        writer.tensors = [t for t in writer.tensors if t.name != name]

    return change


def contradict_ffn_length(writer) -> None:
    writer.metadata[Keys.arch(Keys.FEED_FORWARD_LENGTH, "bitnet-b1.58")] = 512  # tensors say 384


def nan_scale(writer) -> None:
    index = next(i for i, t in enumerate(writer.tensors) if t.name == "blk.1.ffn_up.weight")
    pending = writer.tensors[index]
    raw = np.asarray(pending.source(), dtype=np.uint8).copy()
    raw[pending.n_elements // 4 : pending.n_elements // 4 + 4] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    writer.tensors[index] = pending._replace(source=raw)


BAD_FILES = {
    "shapes_contradict_config": (
        contradict_ffn_length,
        ModelConfigError,
        r"blk\.0\.ffn_gate\.weight has shape \[384, 256\], expected \[512, 256\]",
    ),
    "missing_tensor": (
        drop_tensor("blk.1.ffn_down.weight"),
        ModelConfigError,
        r"missing tensor blk\.1\.ffn_down\.weight",
    ),
    "nan_weight_scale": (nan_scale, GGUFError, r"blk\.1\.ffn_up\.weight"),
}


def assert_recovers(engine: Engine, tiny_path: str, ref: ReferenceModel) -> None:
    engine.load(tiny_path)
    _, tokens = generate(engine, tokens=PROMPT, max_tokens=4)
    assert engine.last_stats.n_generated == 4
    assert_greedy(ref, PROMPT, tokens)


class ArrivingFile:
    """A file whose bytes arrive in order (as the browser reads IndexedDB chunks): `data` holds the
    header and garbage (0xA5) beyond what `ready(n)` has let in, so a read of bytes the engine did
    not wait for changes what it uploads."""

    def __init__(self, path: str, fail_after: int | None = None) -> None:
        self.full = np.fromfile(path, dtype=np.uint8)
        header_end = open_gguf(path).data_offset
        self.data = np.full(len(self.full), 0xA5, dtype=np.uint8)
        self.data[:header_end] = self.full[:header_end]
        self.filled, self.asked, self.fail_after = header_end, [], fail_after

    async def ready(self, n: int) -> None:
        self.asked.append(n)
        if self.fail_after is not None and len(self.asked) > self.fail_after:
            raise OSError("simulated: the stored copy could not be read")
        await asyncio.sleep(0)
        if n > self.filled:
            self.data[self.filled : n] = self.full[self.filled : n]
            self.filled = n


def test_a_file_still_arriving_is_uploaded_part_by_part_as_its_bytes_come(loaded, tiny_path):
    arriving = ArrivingFile(tiny_path)
    engine = Engine(prefill_chunk=16)
    try:
        engine._run(engine.load_async(GGUFFile.from_buffer(arriving.data), "arriving", ready=arriving.ready))
        assert np.array_equal(engine.logits(PROMPT), loaded.logits(PROMPT))  # no byte used before it came
        # the parts in file order (embedding, layers, output norm), then the whole file for its checks
        assert arriving.asked == sorted(arriving.asked) and len(arriving.asked) >= TINY["n_layers"] + 2
        assert arriving.asked[-1] == len(arriving.full)
    finally:
        engine.close()


def test_kernels_are_made_while_the_file_still_arrives(tiny_path, monkeypatch):
    """Each part's ops (and so their pipelines: compiled in parallel with the upload in a browser) are
    built once that part is uploaded, not after the whole file: only the last part's own (this file's
    embedding: the lookup, the LM head's two variants and the screened argmax's four) are made after its
    bytes are asked for."""
    from bitnet_web.gpu.native import NativeDevice

    events: list[str] = []
    make_pipeline = NativeDevice.pipeline

    def pipeline(self, *args, **kwargs):
        events.append("pipeline")
        return make_pipeline(self, *args, **kwargs)

    monkeypatch.setattr(NativeDevice, "pipeline", pipeline)
    arriving = ArrivingFile(tiny_path)
    ready = arriving.ready

    async def logged_ready(n: int) -> None:
        events.append("ask")
        await ready(n)

    engine = Engine(prefill_chunk=16)
    try:
        engine._run(engine.load_async(GGUFFile.from_buffer(arriving.data), "arriving", ready=logged_ready))
    finally:
        engine.close()
    asks = [i for i, e in enumerate(events) if e == "ask"]  # each part in file order, then the whole file
    made_late = events[asks[-2] :].count("pipeline")  # once the last part (the output norm) is asked for
    assert events.count("pipeline") >= 20 and made_late <= 7, " ".join(events)


def test_a_model_loaded_again_on_the_same_device_compiles_no_kernel(tiny_path, ref, monkeypatch):
    """Kernels are kept per device: a second load of the same shapes (a page switching back to a
    model) makes no pipeline, and computes what the first load did."""
    from bitnet_web.gpu.native import NativeDevice

    made: list[str] = []
    make_pipeline = NativeDevice.pipeline

    def pipeline(self, wgsl, label, entry_point="main"):
        made.append(label)
        return make_pipeline(self, wgsl, label, entry_point)

    monkeypatch.setattr(NativeDevice, "pipeline", pipeline)
    engine = Engine(prefill_chunk=16)
    try:
        engine.load(tiny_path)
        first = engine.logits(PROMPT)
        n_first = len(made)
        engine.unload()
        engine.load(tiny_path)
        assert n_first >= 20 and len(made) == n_first, made[n_first:]
        assert np.array_equal(engine.logits(PROMPT), first)
        assert_recovers(engine, tiny_path, ref)
    finally:
        engine.close()


def test_kernels_a_failed_pipeline_batch_left_unbuilt_are_compiled_again(tiny_path, ref, monkeypatch):
    """A batch that fails (a browser's compile failure) leaves pipelines without a handle: the device's
    cache must not hand them to the next load, which compiles them again and works."""
    from bitnet_web.gpu.native import NativeDevice

    make_pipeline = NativeDevice.pipeline
    batch: list = []  # (pipeline, real handle) of the simulated batch, or None when none is open

    def pipeline(self, wgsl, label, entry_point="main"):
        real = make_pipeline(self, wgsl, label, entry_point)
        if batch is not None and label.startswith("attention"):
            unbuilt = gpu.Pipeline(None, label)  # as a browser's batch hands it out, and never fills in
            batch.append(unbuilt)
            return unbuilt
        return real

    make_bind_group = NativeDevice.bind_group

    def bind_group(self, pipeline, buffers, label=""):
        if pipeline.handle is None:  # a browser's batch makes these once the pipeline exists
            return gpu.BindGroup(None, label, tuple(buffers))
        return make_bind_group(self, pipeline, buffers, label)

    async def end_pipeline_batch(self):
        if batch:
            raise gpu.GPUError(f"creating pipeline {batch[0].label!r} failed: simulated")

    monkeypatch.setattr(NativeDevice, "pipeline", pipeline)
    monkeypatch.setattr(NativeDevice, "bind_group", bind_group)
    monkeypatch.setattr(NativeDevice, "end_pipeline_batch", end_pipeline_batch)
    engine = Engine(prefill_chunk=16)
    try:
        with pytest.raises(gpu.GPUError, match="creating pipeline 'attention.*simulated"):
            engine.load(tiny_path)
        assert batch and engine.model is None and engine.device.live_buffers == 0
        batch = None  # compiles work again
        monkeypatch.setattr(NativeDevice, "end_pipeline_batch", lambda self: asyncio.sleep(0))
        assert_recovers(engine, tiny_path, ref)
    finally:
        engine.close()


def test_a_file_that_stops_arriving_fails_the_load_and_frees_what_was_uploaded(tiny_path, ref):
    arriving = ArrivingFile(tiny_path, fail_after=2)
    engine = Engine(prefill_chunk=16)
    try:
        with pytest.raises(OSError, match="simulated: the stored copy could not be read"):
            engine._run(engine.load_async(GGUFFile.from_buffer(arriving.data), "arriving", ready=arriving.ready))
        assert engine.model is None and engine.device.live_buffers == 0  # the parts uploaded were released
        assert_recovers(engine, tiny_path, ref)
    finally:
        engine.close()


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_model_file_is_a_clear_error_and_the_engine_recovers(engine, tiny_path, ref, tmp_path, case):
    change, error, message = BAD_FILES[case]
    path = write_variant(tmp_path, case, change)
    with pytest.raises(error, match=message):
        engine.load(path)
    assert engine.model is None
    assert engine.device is None or engine.device.live_buffers <= 1  # at most the read-back staging buffer
    with pytest.raises(EngineError, match="no model is loaded"):
        generate(engine, tokens=PROMPT, max_tokens=2)
    assert_recovers(engine, tiny_path, ref)


@pytest.mark.parametrize(
    "request_kind",
    ["ids_out_of_range", "negative_id", "empty_ids", "empty_prompt", "logits_out_of_range", "logits_empty"],
)
def test_bad_request_is_a_clear_error_and_the_engine_still_works(loaded, ref, request_kind):
    call, message = {
        "ids_out_of_range": (lambda: generate(loaded, tokens=[1, VOCAB]), r"out of range 0\.\.999: \[1000\]"),
        "negative_id": (lambda: generate(loaded, tokens=[-3, 4]), r"out of range 0\.\.999: \[-3\]"),
        "empty_ids": (lambda: generate(loaded, tokens=[]), "empty"),
        "empty_prompt": (lambda: generate(loaded, prompt=""), "empty"),
        "logits_out_of_range": (lambda: loaded.logits([2, 5000]), r"out of range 0\.\.999: \[5000\]"),
        "logits_empty": (lambda: loaded.logits([]), "no token ids"),
    }[request_kind]
    with pytest.raises(EngineError, match=message):
        call()
    _, tokens = generate(loaded, tokens=PROMPT, max_tokens=4)
    assert_greedy(ref, PROMPT, tokens)


@pytest.mark.slow
def test_lost_device_is_reported_and_a_reload_opens_a_fresh_one(tiny_path, ref):
    engine = Engine(prefill_chunk=16)
    try:
        engine.load(tiny_path)
        expected = generate(engine, tokens=PROMPT, max_tokens=6)
        old_device = engine.device
        old_device.destroy()
        with pytest.raises(gpu.GPUDeviceLostError, match="lost|gone"):
            generate(engine, tokens=PROMPT[:-1], max_tokens=6)
        with pytest.raises(EngineError, match="device was lost"):
            generate(engine, tokens=PROMPT, max_tokens=6)
        engine.load(tiny_path)
        assert engine.device is not old_device
        assert generate(engine, tokens=PROMPT, max_tokens=6) == expected

        # destroyed between loads, with no request in between: the next load still works
        engine.device.destroy()
        engine.load(tiny_path)
        assert generate(engine, tokens=PROMPT, max_tokens=6) == expected
    finally:
        engine.close()


def test_tensor_over_the_binding_limit_is_refused_before_any_upload(tmp_path, tiny_path, ref):
    """The fused gate/up matrix (2 x 1536 x 256 / 4 = 196608 bytes) exceeds a 160 KiB binding limit.
    Ternary weights are not sharded (real models' largest is 8.8 MB, far below any WebGPU device's
    limit), so the engine refuses the model by name before uploading anything, and stays usable. The
    embedding (512 KB) is sharded under the same limit, so the tiny model still loads."""
    limit = 160 * 1024
    path = str(tmp_path / "wide_ffn.gguf")
    random_bitnet_writer(path, **dict(TINY, ffn_dim=1536)).write()
    engine = Engine(max_binding_size=limit, prefill_chunk=16)
    try:
        with pytest.raises(gpu.GPUOutOfMemoryError, match=r"ffn_gate \+ ffn_up .* 196608 bytes") as info:
            engine.load(path)
        assert str(limit) in str(info.value) and "wide_ffn.gguf" in str(info.value)
        assert engine.model is None and engine.device.live_buffers == 0  # nothing was half-uploaded
        assert_recovers(engine, tiny_path, ref)
        assert len(engine.model.output.shards) > 1
    finally:
        engine.close()
