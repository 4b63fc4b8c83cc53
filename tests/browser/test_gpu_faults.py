"""GPU faults in the chat page: models beyond the device's limits, and the device lost mid-generation
and while idle. One browser context for the module (a person's session): each test starts from the
state the previous one left.

- Limits: refused with every offending buffer named, before a single WebGPU buffer, pipeline or
  upload exists. Two ways: a model whose metadata (context length) needs a KV cache larger than the
  adapter's real maxStorageBufferBindingSize, and the engine planning for a lowered limit (test hook)
  so a weight matrix is over it. Counted independently by wrapping the worker's WebGPU calls.
- Device lost: the test calls the worker's GPUDevice.destroy() (what a driver reset looks like to
  the page: `device.lost` resolves, pending mapAsync calls reject). The reply ends with a clear
  message, the page offers "Load the model again", which loads the same model from IndexedDB on a
  new device without a page refresh; the next reply equals the CPython engine's for the kept history.

- Kernels: a load makes its pipelines with createComputePipelineAsync, all started before any is
  awaited (Chromium compiles them in parallel); one that fails to compile fails the load with its
  name, frees what the load made, and the next load works (every other test's replies come from
  models whose pipelines compiled so).

A model load compiles ~30 pipelines, about a minute on SwiftShader: the module loads three times.
"""

from __future__ import annotations

import pytest
from browser_helpers import (
    GREEDY_FORM,
    SYSTEM,
    app_page,
    app_state,
    cpython_turn,
    engine_worker,
    gpu_counts,
    install_gpu_counters,
    last_reply,
    load_custom,
    needs_engine,
    notice,
    screenshot,
    send_and_wait,
    set_settings,
    start_load,
    wait_for_new_reply,
    worker_python,
)
from shapes import SMALL_SHAPE

from bitnet_web.web.shared.settings import parse_form

pytestmark = [pytest.mark.browser, needs_engine]

SHORT = {**GREEDY_FORM, "max_tokens": "3"}
DESTROY_DEVICE = (
    "from bitnet_web.web.worker import main as w\n"
    "device = w._worker.engine.device\n"
    "device._device.destroy()  # the JS GPUDevice: a loss the app did not cause\n"
    "id(device)"
)


@pytest.fixture(scope="module")
def app(browser, site):
    with app_page(browser, site) as page:
        install_gpu_counters(page)
        yield page


@pytest.fixture(scope="module")
def tiny_path(test_files, tiny_model):
    path = test_files / "gpu-faults-tiny.gguf"
    path.write_bytes(tiny_model)
    return path


def adapter_binding_limit(page) -> int:
    return page.evaluate("""async () => {
        const a = await navigator.gpu.requestAdapter();
        return Math.min(a.limits.maxStorageBufferBindingSize, a.limits.maxBufferSize); }""")


def test_model_beyond_the_binding_limit_is_refused_before_any_upload(app, site, test_files):
    from bitnet_web.convert.synthetic import write_random_bitnet

    limit = adapter_binding_limit(app)
    head_dim = SMALL_SHAPE["dim"] // SMALL_SHAPE["n_heads"]
    context = 1 << 24  # a KV-cache layer of 2 * context * n_kv_heads * head_dim bytes (f16, the default): 2 GiB
    kv_bytes = 2 * context * SMALL_SHAPE["n_kv_heads"] * head_dim
    assert kv_bytes > limit, "SwiftShader's limit grew: raise `context`"
    write_random_bitnet(str(test_files / "huge-context.gguf"), **SMALL_SHAPE, context_length=context, seed=3)
    before = gpu_counts(app)
    assert load_custom(app, site.url + "_test/huge-context.gguf") == "error"
    n = notice(app)
    assert n["visible"] and n["kind"] == "memory", n
    assert "K or V cache" in n["text"] and str(kv_bytes) in n["text"] and str(limit) in n["text"], n["text"]
    assert "maxStorageBufferBindingSize" in n["text"]
    after = gpu_counts(app)
    assert {k: after[k] - before[k] for k in ("buffers", "pipelines", "writes")} == {
        "buffers": 0,
        "pipelines": 0,
        "writes": 0,
    }, "GPU objects were created for a model that was refused"
    assert worker_python(
        app, "from bitnet_web.web.worker import main as w\nw._worker.engine is None or w._worker.engine.model is None"
    )
    screenshot(app, "failure-binding-limit")


def test_a_weight_over_a_lowered_limit_is_named_before_any_upload(app, site, tiny_path):
    limit = 8192  # the fused ffn_gate + ffn_up codes need 2 * 256 * 128 / 4 = 16384 bytes
    worker_python(
        app,
        f"from bitnet_web.web.worker import main as w\nw._worker.engine_options = {{'max_binding_size': {limit}}}",
    )
    try:
        before = gpu_counts(app)
        assert load_custom(app, site.url + "_test/" + tiny_path.name) == "error"
        n = notice(app)
        assert n["kind"] == "memory", n
        assert f"at most {limit} bytes" in n["text"], n["text"]
        assert "ffn_gate + ffn_up (fused ternary codes) 16384 bytes" in n["text"], n["text"]
        after = gpu_counts(app)
        assert after["buffers"] == before["buffers"] and after["writes"] == before["writes"]
    finally:
        worker_python(app, "from bitnet_web.web.worker import main as w\nw._worker.engine_options = {}")


