"""The chat page with a Hugging Face checkpoint folder URL (checkpoint_downloader.py), in one browser context:
fetched with one progress bar over all its files, converted in the worker, a greedy reply equal to the
CPython engine's for the same folder, one row in the cache manager, a reload that loads it from
IndexedDB with no request for it, one delete for all its files, and errors that name the missing or
refused file.

References: the checkpoint folder on disk (built by tests/hf_tiny.py with transformers' own packing),
the CPython engine loading that folder, the test server's request log, IndexedDB read by the test.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from browser_helpers import (
    GREEDY_FORM,
    NO_AUTOLOAD,
    SYSTEM,
    app_page,
    app_state,
    cpython_turn,
    idb_entry,
    load_custom,
    load_option,
    model_info,
    needs_engine,
    notice,
    open_app,
    screenshot,
    send_and_wait,
    set_settings,
    set_test_hooks,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: hf_tiny
from hf_tiny import build_tiny_bitnet  # noqa: E402

from bitnet_web.web.shared.checkpoints import as_checkpoint, is_checkpoint_model, visible_entries  # noqa: E402
from bitnet_web.web.shared.progress import format_bytes  # noqa: E402
from bitnet_web.web.shared.settings import parse_form  # noqa: E402

pytestmark = pytest.mark.browser

# Small enough for SwiftShader; embed_std 0.02 so the greedy tokens are not just a copy of the prompt's
# last token (tied embeddings with a large embedding would make that the argmax for any engine).
SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    intermediate_size=256,
    vocab_size=300,
    max_position_embeddings=256,
    embed_std=0.02,
    seed=0,
)
GOOD = "hf/org/tiny-bitnet/resolve/main/"
SHARDED = "hf/org/sharded/resolve/main/"
NO_CONFIG = "hf/org/no-config/resolve/main/"
NOT_BITNET = "hf/org/mistral/resolve/main/"
PLAIN_LLAMA = "hf/org/plain-llama/resolve/main/"
RESUME = "hf/org/resume/resolve/main/"
REPLY_FORM = {**GREEDY_FORM, "max_tokens": "2"}

_IDB_KEYS = """
async () => {
  const db = await new Promise((ok, bad) => {
    const r = indexedDB.open("bitnet-web-models"); r.onsuccess = () => ok(r.result); r.onerror = () => bad(r.error);
  });
  const all = (store) => new Promise((ok, bad) => {
    const r = db.transaction(store).objectStore(store).getAllKeys(); r.onsuccess = () => ok(r.result);
    r.onerror = () => bad(r.error);
  });
  try {
    if (!db.objectStoreNames.contains("models")) return {models: [], chunks: []};
    return {models: await all("models"), chunks: (await all("chunks")).map((k) => k[0])};
  } finally { db.close(); }
}
"""

_WATCH_PROGRESS = """
() => {
  window.__hfProgress = [];
  const bar = document.getElementById('progress');
  new MutationObserver(() => window.__hfProgress.push({
      text: document.getElementById('progress-text').textContent, phase: bar.dataset.phase || '',
      value: bar.hasAttribute('value') ? bar.value : null}))
    .observe(document.getElementById('progress-text'), {childList: true, characterData: true, subtree: true});
}
"""


def idb_keys(page, prefix: str) -> dict[str, list[str]]:
    """Keys of the model records and of the chunks' owners that start with `prefix`, from IndexedDB."""
    keys = page.evaluate(_IDB_KEYS)
    return {store: sorted({k for k in found if k.startswith(prefix)}) for store, found in keys.items()}


def model_requests(site, folder: str) -> list[dict]:
    with site._lock:
        return [r for r in site.requests if r["path"].startswith("/_test/" + folder)]


@pytest.fixture(scope="module")
def checkpoint(test_files) -> Path:
    """The tiny checkpoint served at /_test/hf/org/tiny-bitnet/resolve/main/."""
    return build_tiny_bitnet(test_files / GOOD, **SHAPE, with_tokenizer=True)


@pytest.fixture(scope="module")
def app(browser, site, checkpoint):
    with app_page(browser, site) as page:
        yield page


# ------------------------------------------------------------------------------------------------
# Which URLs are checkpoints, what the cache manager lists (pure Python, no browser)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, base",
    [
        (
            "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T",
            "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T/resolve/main/",
        ),
        (
            "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T/tree/main",
            "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T/resolve/main/",
        ),
        (
            "http://127.0.0.1:8000/_test/hf/org/tiny-bitnet/resolve/main/",
            "http://127.0.0.1:8000/_test/hf/org/tiny-bitnet/resolve/main/",
        ),
        ("https://huggingface.co/microsoft/bitnet-b1.58-2B-4T-gguf/resolve/main/ggml-model-i2_s.gguf", None),
    ],
)
def test_checkpoint_urls_become_folder_descriptors(url, base):
    d = {"key": url, "url": url, "name": "x", "size": None}
    got = as_checkpoint(d)
    if base is None:
        assert got == d and not is_checkpoint_model(got)
        return
    assert got["key"] == got["url"] == base and got["format"] == "hf"
    assert got["name"] in ("microsoft/bitnet-b1.58-2B-4T", "org/tiny-bitnet")
    # a cache entry rebuilt by the page carries no format: its base URL says it is a checkpoint
    assert is_checkpoint_model({"key": base, "url": base})


