"""Speculative decoding on the GPU (lavapipe): the draft and acceptance kernels against model/speculation.py,
and the engine's greedy output with drafts equal to plain greedy decoding, stops included.

The acceptance counts are checked against an independent host simulation: model/speculation.py's
rules run over the plain greedy reply give exactly how many tokens each verify step drafts and
accepts, so a GPU loop that drafted from the wrong history, or counted wrongly, disagrees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bitnet_web.bench import NoDrafts, speculation_policy_bench
from bitnet_web.engine import Engine, EngineError
from bitnet_web.kernels.speculative import NO_BUDGET, STOP_IDS_MAX, GreedyAccept, SpecBuffers, SpecDraft
from bitnet_web.model.speculation import NGRAM_MAX, SpeculationPolicy, accept_greedy, prompt_lookup_draft
from bitnet_web.text.sampler import Sampler, SamplerSettings

pytestmark = pytest.mark.gpu

GREEDY = SamplerSettings(temperature=0)
CONTEXT = 96
# Untied head and a small vocabulary: the random model soon repeats a short cycle, which prompt
# lookup drafts, so verify steps accept several tokens and also reject some.
TINY = dict(
    dim=128,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=256,
    vocab_size=300,
    context_length=CONTEXT,
    untied=True,
    seed=3,
)
PREFILL_CHUNK = 16  # the engine fixture's, loaded from tiny_path (tests/conftest.py)
PROMPT = [5, 30, 31, 77, 90, 12, 13, 14, 30, 31, 77]
BUNDLED = os.path.join(os.path.dirname(__file__), "..", "static", "models", "bitnet-pystdlib-27m-i2_s.gguf")


def simulate(
    prompt: list[int], reply: list[int], k: int, context: int = CONTEXT, lengths: list[int] | None = None
) -> tuple[int, int]:
    """(draft_proposed, draft_accepted) of speculative greedy decoding whose reply is `reply`: the first
    token comes from the prompt's logits, then every verify step drafts from the history and accepts the
    drafted tokens equal to the reply's next ones (counted as far as the reply goes), until a step's
    k + 1 rows at position len(history) - 1 would pass the context (plain steps from there). `lengths`
    gets each step's draft length."""
    history, i, proposed, accepted = list(prompt) + reply[:1], 1, 0, 0
    while i < len(reply) and len(history) + k <= context:
        draft = prompt_lookup_draft(history, k)
        chosen = reply[i : i + len(draft) + 1]
        n = 0
        while n < min(len(draft), len(chosen)) and draft[n] == chosen[n]:
            n += 1
        take = min(n + 1, len(reply) - i)
        proposed += len(draft)
        if lengths is not None:
            lengths.append(len(draft))
        accepted += min(n, take)
        history += reply[i : i + take]
        i += take
    return proposed, accepted


def generate(engine: Engine, prompt: list[int], speculate: int, **kwargs) -> list[int]:
    engine.reset()
    list(engine.generate(tokens=prompt, settings=GREEDY, speculate=speculate, **kwargs))
    return list(engine.generated_tokens)


@contextlib.contextmanager
def policy_of(engine: Engine, **parameters):
    """Speculative replies under SpeculationPolicy(k, **parameters) (None: every step verifies); yields
    the list of the policies built."""
    saved, built = engine.speculation_policy, []

    def make(k: int) -> SpeculationPolicy:
        built.append(SpeculationPolicy(k, **parameters))
        return built[-1]

    engine.speculation_policy = make
    try:
        yield built
    finally:
        engine.speculation_policy = saved


@contextlib.contextmanager
def fixed_k(engine: Engine):
    """Every verify step that fits runs (no policy): what `simulate` counts."""
    saved, engine.speculation_policy = engine.speculation_policy, None
    try:
        yield
    finally:
        engine.speculation_policy = saved


def read(device, buffer, n: int) -> list[int]:
    return device.read_sync(buffer, 0, 4 * n).view(np.uint32).tolist()


