"""The GPU decode loop stops exactly in the browser: max tokens, EOS, a stop string and Stop give the
CPython engine's text, stop reason and cache, while the worker decodes several steps per submit with
more steps queued than the reply needs (steps queued past a stop must leave no trace).

Reference: the CPython engine (wgpu-py, another WebGPU implementation) on the same GGUF bytes and
batching. The same scenario code runs in both; after each stop a follow-up turn that reuses the
cached prefix must give what a fresh computation of the same prompt gives, so a KV row written by a
step queued past the stop would show.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from browser_helpers import LOCAL_PREFIXES, NO_AUTOLOAD, engine_worker, open_app

pytestmark = pytest.mark.browser

# Untied head: greedy tokens vary (a tied random model repeats its input).
MODEL = dict(
    dim=256, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300, context_length=256, seed=3, untied=True
)
PROMPT_IDS = [5, 17, 42, 99, 123, 7, 250, 64]
BROWSER_BATCHING = (3, 2)  # 3 steps per submit, 2 submits queued: up to 6 steps past a stop
SPECULATE = 3  # largest draft in the speculative runs
# Tied head: the model's greedy reply repeats its prompt, so prompt-lookup drafts are accepted.
COPYING_MODEL = {**MODEL, "untied": False, "seed": 4}

SCENARIOS = """
import json
from bitnet_web.text.sampler import SamplerSettings

PROMPT = PROMPT_IDS_LITERAL
GREEDY = SamplerSettings(temperature=0.0)


async def run(engine, max_tokens, stop_strings=(), eos=None, abort_after=None, speculate=0):
    engine.reset()
    saved = engine.tokenizer.stop_ids
    if eos is not None:  # a token of the reply as the end-of-sequence token
        engine.tokenizer.stop_ids = frozenset({eos})
    pieces = []
    try:
        async for piece in engine.generate_tokens_async(PROMPT, GREEDY, max_tokens, stop_strings, speculate):
            pieces.append(piece)
            if abort_after is not None and len(pieces) == abort_after:
                engine.abort()  # what the worker does on Stop
    finally:
        engine.tokenizer.stop_ids = saved
    model = engine.model
    stats = engine.last_stats
    out = {"text": "".join(pieces), "tokens": list(engine.generated_tokens), "reason": stats.stop_reason,
           "n_cached": model.n_cached, "cached": list(model.cached_tokens),
           "draft_proposed": stats.draft_proposed, "draft_accepted": stats.draft_accepted}
    # The next turn reuses the cached prefix: its reply must equal a fresh computation's.
    follow = out["cached"] + [11]
    async for _ in engine.generate_tokens_async(follow, GREEDY, 4):
        pass
    out["reused"] = engine.last_stats.n_reused_tokens
    out["follow"] = list(engine.generated_tokens)
    engine.reset()
    async for _ in engine.generate_tokens_async(follow, GREEDY, 4):
        pass
    out["follow_fresh"] = list(engine.generated_tokens)
    return out


async def scenarios(engine, eos, stop_string, speculate=0):
    return {
        "full": await run(engine, 20, speculate=speculate),
        "max_tokens": await run(engine, 7, speculate=speculate),
        "eos": await run(engine, 20, eos=eos, speculate=speculate),
        "stop_string": await run(engine, 20, stop_strings=[stop_string], speculate=speculate),
        "stop_button": await run(engine, 20, abort_after=5, speculate=speculate),
    }


async def repeats(engine, speculate=0):  # a model that copies its prompt: drafts get accepted
    return {
        "full": await run(engine, 24, speculate=speculate),
        "max_tokens": await run(engine, 9, speculate=speculate),
        "stop_button": await run(engine, 24, abort_after=7, speculate=speculate),
    }
"""


def cpython_scenarios(path: str, eos: int | None = None, stop_string: str = "\\0", copying: bool = False) -> dict:
    from bitnet_web.engine import Engine

    namespace: dict = {}
    exec(SCENARIOS.replace("PROMPT_IDS_LITERAL", repr(PROMPT_IDS)), namespace)
    engine = Engine()
    engine.load(path)
    engine.model.DECODE_BATCHING = BROWSER_BATCHING
    try:
        if copying:
            return engine._run(namespace["repeats"](engine))
        return engine._run(namespace["scenarios"](engine, eos, stop_string))
    finally:
        engine.close()


def in_thread(fn, *args):
    """Run the CPython engine off the test's thread (Playwright's sync API owns this one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from bitnet_web.convert.synthetic import write_random_bitnet

    path = tmp_path_factory.mktemp("decode-stops") / "model.gguf"
    write_random_bitnet(str(path), **MODEL)
    return path