def test_cache_list_hides_a_checkpoints_files():
    base = "http://h/o/n/resolve/main/"
    group = {"key": base, "format": "hf", "files": [{"name": "config.json"}, {"name": "model.safetensors"}]}
    other = {"key": "http://h/m.gguf"}
    entries = [
        group,
        {"key": base + "config.json"},
        {"key": base + "model.safetensors"},
        other,
        {"key": base + "stray.json"},
    ]
    assert visible_entries(entries) == [group, other, {"key": base + "stray.json"}]


# ------------------------------------------------------------------------------------------------
# In the page
# ------------------------------------------------------------------------------------------------


@needs_engine
def test_checkpoint_url_loads_and_chats_like_cpython(app, site, checkpoint):
    base = site.url + "_test/" + GOOD
    app.evaluate(_WATCH_PROGRESS)
    assert load_custom(app, base) == "loaded", notice(app)
    assert app_state(app)["source"] == "network"
    assert model_info(app)["Name"] == "org/tiny-bitnet"

    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    gets = {r["path"].rsplit("/", 1)[-1] for r in model_requests(site, GOOD) if r["method"] == "GET"}
    assert gets == set(files), "every file of the folder, and nothing else, is fetched"
    # one bar over all files: its fraction only grows and ends at 1, its total is the sum of the files
    downloads = [p for p in app.evaluate("() => window.__hfProgress") if p["phase"] == "download"]
    values = [p["value"] for p in downloads if p["value"] is not None]
    assert len(values) >= 3 and values == sorted(values) and values[-1] == 1, downloads
    assert values[0] < 0.5, "the first file's progress already filled the bar: not one bar over all files"
    assert any(f"of {format_bytes(sum(files.values()))}" in p["text"] for p in downloads), downloads

    set_settings(app, REPLY_FORM, SYSTEM)
    reply = send_and_wait(app, "hello")
    expected = cpython_turn(checkpoint, SYSTEM, [], "hello", parse_form(REPLY_FORM))
    assert expected.strip(), "the reference reply is blank: pick a model that says something"
    assert reply["state"] == "done" and reply["text"] == expected
    screenshot(app, "hf-checkpoint-reply")


@needs_engine
def test_cache_manager_shows_one_entry_for_the_checkpoint(app, site, checkpoint):
    base = site.url + "_test/" + GOOD
    app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    rows = app.locator("#cache-list li[data-key]")
    rows.first.wait_for()
    keys = [rows.nth(i).get_attribute("data-key") for i in range(rows.count())]
    assert [k for k in keys if k.startswith(base)] == [base], keys
    row = app.locator(f"#cache-list li[data-key='{base}']")
    assert row.get_attribute("data-complete") == "1"
    total = sum(p.stat().st_size for p in checkpoint.iterdir())
    assert "org/tiny-bitnet" in row.inner_text() and format_bytes(total) in row.inner_text()
    # behind the one row: one record per file plus the group, every file's bytes in chunks
    stored = idb_keys(app, base)
    assert stored["models"] == sorted([base] + [base + p.name for p in checkpoint.iterdir()])
    assert stored["chunks"] == sorted(base + p.name for p in checkpoint.iterdir())


@needs_engine
def test_reload_loads_the_checkpoint_from_browser_storage(app, site, checkpoint):
    base = site.url + "_test/" + GOOD
    before = len(model_requests(site, GOOD))
    open_app(app, site.url + NO_AUTOLOAD)
    assert load_option(app, base) == "loaded", notice(app)
    assert app_state(app)["source"] == "cache"
    assert model_requests(site, GOOD)[before:] == [], "the cached checkpoint was requested again"
    assert model_info(app)["Name"] == "org/tiny-bitnet"


@needs_engine
def test_one_delete_removes_every_file(app, site, checkpoint):
    base = site.url + "_test/" + GOOD
    app.evaluate("() => { document.getElementById('storage-panel').open = true; }")
    row = app.locator(f"#cache-list li[data-key='{base}']")
    row.wait_for()
    row.locator("button").click()
    app.wait_for_selector(f"#cache-list li[data-key='{base}']", state="detached")
    assert idb_keys(app, base) == {"models": [], "chunks": []}