# Kernels -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("k", "drafted"), [(1, 1), (4, 4), (8, 8), (4, 0)])
def test_draft_kernel_is_prompt_lookup_draft(device, kernels, k, drafted):
    """Random histories over small alphabets (matches of every n-gram length, none, at the ends),
    each with a previous step's output (up to k + 1 tokens) to fold in first: the kernel's history,
    draft, verify rows and StepParams must be the host rule's. drafted = 0: the draft-off step's
    kernel on buffers for drafts of k (the fold, one row, no draft). Each case also has a token budget
    (or none) and stop ids (some among the folded tokens): a fold that uses up the budget or holds a
    stop id ends the reply, and the step is then empty (0 rows, no draft) with the budget at 0."""
    rng = np.random.default_rng(k + drafted)
    buffers = SpecBuffers(device, k, 300)
    token_ids = device.buffer(4 * (k + 1), label="token ids")
    step_params = device.buffer(16, label="step params")  # storage (and readable here)
    draft_op = SpecDraft(kernels, buffers, token_ids, step_params, NGRAM_MAX, k=drafted)
    cases = [(1, 0), (2, 0), (2, 1), (3, 2)] + [
        (int(rng.integers(2, 280)), int(rng.integers(0, k + 2))) for _ in range(30)
    ]
    ended = 0
    for case, (length, n_new) in enumerate(cases):
        alphabet = [2, 3, 5, 50][case % 4]
        history = rng.integers(0, alphabet, length).tolist()
        new = rng.integers(0, alphabet, n_new).tolist()
        budget = None if case % 3 == 0 else int(rng.integers(0, k + 3))
        stops = rng.choice(60, int(rng.integers(0, STOP_IDS_MAX + 1)), replace=False).tolist()
        buffers.start(history, kv_capacity=512, budget=budget, stop_ids=stops)
        device.upload(buffers.out, 0, np.asarray([n_new, *new] + [0] * (k + 1 - n_new), dtype=np.uint32))
        rec = device.begin()
        draft_op.record(rec)
        rec.submit()
        full = history + new
        left = NO_BUDGET if budget is None else budget - min(n_new, budget)
        left = 0 if set(new) & set(stops) else left
        expected = prompt_lookup_draft(full, drafted) if left else []
        ended += not left
        state, draft, rows = (
            read(device, buffers.state, 4),
            read(device, buffers.draft, k),
            read(device, token_ids, drafted + 1),
        )
        step = read(device, step_params, 4)
        assert state[:4] == [len(expected), len(full), 512, left], (case, full, budget, stops)
        assert draft[: len(expected)] == expected, (case, full)
        if left:
            assert rows == [full[-1]] + expected + [full[-1]] * (drafted - len(expected)), (case, full)
        assert step[:3] == [len(expected) + 1 if left else 0, len(full) - 1, 512]  # rows past the draft are skipped
        assert read(device, buffers.history, len(full)) == full
        assert read(device, buffers.out, 1) == [0]  # folded: the next step does not append it again
    assert 5 <= ended <= len(cases) - 5  # both kinds of step were checked
    buffers.release()
    device.release(token_ids)
    device.release(step_params)


def test_greedy_accept_kernel_is_accept_greedy(device, kernels):
    k, vocab = 6, 700
    rng = np.random.default_rng(0)
    buffers = SpecBuffers(device, k, 16)
    logits = device.buffer(4 * vocab * (k + 1), label="logits")
    accept = GreedyAccept(kernels, logits, buffers.draft, buffers.state, buffers.out, vocab, k + 1)
    for case in range(25):
        draft_len = int(rng.integers(0, k + 1))
        chosen = rng.integers(0, vocab, k + 1)
        draft = chosen[:k].copy()
        cut = int(rng.integers(0, k + 1))  # drafts agree with the argmax up to here
        draft[cut:] = (draft[cut:] + rng.integers(1, vocab, k - cut)) % vocab
        values = rng.normal(size=(k + 1, vocab)).astype(np.float32)
        values[np.arange(k + 1), chosen] = 10.0 + case
        device.upload(logits, 0, values)
        device.upload(buffers.draft, 0, draft.astype(np.uint32))
        ended = case % 5 == 4  # a step past the reply's end (no budget left) emits nothing
        device.upload(buffers.state, 0, np.asarray([draft_len, 1, 1, 0 if ended else 1 + case], dtype=np.uint32))
        device.upload(buffers.out, 0, np.full(k + 2, 77, dtype=np.uint32))
        rec = device.begin()
        accept.record(rec, k + 1)
        rec.submit()
        out = read(device, buffers.out, k + 2)
        n_accepted, tokens = accept_greedy(draft[:draft_len].tolist(), chosen.tolist())
        if ended:
            assert out == [0] + [77] * (k + 1)
            continue
        assert out[0] == n_accepted + 1 == len(tokens)
        assert out[1 : 1 + out[0]] == tokens
    accept.release(device)
    buffers.release()
    device.release(logits)


# The engine ----------------------------------------------------------------------------------------


