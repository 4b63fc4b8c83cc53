"""Recorded-program replay (gpu/browser.py + static/gpu-replay.js) in the engine worker: a step
encoded by one call into the JS helper must do exactly what the same commands issued one FFI call
at a time do, and a changed command list must never replay an earlier program.

References: the direct (per-command) encoding path in the same worker, and a numpy model of what a
list of "add 1" dispatches and buffer copies leaves in the buffers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from browser_helpers import LOCAL_PREFIXES, NO_AUTOLOAD, engine_worker, open_app

pytestmark = pytest.mark.browser

WORDS = 256  # u32 per test buffer: 4 workgroups of 64
WORKGROUP = 64


@pytest.fixture(scope="module")
def worker(browser, site):
    """The app's engine worker (page opened without loading a model), for running Python in it."""
    context = browser.new_context()
    page = context.new_page()
    log: list[str] = []
    outside: list[str] = []
    page.on("console", lambda m: log.append(f"console.{m.type}: {m.text}"))
    page.on("pageerror", lambda e: log.append(f"pageerror: {e}"))
    page.on("request", lambda r: None if r.url.startswith(LOCAL_PREFIXES) else outside.append(r.url))
    page.set_default_timeout(180_000)
    open_app(page, site.url + NO_AUTOLOAD)
    yield engine_worker(page)
    context.close()
    if log:
        print("\n".join(log[-80:]))
    assert outside == [], f"the page or its workers requested URLs outside 127.0.0.1: {outside}"


def run_python(worker, code: str):
    """Run async Python in the worker; its last expression must be a JSON string."""
    return json.loads(worker.evaluate("async (code) => await self.pyodide.runPythonAsync(code)", code))


def test_replay_helper_is_loaded_without_csp_violations(worker):
    found = worker.evaluate("""() => ({helper: typeof self.bitnetGpuReplay, version: self.bitnetGpuReplay?.version,
                                      violations: self.cspViolations || []})""")
    assert found == {"helper": "object", "version": 1, "violations": []}


# Each step is a list of commands: ("d", bind group name, x[, y[, z]]) adds 1 to the first
# 64 * x * y * z words of that group's buffer; ("c", src, dst) copies a whole buffer.
# `new_group` makes a fresh bind group over buffer A (same buffer, new GPU object).
STEPS = [
    [("d", "A", 1)],
    [("d", "A", 1)],  # identical: replayed
    [("d", "B", 1)],  # another bind group, same count and pipeline
    [("d", "A", 1), ("d", "A", 1)],  # one dispatch more
    [("d", "A", 2)],  # other workgroup count
    [("d", "A", 1, 2)],  # same total, other y
    [("d", "A", 1, 1, 2)],  # same total, other z
    [("d", "A", 1), ("c", "A", "B"), ("d", "B", 1)],  # two passes around a copy
    [("d", "A", 1), ("c", "A", "C"), ("d", "B", 1)],  # other copy destination
    [("d", "A", 1)],  # an earlier list: still kept, replayed
    [("d", "A2", 1)],  # a rebuilt bind group over the same buffer
]

_STEP_RUNNER = """
import json
import numpy as np
from bitnet_web import gpu
from bitnet_web.gpu.browser import recorded_programs

STEPS = json.loads(STEPS_JSON)
device = await gpu.open_device_async()
programs = recorded_programs(device)
programs.enabled = REPLAY
programs.capacity = CAPACITY
pipeline = device.pipeline('''
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) n: vec3<u32>) {
    data[gid.x + 64u * n.x * (gid.y + n.y * gid.z)] += 1u;
}
''', "add one")
buffers = {name: device.buffer(4 * WORDS, gpu.STORAGE_USAGE, name) for name in "ABC"}
for b in buffers.values():
    device.upload(b, 0, np.zeros(WORDS, dtype=np.uint32))
groups = {name: device.bind_group(pipeline, [buffers[name]]) for name in "ABC"}
snapshots = []
for step in STEPS:
    if any(c[1] == "A2" for c in step):
        groups["A2"] = device.bind_group(pipeline, [buffers["A"]])
    rec = device.begin_profiled() if PROFILED else device.begin()
    for command in step:
        if command[0] == "d":
            rec.dispatch(pipeline, groups[command[1]], *command[2:])
        else:
            rec.copy(buffers[command[1]], 0, buffers[command[2]], 0, 4 * WORDS)
    rec.submit()
    built, reused = programs.built, programs.reused
    programs.enabled = False  # the reads' own copy steps stay out of the program cache
    profile = await device.read_profile_async(rec) if PROFILED else []
    contents = {n: (await device.read(b)).view(np.uint32).tolist() for n, b in buffers.items()}
    programs.enabled = REPLAY
    snapshots.append({"buffers": contents, "built": built, "reused": reused,
                      "passes": rec.passes, "dispatches": rec.dispatches, "profile": profile})
await device.checkpoint("replay test")
device.destroy()
json.dumps({"helper": programs.helper is not None, "snapshots": snapshots})
"""