def test_device_lost_during_generation_then_reload_without_a_page_refresh(app, site, tiny_path):
    url = site.url + "_test/" + tiny_path.name
    assert load_custom(app, url) == "loaded", notice(app)
    settings = parse_form(SHORT)
    set_settings(app, SHORT, SYSTEM)
    first = send_and_wait(app, "hello")
    assert first["state"] == "done"
    assert first["text"] == cpython_turn(tiny_path, SYSTEM, [], "hello", settings)

    set_settings(app, {**GREEDY_FORM, "max_tokens": "200"}, SYSTEM)
    n_before = app.locator(".msg.assistant").count()
    app.fill("#prompt", "a long reply please")
    app.press("#prompt", "Enter")
    wait_for_new_reply(app, n_before)
    old_device = worker_python(app, DESTROY_DEVICE)
    app.wait_for_function(
        """() => { const r = document.querySelectorAll('.msg.assistant .text');
        return r[r.length - 1].dataset.state !== 'streaming'; }""",
        timeout=60_000,
    )
    reply = last_reply(app)
    assert reply["state"] == "error" and "The GPU was reset" in reply["text"], reply
    n = notice(app)
    assert n["visible"] and n["kind"] == "device_lost", n
    assert app_state(app)["model"] == "lost"
    assert app.is_disabled("#send") and app.is_enabled("#reload-model")
    screenshot(app, "failure-device-lost")

    downloads = len(site.requests_for("/_test/" + tiny_path.name))
    assert start_load(app, lambda: app.click("#reload-model")) == "loaded", notice(app)
    assert app_state(app)["source"] == "cache"
    assert len(site.requests_for("/_test/" + tiny_path.name)) == downloads, "the model was downloaded again"
    assert not notice(app)["visible"]
    new_device = worker_python(
        app, "from bitnet_web.web.worker import main as w\nd = w._worker.engine.device\n(id(d), d.lost_reason)"
    )
    assert new_device[0] != old_device and new_device[1] is None

    set_settings(app, SHORT, SYSTEM)
    again = send_and_wait(app, "hello again")
    assert again["state"] == "done"
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first["text"]}]
    assert again["text"] == cpython_turn(tiny_path, SYSTEM, history, "hello again", settings)


def test_device_lost_while_idle_is_reported_at_once(app):
    assert app_state(app)["model"] == "loaded", "needs the model loaded by the previous test"
    worker_python(app, DESTROY_DEVICE)
    # no request is running: the worker's device.lost listener tells the page by itself
    app.wait_for_selector("#notice[data-kind='device_lost'] #reload-model")
    assert app_state(app)["model"] == "lost"
    assert "GPU device was lost" in notice(app)["text"]
    assert app.is_disabled("#prompt") and app.is_disabled("#send")
    assert worker_python(app, "from bitnet_web.web.worker import main as w\nw._worker.loaded_key") is None


# In the worker: createComputePipelineAsync rejects for pipelines whose label starts with `prefix`
# (what a driver's compile failure looks like to the page), and records when each call was made and
# when the first one was awaited to completion.
_FAIL_PIPELINES = """(prefix) => {
  const real = GPUDevice.prototype.createComputePipelineAsync;
  self.__bitnetRealCreateAsync = real;
  GPUDevice.prototype.createComputePipelineAsync = function (desc) {
    if (prefix && (desc.label || "").startsWith(prefix)) {
      return Promise.reject(new DOMException(`compile failed (test): ${desc.label}`, "OperationError"));
    }
    return real.call(this, desc);
  };
}"""
_RESTORE_PIPELINES = "() => { GPUDevice.prototype.createComputePipelineAsync = self.__bitnetRealCreateAsync; }"


def test_kernels_compile_together_and_a_failed_one_fails_the_load_cleanly(app, site, tiny_path):
    url = site.url + "_test/" + tiny_path.name
    before = gpu_counts(app)
    engine_worker(app).evaluate(_FAIL_PIPELINES, "attention")
    try:
        assert load_custom(app, url) == "error"
    finally:
        engine_worker(app).evaluate(_RESTORE_PIPELINES)
    n = notice(app)
    assert n["visible"] and "creating pipeline 'attention" in n["text"] and "compile failed (test)" in n["text"], n
    failed = gpu_counts(app)
    assert failed["bytes"] == before["bytes"], "the failed load left GPU buffers behind"
    # every kernel but the refused ones was compiled, all together (createComputePipelineAsync)
    tried = {k: failed[k] - before[k] for k in ("pipelines", "async_pipelines")}
    assert tried["pipelines"] >= 20 and tried["async_pipelines"] == tried["pipelines"], tried
    assert load_custom(app, url) == "loaded", notice(app)
    after = gpu_counts(app)
    made = {k: after[k] - failed[k] for k in ("pipelines", "async_pipelines")}
    # the device kept the kernels that compiled: the reload compiles only the attention ones again
    assert 0 < made["pipelines"] < tried["pipelines"] and made["async_pipelines"] == made["pipelines"], made
    kept = worker_python(
        app,
        "from bitnet_web.web.worker import main as w\n"
        "[p.label for p in w._worker.engine.model.kernels._pipelines.values() if p.handle is None]",
    )
    assert kept == [], f"pipelines without a handle are still handed out: {kept}"