@contextlib.contextmanager
def gpu_kernels(engine: Engine, on: bool):
    """With `on`, every BitLinear runs a discrete GPU's kernels (the fused norm + GEMV for decode and
    verify rows, the split path for verify steps of long drafts, as on a large model) on this CPU
    adapter, which otherwise picks the separate norm dispatch."""
    ops = [op for layer in engine.model.layer_ops for op in (layer.qkv, layer.wo, layer.gate_up, layer.down)]
    before = [(op.fuse_decode, op.split_pays) for op in ops]
    for op in ops:
        op.fuse_decode, op.split_pays = op.fuse_decode or on, op.split_pays or on
    try:
        yield
    finally:
        for op, (fused, split) in zip(ops, before, strict=True):
            op.fuse_decode, op.split_pays = fused, split


@pytest.mark.parametrize(("batching", "kernels"), [((1, 2), "adapter"), ((3, 2), "adapter"), ((3, 2), "gpu")])
def test_speculative_greedy_equals_plain_greedy_with_host_counts(engine, batching, kernels):
    """Up to the context end (the last steps run plain: a verify step no longer fits), for drafts of
    1, 4 and 8 tokens and several verify steps per submit: the same tokens, stop reason and cache, and
    the draft counts of the host simulation; with this adapter's kernels and with a GPU's."""
    with gpu_kernels(engine, kernels == "gpu"):
        _speculative_greedy_equals_plain_greedy(engine, batching)


def _speculative_greedy_equals_plain_greedy(engine: Engine, batching: tuple[int, int]) -> None:
    plain = generate(engine, PROMPT, 0, max_tokens=CONTEXT)
    assert engine.last_stats.stop_reason == "context_full"
    engine.model.DECODE_BATCHING = batching
    try:
        with fixed_k(engine):
            for k in (1, 4, 8):
                assert generate(engine, PROMPT, k, max_tokens=CONTEXT) == plain, k
                stats = engine.last_stats
                assert stats.stop_reason == "context_full" and engine.model.n_cached == CONTEXT
                assert engine.model.cached_tokens == PROMPT + plain[:-1]
                lengths: list[int] = []
                assert (stats.draft_proposed, stats.draft_accepted) == simulate(PROMPT, plain, k, lengths=lengths), k
                assert stats.speculate == k
                assert stats.draft_length_counts == [lengths.count(d) for d in range(k + 1)], k
        lengths = []
        assert 0 < simulate(PROMPT, plain, 4, lengths=lengths)[1]  # the reply repeats itself: drafts were accepted
        assert 0 < lengths.count(4) < len(lengths)  # full drafts after 3-gram matches, shorter ones after others
    finally:
        del engine.model.DECODE_BATCHING


@pytest.mark.parametrize("batching", [(1, 2), (3, 2)])
def test_policy_switching_both_ways_keeps_greedy_output(engine, batching):
    """A policy with a short window turns verify steps off while the reply does not repeat and back on
    when it does, several times: the reply, stop reason and cache are plain decoding's, every token is
    counted once (first token + verified + draft-off), and the draft history the GPU folded through
    both kinds of step is the text."""
    plain = generate(engine, PROMPT, 0, max_tokens=CONTEXT)
    engine.model.DECODE_BATCHING = batching
    try:
        with policy_of(engine, window=2) as policies:
            assert generate(engine, PROMPT, 4, max_tokens=CONTEXT) == plain
        stats, model = engine.last_stats, engine.model
        switches = [on for _, on in policies[-1].switches]
        assert switches.count(False) >= 2 and switches.count(True) >= 2, policies[-1].switches
        assert stats.stop_reason == "context_full" and model.cached_tokens == PROMPT + plain[:-1]
        assert 1 + stats.verify_steps + stats.draft_accepted + stats.plain_steps == stats.n_generated
        assert stats.verify_steps > 0 and stats.plain_steps > 0
        buffers = model.speculation_buffers(4)
        folded = read(model.device, buffers.state, 2)[1]  # the history's length after the last step's fold
        assert folded >= CONTEXT - 1
        assert read(model.device, buffers.history, folded) == (PROMPT + plain)[:folded]
    finally:
        del engine.model.DECODE_BATCHING