@pytest.fixture(scope="module")
def copying_model_path(tmp_path_factory):
    from bitnet_web.convert.synthetic import write_random_bitnet

    path = tmp_path_factory.mktemp("decode-stops-copying") / "model.gguf"
    write_random_bitnet(str(path), **COPYING_MODEL)
    return path


@pytest.fixture(scope="module")
def reference(model_path, copying_model_path):
    """CPython's replies; the EOS token and the stop string are taken from its full greedy reply."""
    full = in_thread(cpython_scenarios, str(model_path))["full"]
    tokens = full["tokens"]
    assert len(tokens) == 20 and len(set(tokens)) > 3, "the model must give a varied reply"
    eos = tokens[9]  # EOS at its first occurrence, well inside a submit of 3
    text = full["text"]
    middle = len(text) // 2
    stop_string = text[middle : middle + 3]
    assert stop_string.strip(), f"no visible stop string in {text!r}"
    return {
        "eos": eos,
        "stop_string": stop_string,
        "runs": in_thread(cpython_scenarios, str(model_path), eos, stop_string),
        "copying": in_thread(cpython_scenarios, str(copying_model_path), None, "", True),
    }


@pytest.fixture(scope="module")
def browser_runs(browser, site, model_path, copying_model_path, reference):
    context = browser.new_context()
    page = context.new_page()
    log: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    page.set_default_timeout(300_000)
    open_app(page, site.url + NO_AUTOLOAD)
    worker = engine_worker(page)
    code = f"""
import json
import numpy as np
from bitnet_web.engine import Engine
from bitnet_web.formats.gguf_reader import GGUFFile
from bitnet_web.model.forward import BitNetModel
{SCENARIOS.replace("PROMPT_IDS_LITERAL", repr(PROMPT_IDS))}
engine = Engine()
await engine.load_async(GGUFFile.from_buffer(np.frombuffer(bytes(MODEL_BYTES), dtype=np.uint8)), name="stops")
engine.model.DECODE_BATCHING = {BROWSER_BATCHING!r}
SPECULATE = {SPECULATE}
result = await scenarios(engine, {reference["eos"]}, {json.dumps(reference["stop_string"])})
result["batching"] = list(engine.model.decode_batching())
attention = engine.model.layer_ops[0].attention
result["attention"] = dict(lanes=attention.lanes, label=attention.split_pipeline.label,
                           features=sorted(engine.device.features), subgroup_min_size=engine.device.subgroup_min_size)
# the same scenarios with drafted tokens verified several to a forward pass (speculative decoding)
result["speculative"] = await scenarios(engine, {reference["eos"]}, {json.dumps(reference["stop_string"])}, SPECULATE)
engine.close()
engine = Engine()
await engine.load_async(GGUFFile.from_buffer(np.frombuffer(bytes(COPYING_BYTES), dtype=np.uint8)), name="copying")
engine.model.DECODE_BATCHING = {BROWSER_BATCHING!r}
result["copying"] = await repeats(engine, SPECULATE)
engine.close()
json.dumps(result)
"""
    runs = json.loads(
        worker.evaluate(
            """async ([code, bytes, copying]) => {
                self.pyodide.globals.set("MODEL_BYTES", self.pyodide.toPy(new Uint8Array(bytes)));
                self.pyodide.globals.set("COPYING_BYTES", self.pyodide.toPy(new Uint8Array(copying)));
                return await self.pyodide.runPythonAsync(code);
            }""",
            [code, list(model_path.read_bytes()), list(copying_model_path.read_bytes())],
        )
    )
    context.close()
    if log:
        print("\n".join(log[-40:]))
    assert outside == [], f"requests outside 127.0.0.1: {outside}"
    return runs


def test_browser_decodes_several_steps_per_submit(browser_runs):
    assert browser_runs["batching"] == list(BROWSER_BATCHING)


def test_page_attention_takes_the_lane_walk(browser_runs):
    """Where the adapter has subgroups and says its smallest (SwiftShader: 4), decode attention walks by
    lane groups of at most that many invocations, so every pipeline takes the lane walk (the speculative
    scenarios below then check verify rows against plain decoding on it)."""
    info = browser_runs["attention"]
    if "subgroups" not in info["features"] or not info["subgroup_min_size"]:
        pytest.skip(f"this adapter reports no subgroup size: {info}")
    lanes = int(info["label"].split(" LANES=")[1].split()[0])
    assert info["lanes"] and lanes <= info["subgroup_min_size"], info