def expected_snapshots(steps) -> list[dict]:
    """What each step leaves in A, B, C, its pass and dispatch counts (numpy, no GPU)."""
    data = {name: np.zeros(WORDS, dtype=np.uint32) for name in "ABC"}
    out = []
    for step in steps:
        passes, in_pass = 0, False
        for command in step:
            if command[0] == "d":
                data[command[1][0]][: WORKGROUP * int(np.prod(command[2:]))] += 1  # "A2" binds buffer A
                passes += not in_pass
                in_pass = True
            else:
                data[command[2]][:] = data[command[1]]
                in_pass = False
        out.append(
            {
                "buffers": {n: a.tolist() for n, a in data.items()},
                "passes": passes,
                "dispatches": sum(c[0] == "d" for c in step),
            }
        )
    return out


def run_steps(worker, steps, replay: bool, capacity: int = 8, profiled: bool = False) -> dict:
    code = (
        _STEP_RUNNER.replace("STEPS_JSON", repr(json.dumps(steps)))
        .replace("PROFILED", str(profiled))
        .replace("REPLAY", str(replay))
        .replace("CAPACITY", str(capacity))
        .replace("WORDS", str(WORDS))
    )
    return run_python(worker, code)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "direct"])
def test_changed_commands_never_replay_a_stale_program(worker, replay):
    result = run_steps(worker, STEPS, replay)
    assert result["helper"]
    expected = expected_snapshots(STEPS)
    for i, (got, want) in enumerate(zip(result["snapshots"], expected, strict=True)):
        assert got["buffers"] == want["buffers"], f"step {i} {STEPS[i]}: buffers differ"
        assert (got["passes"], got["dispatches"]) == (want["passes"], want["dispatches"]), f"step {i}"
    if replay:
        # a program is built exactly when a step's command list was not seen before
        seen: list = []
        for i, step in enumerate(STEPS):
            new = step not in seen or any(c[1] == "A2" for c in step)
            seen.append(step)
            built_now = result["snapshots"][i]["built"] - (result["snapshots"][i - 1]["built"] if i else 0)
            assert built_now == (1 if new else 0), f"step {i} {step}: {built_now} programs built"
        assert result["snapshots"][-1]["reused"] == 2  # steps 1 and 9
    else:
        assert result["snapshots"][-1]["built"] == 0 and result["snapshots"][-1]["reused"] == 0


def test_a_profiled_recording_does_the_same_work_and_times_each_dispatch(worker):
    """The bench page's kernel profiles (BrowserDevice.begin_profiled: one timestamped pass per
    dispatch, encoded directly): every step leaves what the plain encoding leaves, and
    read_profile_async gives one (kernel label, microseconds >= 0) per dispatch."""
    result = run_steps(worker, STEPS, replay=True, profiled=True)
    expected = expected_snapshots(STEPS)
    for i, (got, want) in enumerate(zip(result["snapshots"], expected, strict=True)):
        assert got["buffers"] == want["buffers"], f"step {i} {STEPS[i]}: buffers differ"
        assert got["dispatches"] == want["dispatches"] == len(got["profile"]), f"step {i}"
        assert all(label == "add one" and us >= 0 for label, us in got["profile"]), got["profile"]
        assert got["built"] == 0  # never a replayed program


def test_evicted_programs_are_rebuilt_correctly(worker):
    """With room for 2 programs, cycling through 3 command lists rebuilds each time and stays exact."""
    steps = [[("d", "A", 1)], [("d", "B", 2)], [("d", "C", 3)]] * 2
    result = run_steps(worker, steps, replay=True, capacity=2)
    expected = expected_snapshots(steps)
    assert [s["buffers"] for s in result["snapshots"]] == [e["buffers"] for e in expected]
    assert result["snapshots"][-1]["built"] == 6 and result["snapshots"][-1]["reused"] == 0


ADD_ONE_WGSL = """
@group(0) @binding(0) var<storage, read_write> words: array<u32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) { words[id.x] += 1u; }
"""