@pytest.mark.parametrize("window", [None, 2])
def test_stops_are_exact_and_the_next_reply_is_a_fresh_engines(engine, tiny_path, window):
    """max_tokens ending inside a verify step's accepted run, a stop string, an end-of-text token: the
    reply ends where plain decoding's does, the cache keeps prompt + reply (minus its last token), and a
    follow-up reusing that cache equals a fresh engine's reply to the same tokens. window None: every
    step verifies (the draft counts are the host simulation's); 2: a policy that switches between
    verify and plain steps several times in the reply, so the stops also fall after switches."""
    plain = generate(engine, PROMPT, 0, max_tokens=60)
    proposed, accepted = simulate(PROMPT, plain[:40], 4)
    assert accepted >= 4  # several accepted runs for max_tokens to cut
    fresh = Engine(prefill_chunk=16)
    fresh.load(tiny_path)
    engine.model.DECODE_BATCHING = (2, 2)
    cuts = (2, 5, 9, 14, 23) if window is None else (2, 9, 23, 37, 44, 51, 57)
    policies = contextlib.ExitStack()
    built = policies.enter_context(fixed_k(engine) if window is None else policy_of(engine, window=window))
    try:
        for max_tokens in cuts:
            got = generate(engine, PROMPT, 4, max_tokens=max_tokens)
            assert got == plain[:max_tokens]
            if window is None:
                counts = (engine.last_stats.draft_proposed, engine.last_stats.draft_accepted)
                assert counts == simulate(PROMPT, got, 4)
            cached = engine.model.cached_tokens
            assert cached[: len(PROMPT) + max_tokens - 1] == PROMPT + got[:-1]
            follow_up = PROMPT + got + [7]
            list(engine.generate(tokens=follow_up, settings=GREEDY, speculate=4, max_tokens=6))
            assert engine.last_stats.n_reused_tokens >= len(PROMPT) + max_tokens - 1
            assert engine.generated_tokens == generate(fresh, follow_up, 0, max_tokens=6)
        # end of text: make a token the reply repeats a stop token
        eos = plain[12]
        tokenizer = engine.tokenizer
        saved = tokenizer.stop_ids
        tokenizer.stop_ids = saved | {eos}
        try:
            got = generate(engine, PROMPT, 4, max_tokens=60)
            assert engine.last_stats.stop_reason == "eos"
            assert got == plain[: plain.index(eos)]
        finally:
            tokenizer.stop_ids = saved
        # a stop string: the text of a later stretch of the reply
        text = tokenizer.decode(plain)
        stop = tokenizer.decode(plain[20:22])
        engine.reset()
        pieces = "".join(
            engine.generate(tokens=PROMPT, settings=GREEDY, speculate=4, stop_strings=[stop], max_tokens=60)
        )
        assert engine.last_stats.stop_reason == "stop_string"
        assert pieces == text[: text.index(stop)]
        follow_up = PROMPT + engine.generated_tokens + [9]
        list(engine.generate(tokens=follow_up, settings=GREEDY, speculate=4, max_tokens=6))
        assert engine.generated_tokens == generate(fresh, follow_up, 0, max_tokens=6)
        if window is not None:
            assert {on for policy in built for _, on in policy.switches} == {False, True}
    finally:
        policies.close()
        del engine.model.DECODE_BATCHING
        fresh.close()


@pytest.mark.parametrize("end", ["max_tokens", "eos"])
def test_steps_queued_past_the_reply_end_do_nothing(engine, end):
    """16 steps a submit queue far past the end of a short reply; the GPU ends the reply itself (its
    token budget, or a stop id it was given), so those steps emit nothing and fold nothing: once the
    queue has drained, the GPU's history is the prompt plus the tokens of the steps up to the end (at
    most a draft past it), and the last step emitted nothing. The reply and the cache are plain
    decoding's (and a follow-up reply reusing the cache equals a fresh prefill's)."""
    plain = generate(engine, PROMPT, 0, max_tokens=48)
    model = engine.model
    model.DECODE_BATCHING = (16, 2)
    tokenizer, saved = engine.tokenizer, engine.tokenizer.stop_ids
    k = 4
    try:
        with fixed_k(engine):
            if end == "eos":
                eos = plain[14]
                last = plain.index(eos)  # the reply is plain[:last]; the steps emitted plain[1 .. last]
                tokenizer.stop_ids = saved | {eos}
                got = generate(engine, PROMPT, k, max_tokens=48)
                assert got == plain[:last] and engine.last_stats.stop_reason == "eos"
            else:
                last = 29  # the steps' budget: max_tokens - 1 (the first token comes from the prompt)
                got = generate(engine, PROMPT, k, max_tokens=last + 1)
                assert got == plain[: last + 1] and engine.last_stats.stop_reason == "max_tokens"
            buffers = model.speculation_buffers(k)
            state = read(model.device, buffers.state, 4)  # waits for every queued step
            # the last queued step was empty, so the steps ran out of budget before the queue did
            assert state[3] == 0 and read(model.device, buffers.out, 1) == [0]
            stats = engine.last_stats
            assert stats.launched_steps > stats.verify_steps + stats.plain_steps  # steps queued past the end
            folded = state[1]  # the prompt, the first token and the steps' tokens up to the end
            assert len(PROMPT) + 1 + last <= folded <= len(PROMPT) + 1 + last + k  # no step past the end emitted
            assert read(model.device, buffers.history, folded) == (PROMPT + plain)[:folded]
            follow_up = PROMPT + got + [7]
            list(engine.generate(tokens=follow_up, settings=GREEDY, speculate=k, max_tokens=6))
            assert engine.last_stats.n_reused_tokens >= len(PROMPT) + len(got) - 1
            reused = list(engine.generated_tokens)
            assert reused == generate(engine, follow_up, 0, max_tokens=6)
    finally:
        tokenizer.stop_ids = saved
        del model.DECODE_BATCHING


