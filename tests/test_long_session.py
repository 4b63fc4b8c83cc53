"""Long chat sessions in CPython (lavapipe): 200 turns with the context filling up, the context policy
(`engine.fit_chat_to_context`: drop the oldest turns, keep the system prompt and the latest turn),
bounded GPU buffers and Python memory, and abort() stopping every kind of generation.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
from shapes import SMALL_SHAPE

from bitnet_web.engine import Engine, EngineError, fit_chat_to_context  # noqa: E402
from bitnet_web.text.sampler import SamplerSettings  # noqa: E402

CONTEXT = 128
TINY = dict(SMALL_SHAPE, context_length=CONTEXT, untied=True, seed=11)
SYSTEM = {"role": "system", "content": "You are terse."}
GREEDY = SamplerSettings(temperature=0)
SAMPLED = SamplerSettings(temperature=1.0, top_k=50, seed=7)


# ---------------------------------------------------------------------------------------------
# The policy on its own (no GPU): a token count of 1 per character plus 2 per message
# ---------------------------------------------------------------------------------------------


def count_chars(messages: list[dict]) -> int:
    return sum(len(m["content"]) + 2 for m in messages)


def conversation(n_turns: int, rng: random.Random, system: bool = True) -> list[dict]:
    msgs = [dict(SYSTEM)] if system else []
    for t in range(n_turns):
        msgs.append({"role": "user", "content": f"u{t}" + "x" * rng.randrange(0, 30)})
        msgs.append({"role": "assistant", "content": f"a{t}" + "y" * rng.randrange(0, 30)})
    return msgs


@pytest.mark.parametrize("system", [True, False])
def test_policy_keeps_system_and_latest_turn_and_fits(system):
    rng = random.Random(1)
    budget = 200
    previous_cut = None
    cut_changes = 0
    history = conversation(80, rng, system)
    for n_turns in range(1, 80):
        msgs = history[: len(history) - 2 * (80 - n_turns) - 1]  # ends with the new user message
        kept = fit_chat_to_context(msgs, count_chars, budget)
        assert count_chars(kept) <= budget
        assert kept[-1] is msgs[-1]  # the latest turn is never dropped
        if system:
            assert kept[0] is msgs[0]  # nor the system prompt
        tail = kept[1:] if system else kept
        assert tail == msgs[len(msgs) - len(tail) :]  # only a prefix of the history is dropped
        assert tail[0]["role"] == "user"  # cut at a turn start
        if count_chars(msgs) <= budget:
            assert kept == msgs
        cut = len(msgs) - len(tail)
        if previous_cut is not None and cut != previous_cut:
            cut_changes += 1
        previous_cut = cut
    # Cuts are stable: a turn adds ~34 tokens and a cut moves by about half the budget (100), so the
    # cut changes about every third turn (~25 times), not on every turn (~75).
    assert 10 <= cut_changes <= 35, cut_changes


def test_policy_refuses_a_latest_turn_that_cannot_fit():
    msgs = [dict(SYSTEM), {"role": "assistant", "content": "a"}, {"role": "user", "content": "x" * 500}]
    with pytest.raises(
        EngineError, match="the system prompt and the latest message need 518 tokens, more than the 200"
    ):
        fit_chat_to_context(msgs, count_chars, 200)
    # Over the budget (room kept for the reply) but within the hard limit: the latest turn is used.
    assert fit_chat_to_context(msgs, count_chars, 200, limit=600) == [msgs[0], msgs[2]]
    with pytest.raises(EngineError, match="more than the 517"):
        fit_chat_to_context(msgs, count_chars, 200, limit=517)


def test_policy_history_starting_with_a_reply():
    msgs = [{"role": "assistant", "content": "a" * 150}, {"role": "user", "content": "b" * 20}]
    assert fit_chat_to_context(msgs, count_chars, 100) == msgs[1:]


# ---------------------------------------------------------------------------------------------
# 200 turns through the Engine
# ---------------------------------------------------------------------------------------------


def chat_turn(
    engine: Engine, msgs: list[dict], settings: SamplerSettings, max_tokens: int, abort_after: int | None = None
) -> str:
    pieces = []
    for piece in engine.generate(messages=msgs, settings=settings, max_tokens=max_tokens):
        pieces.append(piece)
        if abort_after is not None and len(pieces) == abort_after:
            engine.abort()
    return "".join(pieces)


def bitnet_web_bytes(snapshot: tracemalloc.Snapshot) -> int:
    """Live bytes allocated by code in bitnet_web (not by this test's growing message list)."""
    return sum(
        s.size for s in snapshot.filter_traces([tracemalloc.Filter(True, "*bitnet_web*")]).statistics("filename")
    )


@pytest.mark.gpu
@pytest.mark.slow
def test_200_turns_stay_bounded_and_follow_the_context_policy(engine, tiny_path):
    device = engine.device
    tok = engine.tokenizer
    rng = random.Random(5)
    msgs = [dict(SYSTEM)]
    stop_reasons: dict[str, int] = {}
    dropped_seen = 0
    baseline = None
    try:
        for turn in range(200):
            if turn == 20:  # after warm-up (staging buffers, caches); the context has been full for a while
                # From here on every Python allocation made by bitnet_web code and still alive at the end
                # is growth (tracing only from here also keeps the test fast).
                tracemalloc.start()
                python_bytes = bitnet_web_bytes(tracemalloc.take_snapshot())
                baseline = (device.live_buffers, device.bytes_allocated, python_bytes)
            words = [rng.choice(["hi", "what", "is", "<b>", "ok", "?"]) for _ in range(rng.randrange(1, 6))]
            msgs.append({"role": "user", "content": f"turn {turn}: " + " ".join(words)})
            kind = turn % 10
            if kind == 3:  # stop after the first piece
                text = chat_turn(engine, msgs, SAMPLED, 40, abort_after=1)
                assert engine.last_stats.stop_reason == "aborted", engine.last_stats
                assert engine.last_stats.n_generated < 40
            elif kind == 7:  # a long reply: runs into the end of the context
                text = chat_turn(engine, msgs, GREEDY, 1000)
                assert engine.last_stats.stop_reason in ("context_full", "eos", "stop_string")
            else:
                text = chat_turn(engine, msgs, GREEDY if turn % 2 else SAMPLED, 4)
                assert engine.last_stats.stop_reason in ("max_tokens", "eos", "stop_string")
            stats = engine.last_stats
            stop_reasons[stats.stop_reason] = stop_reasons.get(stats.stop_reason, 0) + 1
            assert engine.model.n_cached <= CONTEXT
            assert stats.n_prompt_tokens < CONTEXT
            # What was fed: the system prompt first, the latest user message last, and nothing but the
            # oldest messages left out.
            kept = len(msgs) - stats.n_dropped_messages
            assert stats.n_dropped_messages == 0 or stats.n_dropped_messages >= 2
            expected = engine.template.render_tokens(tok, [msgs[0]] + msgs[len(msgs) - kept + 1 :])
            assert engine.encode_chat(msgs, 1000 if kind == 7 else 40 if kind == 3 else 4) == expected
            dropped_seen = max(dropped_seen, stats.n_dropped_messages)
            msgs.append({"role": "assistant", "content": text})
        engine.reset()
        after = (device.live_buffers, device.bytes_allocated, bitnet_web_bytes(tracemalloc.take_snapshot()))
    finally:
        tracemalloc.stop()
    print(
        f"200 turns: stop reasons {stop_reasons}, up to {dropped_seen} messages dropped, GPU buffers "
        f"{baseline[:2]} -> {after[:2]}, bitnet_web Python memory +{after[2] - baseline[2]} bytes"
    )
    assert dropped_seen > 300, "the conversation should have overflowed the context many times over"
    assert stop_reasons.get("aborted") == 20 and stop_reasons.get("context_full", 0) >= 1, stop_reasons
    assert after[:2] == baseline[:2], f"GPU buffers (count, bytes) {baseline[:2]} -> {after[:2]}"
    growth = after[2] - baseline[2]
    assert growth < 1 << 20, f"bitnet_web Python memory grew by {growth} bytes"
    # Still fully usable after the session: a new chat gets the reply a freshly loaded engine gives.
    hello = [dict(SYSTEM), {"role": "user", "content": "hi"}]
    reply = chat_turn(engine, hello, GREEDY, 4)
    assert engine.last_stats.n_reused_tokens == 0 and engine.last_stats.n_dropped_messages == 0
    tokens = list(engine.generated_tokens)
    fresh = Engine(prefill_chunk=32)
    try:
        fresh.load(tiny_path)
        assert chat_turn(fresh, hello, GREEDY, 4) == reply
        assert fresh.generated_tokens == tokens and len(tokens) >= 1
    finally:
        fresh.close()


@pytest.mark.gpu
def test_abort_stops_every_kind_of_generation(engine):
    """Greedy (GPU argmax, pipelined) and sampled decoding, plain prompts and chat, aborted at once or
    later: each stops with stop_reason 'aborted' within one token of the call."""
    for settings in (GREEDY, SAMPLED):
        for after in (1, 3):
            engine.reset()
            pieces = []
            for piece in engine.generate(tokens=[5, 6, 7], settings=settings, max_tokens=60):
                pieces.append(piece)
                if len(pieces) == after:
                    engine.abort()
            stats = engine.last_stats
            assert stats.stop_reason == "aborted" and len(pieces) <= after + 1, (settings, after, stats)
            # No token after the one that completed the last piece before abort() (the stream decoder
            # may hold back part of a character; the tail piece is its flush).
            assert stats.n_generated == len(engine.generated_tokens)
            assert "".join(pieces) == engine.tokenizer.decode(engine.generated_tokens)
            assert "".join(pieces[:after]) and stats.n_generated < 60
    # abort() arriving while the prompt is being prefilled (the browser's worker gets the message
    # between two awaits): generation stops after the first token.
    model = engine.model
    prefill = model.prefill

    async def prefill_then_abort(*args, **kwargs):
        engine.abort()
        return await prefill(*args, **kwargs)

    model.prefill = prefill_then_abort
    try:
        for settings in (GREEDY, SAMPLED):
            engine.reset()
            messages = [dict(SYSTEM), {"role": "user", "content": "hi"}]
            "".join(engine.generate(messages=messages, settings=settings, max_tokens=60))
            assert engine.last_stats.stop_reason in ("aborted", "eos") and engine.last_stats.n_generated <= 1
    finally:
        del model.prefill
    # An abort requested while idle does not leak into the next request.
    engine.abort()
    "".join(engine.generate(tokens=[5, 6, 7], settings=GREEDY, max_tokens=5))
    assert engine.last_stats.stop_reason in ("max_tokens", "eos")