@pytest.mark.parametrize("scenario", ["full", "max_tokens", "eos", "stop_string", "stop_button"])
def test_stop_matches_cpython(browser_runs, reference, scenario):
    got, want = browser_runs[scenario], reference["runs"][scenario]
    expected_reason = {
        "full": "max_tokens",
        "max_tokens": "max_tokens",
        "eos": "eos",
        "stop_string": "stop_string",
        "stop_button": "aborted",
    }[scenario]
    assert want["reason"] == expected_reason, f"CPython stopped for {want['reason']}"
    for key in ("text", "tokens", "reason", "n_cached", "cached", "follow"):
        assert got[key] == want[key], f"{scenario}: {key} differs from CPython's"
    # the cache holds the prompt and the reply's tokens in order (the EOS token too once a queued step
    # took it as input), and no step ran past max_tokens
    reply = got["tokens"] + ([reference["eos"]] if scenario == "eos" else [])
    assert got["cached"] == PROMPT_IDS + reply[: got["n_cached"] - len(PROMPT_IDS)]
    if scenario in ("full", "max_tokens"):
        assert got["n_cached"] == len(PROMPT_IDS) + len(got["tokens"]) - 1
    assert got["follow"] == got["follow_fresh"], f"{scenario}: reusing the cache after the stop changed the reply"
    assert got["reused"] == got["n_cached"]


def test_stops_end_where_the_full_reply_says(reference):
    """The reference itself: each stop cut the full greedy reply at the expected token."""
    runs = reference["runs"]
    full = runs["full"]["tokens"]
    assert runs["max_tokens"]["tokens"] == full[:7]
    assert runs["eos"]["tokens"] == full[: full.index(reference["eos"])]
    assert runs["stop_button"]["tokens"] == full[: len(runs["stop_button"]["tokens"])]
    assert len(runs["stop_button"]["tokens"]) <= 6
    assert reference["stop_string"] not in runs["stop_string"]["text"]
    assert runs["stop_string"]["text"] == runs["full"]["text"][: len(runs["stop_string"]["text"])]


@pytest.mark.parametrize("scenario", ["full", "max_tokens", "eos", "stop_string", "stop_button"])
def test_speculative_decoding_in_the_page_matches_plain_cpython(browser_runs, reference, scenario):
    """Drafts verified on the GPU in the page: the text, tokens and stop of plain greedy decoding in
    CPython, and a cache that a follow-up turn can reuse as if no draft had run. (The GPU ends a
    speculative reply at its end-of-text token, so no queued step takes that token as input: its cache
    may stop one token short of plain decoding's, whose queued steps cache it.)"""
    got, want = browser_runs["speculative"][scenario], reference["runs"][scenario]
    for key in ("text", "tokens", "reason"):
        assert got[key] == want[key], f"{scenario}: {key} differs from plain decoding's"
    assert got["cached"] == (PROMPT_IDS + got["tokens"] + [reference["eos"]])[: got["n_cached"]]
    assert got["follow"] == got["follow_fresh"], f"{scenario}: the cache after the stop is wrong"
    if scenario == "eos":
        assert got["n_cached"] == len(PROMPT_IDS) + len(got["tokens"]), "the end-of-text token's row is not cached"
    else:
        assert got["follow"] == want["follow"] and got["n_cached"] == want["n_cached"], scenario
    assert got["draft_accepted"] <= got["draft_proposed"]


@pytest.mark.parametrize("scenario", ["full", "max_tokens", "stop_button"])
def test_accepted_drafts_in_the_page_give_plain_decodings_text(browser_runs, reference, scenario):
    """A model that copies its prompt: most drafts are accepted, several tokens per verify step, and
    the reply, its stop and the reused cache are still plain greedy decoding's."""
    got, want = browser_runs["copying"][scenario], reference["copying"][scenario]
    for key in ("text", "tokens", "reason"):
        assert got[key] == want[key], f"{scenario}: {key} differs from plain decoding's"
    assert got["follow"] == got["follow_fresh"] == want["follow"], f"{scenario}: the cache after the stop is wrong"
    if scenario == "full":
        assert got["draft_accepted"] >= len(got["tokens"]) // 3, f"drafts mostly rejected: {got}"