@pytest.mark.parametrize("end", ["limit", "stop_id"])
def test_reading_past_the_gpu_end_of_a_reply_reopens_it(engine, end):
    """A caller of the model's loop that reads on past its `limit`, or past a stop id, gets plain greedy
    decoding's tokens all the same, and the cache stays consistent."""
    plain = generate(engine, PROMPT, 0, max_tokens=48)
    model = engine.model
    model.DECODE_BATCHING = (16, 2)
    limit, stop_ids = (40, ()) if end == "limit" else (None, [plain[24]])

    async def reply() -> list[int]:
        model.truncate(0)
        await model.prefill(PROMPT[:-1])
        steps = model.decode_speculative(PROMPT[-1], 4, limit=limit, stop_ids=stop_ids)
        tokens = []
        async for token in steps:
            tokens.append(token)
            if len(tokens) == 45:
                break
        await steps.aclose()
        return tokens

    try:
        assert engine._run(reply()) == plain[:45]
        assert model.idle_steps > 0  # steps past the end were read and skipped
        assert model.launched_steps >= model.verify_steps + model.plain_steps + model.idle_steps
        cached = model.cached_tokens
        assert cached == (PROMPT + plain)[: len(cached)] and len(cached) >= len(PROMPT) + 43
    finally:
        del model.DECODE_BATCHING


def test_bad_speculate_is_a_clear_error(engine, tiny_path):
    with pytest.raises(EngineError, match="speculate takes 0"):
        list(engine.generate(tokens=PROMPT, settings=GREEDY, speculate=9, max_tokens=3))
    assert generate(engine, PROMPT, 2, max_tokens=3) == generate(engine, PROMPT, 0, max_tokens=3)
    narrow = Engine(prefill_chunk=4)  # logits for 4 rows at a time: drafts of at most 3
    try:
        narrow.load(tiny_path)
        with pytest.raises(EngineError, match="speculate=4 verifies 5 rows per step.*prefill_chunk is 4"):
            list(narrow.generate(tokens=PROMPT, settings=GREEDY, speculate=4, max_tokens=3))
        assert generate(narrow, PROMPT, 3, max_tokens=8) == generate(engine, PROMPT, 0, max_tokens=8)
    finally:
        narrow.close()


@pytest.mark.parametrize(("window", "max_tokens"), [(SpeculationPolicy.WINDOW, 30), (3, 70)])
def test_sampled_replies_draft_too_and_repeat_for_a_seed(engine, tiny_path, window, max_tokens):
    """Settings sampled on the GPU go through the speculative sampling rule (its distribution is tested
    in tests/test_spec_sampling.py): a seed gives the same reply, counts and policy switches again,
    drafts are made and some accepted, max_tokens holds, and the cache it leaves serves a follow-up as
    a fresh engine would. Window 3: the policy switches to plain steps and back in the reply."""
    sampled = SamplerSettings(temperature=0.7, top_k=10, seed=6)
    runs = []
    with policy_of(engine, window=window) as policies:
        for _ in range(2):
            engine.reset()
            list(engine.generate(tokens=PROMPT, settings=sampled, speculate=4, max_tokens=max_tokens))
            stats = engine.last_stats
            runs.append((list(engine.generated_tokens), stats.draft_proposed, stats.draft_accepted, stats.plain_steps))
            assert stats.speculate == 4 and stats.token_choice == "gpu_sample"
    assert runs[0] == runs[1] and runs[0][1] > 0 and policies[0].switches == policies[1].switches
    if window == 3:
        assert {on for _, on in policies[0].switches} == {False, True}, policies[0].switches
    reply = runs[0][0]
    assert len(reply) == max_tokens or engine.last_stats.stop_reason == "eos"
    assert engine.model.cached_tokens[: len(PROMPT) + len(reply) - 1] == PROMPT + reply[:-1]
    follow_up = PROMPT + reply + [7]
    list(engine.generate(tokens=follow_up, settings=GREEDY, speculate=0, max_tokens=5))
    assert engine.last_stats.n_reused_tokens == len(PROMPT) + len(reply) - 1
    fresh = Engine(prefill_chunk=16)
    try:
        fresh.load(tiny_path)
        assert engine.generated_tokens == generate(fresh, follow_up, 0, max_tokens=5)
    finally:
        fresh.close()