def test_misuse_of_a_recorder_is_a_clear_error(worker):
    """A released buffer in a copy, and recording into a finished recorder (whose command list may
    be a cached program's key), raise GPUError at the call instead of encoding something else; a
    dispatch of a pipeline still compiling in a batch is refused when its step is encoded (replayed
    or not), and the same dispatch works once the batch has ended."""
    found = run_python(
        worker,
        """
import json
import numpy as np
from bitnet_web import gpu
device = await gpu.open_device_async()
a, b = device.buffer(256, gpu.STORAGE_USAGE, "kept"), device.buffer(256, gpu.STORAGE_USAGE, "freed")
c = device.buffer(256, gpu.STORAGE_USAGE, "other")
messages = []
finished = device.begin()
finished.copy(a, 0, c, 0, 256)
finished.finish()
device.release(b)
for attempt in (lambda: device.begin().copy(a, 0, b, 0, 256), lambda: finished.copy(c, 0, a, 0, 256)):
    try:
        attempt()
        messages.append(None)
    except gpu.GPUError as exc:
        messages.append(str(exc))
from bitnet_web.gpu.browser import recorded_programs
device.begin_pipeline_batch()
pending = device.pipeline(ADD_ONE, "pending")
group = device.bind_group(pending, [c])
for replay in (True, False):
    recorded_programs(device).enabled = replay
    recorder = device.begin()
    recorder.dispatch(pending, group, 1)
    try:
        recorder.finish()
        messages.append(None)
    except gpu.GPUError as exc:
        messages.append(str(exc))
await device.end_pipeline_batch()
recorder = device.begin()
recorder.dispatch(pending, group, 1)
recorder.submit()
messages.append(int(np.frombuffer(bytes(await device.read(c)), dtype=np.uint32)[0]))
device.destroy()
json.dumps(messages)
""".replace("ADD_ONE", repr(ADD_ONE_WGSL)),
    )
    released, after_finish, pending_replayed, pending_direct, after_batch = found
    assert released is not None and "'freed'" in released and "released" in released
    assert after_finish is not None and "finished" in after_finish
    for message in (pending_replayed, pending_direct):
        assert message is not None and "still compiling" in message
    assert after_batch == 1  # the one dispatch that ran added 1 to the zeroed buffer


_DECODE_RUNNER = """
import json
import numpy as np
from bitnet_web.engine import Engine
from bitnet_web.formats.gguf_reader import GGUFFile
from bitnet_web.convert.synthetic import random_bitnet_writer
from bitnet_web.gpu.browser import recorded_programs

# Untied head: greedy tokens vary (a tied random model repeats its input). head_dim 128: attention
# tiles of 16 keys, so decoding from position 236 changes the split count at 240 and 256, and the
# KV cache (256 rows at first) grows at 256: new bind groups mid-decode.
data = random_bitnet_writer("", dim=256, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300,
                            context_length=1024, seed=3, untied=True).to_buffer()
engine = Engine()
await engine.load_async(GGUFFile.from_buffer(data), name="replay test")
model = engine.model
programs = recorded_programs(engine.device)
prompt = np.random.default_rng(0).integers(0, 300, size=236).tolist()
runs = {}
for replay in (True, False):
    programs.enabled = replay
    model.truncate(0)
    logits = await model.prefill(prompt)
    first = int(np.argmax(logits))
    built, reused, generation = programs.built, programs.reused, model.kv_cache.generation
    stream = model.decode_greedy(first)
    tokens = [first]
    for _ in range(N_TOKENS):
        tokens.append(await stream.__anext__())
    await stream.aclose()
    await engine.device.checkpoint("decoding")  # raises any validation error (a destroyed buffer bound)
    runs["replay" if replay else "direct"] = {
        "tokens": tokens, "built": programs.built - built, "reused": programs.reused - reused,
        "kv_growths": model.kv_cache.generation - generation, "capacity": model.kv_cache.capacity,
        "dispatches": model.last_dispatches}
engine.close()
json.dumps(runs)
"""


def test_replayed_decode_gives_the_plain_recorders_tokens(worker):
    """Greedy decoding across attention split changes and a KV-cache growth: the same tokens with
    every step encoded by replayed programs as with every command issued from Python."""
    runs = run_python(worker, _DECODE_RUNNER.replace("N_TOKENS", "26"))
    replay, direct = runs["replay"], runs["direct"]
    assert replay["tokens"] == direct["tokens"]
    assert len(set(replay["tokens"])) > 1, "a constant token stream would not show much"
    # the first run crossed the growth (256 -> 512 rows); the second reused the grown cache
    assert replay["kv_growths"] == 1 and replay["capacity"] == 512
    # replay was really used, and its changed steps got programs of their own: more than the 3 of
    # the staging-buffer ring (split counts changed twice, bind groups once)
    assert replay["reused"] > 0 and replay["built"] > 3
    assert direct["built"] == 0 and direct["reused"] == 0