def test_missing_shard_is_named_before_any_weights_are_fetched(app, site, checkpoint, test_files):
    from safetensors.numpy import load_file, save_file

    folder = test_files / SHARDED
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(checkpoint / name, folder / name)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(folder / shard))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
                "weight_map": {n: shard for shard, part in shards.items() for n in part},
            }
        )
    )
    (folder / "model-00002-of-00002.safetensors").unlink()  # the server lost one shard

    base = site.url + "_test/" + SHARDED
    assert load_custom(app, base) == "error"
    n = notice(app)
    assert n["kind"] == "download", n
    assert "model-00002-of-00002.safetensors" in n["text"] and "model.safetensors.index.json" in n["text"], n
    shard_gets = [r for r in model_requests(site, SHARDED) if r["method"] == "GET" and "model-0000" in r["path"]]
    assert shard_gets == [], "weights were fetched although a shard was known to be missing"
    assert idb_keys(app, base) == {"models": [], "chunks": []}, "a broken checkpoint was left in the cache"
    screenshot(app, "hf-checkpoint-missing-shard")


def test_missing_or_refused_config_is_named(app, site, checkpoint, test_files):
    no_config = test_files / NO_CONFIG
    no_config.mkdir(parents=True, exist_ok=True)
    shutil.copy(checkpoint / "model.safetensors", no_config / "model.safetensors")
    base = site.url + "_test/" + NO_CONFIG
    assert load_custom(app, base) == "error"
    n = notice(app)
    assert n["kind"] == "download" and base + "config.json" in n["text"] and "404" in n["text"], n
    assert "not a Hugging Face checkpoint folder" in n["text"]

    other = test_files / NOT_BITNET
    shutil.copytree(checkpoint, other, dirs_exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    base = site.url + "_test/" + NOT_BITNET
    assert load_custom(app, base) == "error"
    n = notice(app)
    assert n["kind"] == "bad_model" and base + "config.json" in n["text"] and "mistral" in n["text"], n
    assert not [r for r in model_requests(site, NOT_BITNET) if r["path"].endswith(".safetensors")], (
        "the weights were fetched for a model the config already ruled out"
    )
    for folder in (NO_CONFIG, NOT_BITNET):
        assert idb_keys(app, site.url + "_test/" + folder) == {"models": [], "chunks": []}


def test_ordinary_llama_needs_the_lossy_box_and_is_labelled_lossy(app, site, test_files):
    # float (non-ternary) weights with a Llama config and no BitNet quantization_config: an ordinary model
    folder = build_tiny_bitnet(test_files / PLAIN_LLAMA, **SHAPE, packed=False, with_tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="llama", hidden_act="silu", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    base = site.url + "_test/" + PLAIN_LLAMA

    assert load_custom(app, base) == "error"
    n = notice(app)
    assert n["kind"] == "bad_model" and base + "config.json" in n["text"], n
    assert "EXPERIMENTAL, LOSSY box" in n["text"], n
    assert not [r for r in model_requests(site, PLAIN_LLAMA) if r["path"].endswith(".safetensors")]
    assert idb_keys(app, base) == {"models": [], "chunks": []}

    # with the box: fetched and converted (the engine load, which only repeats what the tests above show
    # for another architecture's shaders, is skipped to keep this file fast on SwiftShader)
    app.select_option("#model-select", "custom")
    app.check("#lossy-ternarize")
    set_test_hooks(app, skipEngine=True)
    try:
        assert load_custom(app, base) == "header", notice(app)
    finally:
        set_test_hooks(app)
        app.uncheck("#lossy-ternarize")
    assert notice(app)["kind"] == "engine_missing" and "fetched and converted" in notice(app)["text"]
    info = model_info(app)
    assert info["Architecture"] == "llama" and info["Quality"].startswith("EXPERIMENTAL, LOSSY"), info
    assert idb_keys(app, base)["models"] == sorted([base] + [base + p.name for p in folder.iterdir()])


def test_dropped_connection_in_a_shard_resumes_with_range(app, site, checkpoint, test_files):
    folder = test_files / RESUME
    shutil.copytree(checkpoint, folder, dirs_exist_ok=True)
    data = (folder / "model.safetensors").read_bytes()
    path = "/_test/" + RESUME + "model.safetensors"
    site.add_fault(path, delay_s=0)  # taken by the HEAD request (no body to cut)
    site.add_fault(path, drop_after=len(data) * 4 // 10)  # the GET: cut mid-body
    base = site.url + "_test/" + RESUME
    set_test_hooks(app, skipEngine=True)  # the download is under test here, not the engine
    try:
        assert load_custom(app, base) == "header", notice(app)
    finally:
        set_test_hooks(app)
    gets = [r for r in site.requests_for(path) if r["method"] == "GET"]
    assert gets[0]["range"] is None and len(gets) >= 2, gets
    first = int(re.fullmatch(r"bytes=(\d+)-", gets[1]["range"]).group(1))
    assert 0 < first <= len(data) * 4 // 10 and gets[1]["if_range"], gets
    entry = idb_entry(app, base + "model.safetensors")
    assert entry["meta"]["complete"] and entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert model_info(app)["Name"] == "org/resume"