def test_sampled_steps_of_both_kinds_take_two_draws_per_token(engine):
    """kernels/spec_sampling.SpecSampleAccept decides every step of a sampled speculative reply, verify
    steps and draft-off ones (where a short-window policy turns drafts off, and near the context end)
    alike: the GPU's draw counter ends two draws per token past the first, a seed gives the same tokens
    again, every token is in the vocabulary, and the policy switched both ways."""
    model, k = engine.model, 3
    settings = SamplerSettings(temperature=0.8, top_k=20, seed=11)

    async def run() -> tuple[list[int], int, SpeculationPolicy, tuple[int, int]]:
        model.truncate(0)
        sampler = Sampler(settings)
        tokens = [sampler.sample(await model.prefill(PROMPT), PROMPT)]
        policy = SpeculationPolicy(k, window=3)
        history = PROMPT + tokens
        stream = model.decode_speculative_sampled(tokens[0], k, settings, sampler.seed, 5, history, policy=policy)
        async for token in stream:
            tokens.append(token)
            history.append(token)
        op = model._spec_samplers[k]
        counter = int(model.device.read_sync(op.state, 0, 4).view(np.uint32)[0])
        return tokens, counter, policy, (model.verify_steps, model.plain_steps)

    tokens, counter, policy, (verify_steps, plain_steps) = engine._run(run())
    assert model.n_cached == CONTEXT and len(tokens) == CONTEXT - len(PROMPT) + 1
    assert all(0 <= t < TINY["vocab_size"] for t in tokens) and len(set(tokens)) > 5
    assert counter == 5 + 2 * (len(tokens) - 1)
    assert verify_steps > 0 and plain_steps > 0
    assert [on for _, on in policy.switches][:2] == [False, True], policy.switches
    again = engine._run(run())
    assert again[:2] == (tokens, counter) and again[2].switches == policy.switches


def test_policy_bench_rows_decode_the_same_greedy_tokens(engine):
    """bench.speculation_policy_bench on this engine: every mode (plain, drafts at every step, the
    default policy, draft-off steps only) runs, and the greedy rows give plain decoding's tokens."""
    report = engine._run(speculation_policy_bench(engine, PROMPT, 24, 1))
    for name in ("sampled_t1", "greedy", "sampled_top1"):
        assert set(report[name]) == {"plain", "every_step", "policy", "draft_off"}
    greedy = report["greedy"]
    assert all(row["same_tokens_as_plain"] for row in greedy.values())
    assert greedy["draft_off"]["verify_steps"] == 0 and greedy["draft_off"]["plain_steps"] == 23
    assert greedy["every_step"]["verify_steps"] > 0 and greedy["every_step"]["plain_steps"] == 0


@pytest.mark.slow
def test_bundled_model_completes_code_identically_with_drafts():
    """The trained model continuing a list of similar dict literals (its reply copies their structure):
    the same tokens with drafts of 4, most drafted tokens accepted, counts as the host simulation's."""
    engine = Engine()
    try:
        engine.load(BUNDLED)
        prompt = engine.encode_prompt(
            "USERS = [\n"
            '    {"name": "alice", "age": 31, "email": "alice@example.com"},\n'
            '    {"name": "bob", "age": 27, "email": "bob@example.com"},\n'
            '    {"name": "carol",'
        )
        plain = generate(engine, prompt, 0, max_tokens=24)
        with fixed_k(engine):
            got = generate(engine, prompt, 4, max_tokens=24)
        assert got == plain
        stats = engine.last_stats
        assert (stats.draft_proposed, stats.draft_accepted) == simulate(prompt, plain, 4, 512)
        assert stats.draft_accepted > stats.draft_proposed // 3
    finally:
        engine.close()


@pytest.mark.slow
def test_cli_speculate_json(tiny_path):
    def run(*extra: str) -> subprocess.CompletedProcess:
        args = ["generate", "--model", tiny_path, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", "20"]
        return subprocess.run(
            [sys.executable, "-m", "bitnet_web", *args, *extra], capture_output=True, text=True, timeout=300
        )

    on, off = run("--speculate", "4", "--json"), run("--speculate", "0", "--json")
    assert on.returncode == 0 == off.returncode, on.stderr + off.stderr
    on, off = json.loads(on.stdout), json.loads(off.stdout)
    assert on["tokens"] == off["tokens"] and on["text"] == off["text"]
    # the default policy may turn verify steps off, so the counts are checked by their sum: the first
    # token, then each verify step's own token and accepted drafts, and the plain steps' tokens (the
    # last verify step may be cut by max_tokens after its accepted drafts)
    stats = on["stats"]
    counted = 1 + stats["verify_steps"] + on["draft_accepted"] + stats["plain_steps"]
    assert len(on["tokens"]) <= counted <= len(on["tokens"]) + 1 and stats["verify_steps"] > 0
    assert on["draft_accepted"] <= on["draft_proposed"] == stats["draft_proposed"]
    assert off["draft_proposed"] == off["draft_accepted"] == 0
    bad = run("--speculate", "9")
    assert bad.returncode == 2 and "--speculate takes 0 (off) to 8" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_engine_policy_prices_verify_steps_at_the_cached_context(engine, tiny_path):
    """The engine's policy for a reply prices verify steps at the context the reply starts from:
    BitNetModel.attention_share is the KV bytes a step's attention reads per weight byte, linear in
    the context (f16 K and V of every layer against the GGUF's tensors)."""
    model = engine.model
    cfg = model.config
    kv_per_token = cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * 2
    weights = sum(t.n_bytes for t in model.gguf.tensors.values())
    assert 0.5 * os.path.getsize(tiny_path) < weights <= os.path.getsize(tiny_path)
    assert model.attention_share(0) == 0
    assert model.attention_share(80) == pytest.approx(80 * kv_per_token / weights)
    costs = []
    for n in (4, 80):
        model.truncate(0)
        asyncio.run(model.prefill(list(range(n))))
        costs.append(engine._backend_policy(2).verify_cost)
    assert costs[0] < costs[1]
    model.truncate(0)


def test_a_profiled_verify_step_times_each_dispatch_of_the_recorded_step(tiny_path):
    """bench.profile_verify_step (the bench page's kernel profiles) times every dispatch of a verify step
    as the decode loop records it, its draft kernel first, and leaves the cache and the next reply as
    they were."""
    from bitnet_web import gpu
    from bitnet_web.bench import profile_decode_step, profile_verify_step

    engine = Engine(prefill_chunk=PREFILL_CHUNK)
    engine.device = gpu.open_device(profile=True)
    try:
        assert engine.device.profiling, "lavapipe offers timestamps inside passes"
        engine.load(tiny_path)
        plain = generate(engine, PROMPT, 0, max_tokens=20)
        model = engine.model
        model.truncate(0)
        asyncio.run(model.prefill(PROMPT[:-1]))
        cached = list(model.cached_tokens)
        staging = model.device.staging(64, "log")
        for k in (1, 4):
            profile = asyncio.run(profile_verify_step(model, k, PROMPT[-1]))
            ops = model._speculation_ops(k)
            recorded = model._record_verify_steps(k, 1, k + 1, staging, model.n_cached, ops.greedy)
            assert len(profile) == recorded.dispatches and profile[0][0].startswith("spec_draft"), profile[:3]
            assert all(us >= 0 for _, us in profile)
        decode = asyncio.run(profile_decode_step(model))
        step = model._record_step(1, all_logits=False)
        model.argmax.record(step)
        assert len(decode) == step.dispatches and decode[-1][0].startswith("argmax"), decode[-3:]
        assert model.cached_tokens == cached
        assert generate(engine, PROMPT, 0, max_tokens=20) == plain
    finally:
        engine.close()


def test_the_default_draft_size_is_built_at_load(tiny_path, monkeypatch):
    """The engine's default draft size gets its verify steps' ops at load (in the upload's pipeline
    batch: in a browser they compile while the file uploads), so the first speculative reply, greedy or
    sampled, builds no kernel; another draft size still builds its own on first use."""
    monkeypatch.setattr(Engine, "speculate_for", lambda self, speculate=-1: 3 if speculate == -1 else speculate)
    engine = Engine(prefill_chunk=PREFILL_CHUNK)
    engine.load(tiny_path)
    try:
        built: list[str] = []
        make = engine.device.pipeline

        def counted(wgsl, label, entry_point="main"):
            built.append(label)
            return make(wgsl, label, entry_point)

        engine.device.pipeline = counted
        sampled = SamplerSettings(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=2)
        for settings in (GREEDY, sampled):
            engine.reset()
            list(engine.generate(tokens=PROMPT, settings=settings, speculate=3, max_tokens=12))
            assert engine.last_stats.speculate == 3 and built == [], built
        engine.reset()
        list(engine.generate(tokens=PROMPT, settings=GREEDY, speculate=2, max_tokens=12))
        assert any(label.startswith("spec_draft") for label in built), built
    finally:
        engine.close()


def test_the_screened_head_picks_the_same_greedy_tokens(engine, tiny_path):
    """Greedy replies through the int8-screened head (kernels/head_screen.py, forced on: a CPU adapter
    leaves it off by default) equal the F16 head's, plain and with every step verifying a draft (whose
    verify rows go through the screen too, all rows at once)."""
    assert engine.model.screened_argmax is None  # the module's engine: lavapipe, a small head
    screened = Engine(prefill_chunk=PREFILL_CHUNK, screened_head=True)
    try:
        screened.load(tiny_path)
        assert screened.model.screened_argmax is not None and screened.info["screened_head"]
        # a screened decode step reads the int8 copy (+ a scale and two norms a row), not the F16 head
        model, head = screened.model, screened.model.output
        int8_copy = head.n_rows * (head.n_cols + 12)
        assert model.decode_bytes_per_token == model.weight_bytes_per_token - 2 * head.n_rows * head.n_cols + int8_copy
        assert engine.model.decode_bytes_per_token == engine.model.weight_bytes_per_token
        prompts = [PROMPT, [7, 8, 9, 10, 7, 8, 9, 10, 7, 8], list(range(100, 140))]
        greedy = model._speculation_ops(4).greedy
        assert greedy.verify_screen is not None
        verified, record_rows = [], greedy.record_rows_screened
        greedy.record_rows_screened = lambda rec, n: verified.append(n) or record_rows(rec, n)
        for prompt in prompts:
            plain = generate(engine, prompt, 0, max_tokens=40)
            assert generate(screened, prompt, 0, max_tokens=40) == plain
            with fixed_k(screened):
                assert generate(screened, prompt, 4, max_tokens=40) == plain
        assert verified and set(verified) == {5}
        # sampled decode steps through the screen (its candidates, then one draw) draw the same tokens;
        # a penalty below 1 takes the F16 head
        screen, made = screened.model.screened_argmax, []
        record_candidates = screen.record_candidates
        screen.record_candidates = lambda rec: made.append(1) or record_candidates(rec)
        sampled = SamplerSettings(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=3)
        for settings in (sampled, SamplerSettings(temperature=1.2, top_k=64, seed=4)):
            for prompt in prompts:
                replies = []
                for e in (engine, screened):
                    e.reset()
                    list(e.generate(tokens=prompt, settings=settings, speculate=0, max_tokens=30))
                    replies.append(list(e.generated_tokens))
                assert replies[0] == replies[1]
        assert len(made) >= 2 * len(prompts)
        made.clear()
        screened.reset()
        list(screened.generate(tokens=PROMPT, settings=SamplerSettings(repetition_penalty=0.9, seed=1), max_tokens=8))
        assert not made
        # speculative replies' draft-off steps (one row, no draft) through the screen: the same tokens as
        # the F16 head's draft-off steps, greedy and sampled (the speculative sampler's own draws), with
        # every step draft-off and with the policy's mix of verify and draft-off steps
        # sampled verify steps: their rows' logits through the screen (every row the sampler's top-k can
        # reach, bit for bit; -inf elsewhere), so the speculative sampler draws the same tokens
        sampler_op = screened.model._spec_sampler(4)
        assert sampler_op.verify_screen is not None
        sampled_rows, record_sampled = [], sampler_op.record_rows_screened
        sampler_op.record_rows_screened = lambda rec, n: sampled_rows.append(n) or record_sampled(rec, n)
        for settings in (sampled, SamplerSettings(temperature=1.2, top_k=64, repetition_penalty=1.0, seed=4)):
            for prompt in prompts:
                replies = []
                for e in (engine, screened):
                    e.reset()
                    with fixed_k(e):
                        list(e.generate(tokens=prompt, settings=settings, speculate=4, max_tokens=30))
                    replies.append(list(e.generated_tokens))
                assert replies[0] == replies[1], (settings.top_k, prompt[:3])
        assert sampled_rows and set(sampled_rows) == {5}
        saved = {e: e.speculation_policy for e in (engine, screened)}
        try:
            for policy in (NoDrafts, SpeculationPolicy):
                for e in (engine, screened):
                    e.speculation_policy = policy
                for settings in (GREEDY, sampled):
                    for prompt in prompts:
                        made.clear()
                        replies = []
                        for e in (engine, screened):
                            e.reset()
                            list(e.generate(tokens=prompt, settings=settings, speculate=4, max_tokens=30))
                            replies.append(list(e.generated_tokens))
                        assert replies[0] == replies[1], (policy.__name__, settings.temperature, prompt[:3])
                        if policy is NoDrafts and settings is sampled:
                            assert made  # the screened engine's draft-off steps drew from its candidates
        finally:
            for e, policy in saved.items():
                e.speculation_policy = policy
    finally:
        screened.close()
