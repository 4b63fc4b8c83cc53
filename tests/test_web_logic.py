"""The app's pure-Python parts under CPython: protocol, failure texts, progress, settings, download
helpers, model info, prompts (the page and the worker run the same code under Pyodide)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bitnet_web.web.shared import failures, protocol
from bitnet_web.web.shared.progress import RateMeter, format_bytes, format_duration, progress_text, stats_line
from bitnet_web.web.shared.prompts import clip_to_context, summary_messages, turn_request
from bitnet_web.web.shared.settings import (
    DEFAULTS,
    FIELDS,
    SettingsError,
    greedy,
    parse_form,
    parse_value,
    to_engine_settings,
)
from bitnet_web.web.worker.downloader import content_length, describe_non_gguf, is_strong_etag, parse_content_range

# -- protocol ----------------------------------------------------------------------------------------


def test_protocol_round_trip_with_numpy_and_non_finite_values():
    msg = {
        "event": "done",
        "id": 3,
        "stats": {"n": np.int64(5), "speed": np.float32(2.5), "nan": float("nan"), "inf": float("inf")},
        "text": "NaN <b>Infinity</b>",
    }
    raw = protocol.encode(msg)
    json.loads(raw)  # strict JSON: what JSON.parse accepts
    back = protocol.decode(raw, key="event", allowed=protocol.EVENTS)
    assert back["stats"] == {"n": 5, "speed": 2.5, "nan": None, "inf": None}
    assert back["text"] == msg["text"]


@pytest.mark.parametrize("raw", ["not json", '{"op": "format_disk"}', "[1, 2]", 42, '{"event": "ready"}'])
def test_protocol_rejects_unknown_or_malformed_messages(raw):
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(raw, key="op", allowed=protocol.OPS)


# -- failures ------------------------------------------------------------------------------------


def _exc(name: str, base: type = Exception) -> BaseException:
    return type(name, (base,), {})("boom")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("GPUDeviceLostError", "device_lost"),
        ("GPUOutOfMemoryError", "memory"),
        ("GPUUnavailableError", "missing_feature"),
        ("ModelConfigError", "bad_model"),
        ("NotGGUFError", "not_gguf"),
        ("SomethingElse", "internal"),
    ],
)
def test_classify_by_class_names(name, kind):
    assert failures.classify(_exc(name)) == kind


def test_classify_looks_at_base_classes():
    gguf_error = type("GGUFError", (Exception,), {})
    assert failures.classify(_exc("GGUFTruncatedError", gguf_error)) == "bad_model"


def test_classify_memory_error_and_explicit_kind():
    assert failures.classify(MemoryError("x")) == "memory"
    exc = RuntimeError("quota")
    exc.failure_kind = "quota"
    assert failures.classify(exc) == "quota"


def test_every_kind_has_a_title_and_advice_and_gpu_absence_is_fatal():
    for kind in (
        "no_webgpu",
        "no_adapter",
        "missing_feature",
        "memory",
        "quota",
        "download",
        "not_gguf",
        "bad_model",
        "device_lost",
        "engine_missing",
        "worker_start",
    ):
        f = failures.describe(kind, "what happened")
        assert f.title and f.advice and f.message == "what happened"
    assert failures.describe("no_webgpu", "").fatal and not failures.describe("download", "").fatal
    assert any("chrome://flags" in a for a in failures.describe("no_webgpu", "").advice)


def test_failure_event_is_json_ready():
    event = failures.failure_event(MemoryError("no room"), 7)
    assert event["kind"] == "memory" and event["id"] == 7 and event["message"] == "no room"
    protocol.decode(protocol.encode(event), key="event", allowed=protocol.EVENTS)


def test_a_model_file_failure_names_the_file_once():
    from bitnet_web.formats.ggml import GGUFTruncatedError

    e = GGUFTruncatedError("tensor 'blk.2.ffn_up.weight' data extends past the end of the file")
    failures.name_the_file(e, "truncated.gguf")
    assert str(e) == "truncated.gguf: tensor 'blk.2.ffn_up.weight' data extends past the end of the file"
    assert failures.failure_event(e)["message"] == str(e)
    failures.name_the_file(e, "truncated.gguf")  # already named (a retry, a message that says it): unchanged
    assert str(e).count("truncated.gguf") == 1
    other = MemoryError("no room")  # not about the file's contents: left alone
    failures.name_the_file(other, "truncated.gguf")
    assert str(other) == "no room"


# -- progress ------------------------------------------------------------------------------------


def test_rate_meter_constant_rate_and_eta():
    meter = RateMeter(window_s=4)
    for i in range(20):
        meter.add(i * 0.5, i * 1_000_000)  # 2 MB/s
    assert meter.rate() == pytest.approx(2_000_000)
    assert meter.eta(30_000_000) == pytest.approx((30_000_000 - 19_000_000) / 2_000_000)


def test_rate_meter_restart_never_gives_negative_speed():
    meter = RateMeter()
    meter.add(0, 0)
    meter.add(1, 5_000_000)
    meter.add(2, 1_000)  # the download restarted from zero
    meter.add(3, 2_001_000)
    assert meter.rate() == pytest.approx(2_000_000)


def test_progress_text_and_formats():
    text = progress_text("download", 250_000_000, 1_000_000_000, 10_000_000, 75)
    assert text == "Downloading 250.0 MB of 1.0 GB (25%), 10.0 MB/s, 1 min 15 s left"
    assert format_bytes(999) == "999 B" and format_bytes(1_500) == "1.5 KB"
    assert format_duration(3725) == "1 h 02 min" and format_duration(None) == "?"
    assert progress_text("upload", 3, 10, None, None) == "Uploading to the GPU: part 3 of 10 (30%)"
    assert progress_text("parse", 1, 3, None, None) == "Checking the model file: step 1 of 3"


def test_stats_line():
    line = stats_line({"n_generated": 12, "decode_tok_per_s": 33.333, "ttft_s": 0.5}, "aborted")
    assert line == "12 tokens, 33.3 tok/s, first token after 0.50 s, stopped"


# -- settings ------------------------------------------------------------------------------------


def test_settings_parse_and_bounds():
    assert parse_form({}) == DEFAULTS
    assert parse_value("temperature", " 0.25 ") == 0.25
    assert parse_value("max_tokens", "12") == 12
    for name, bad in (
        ("temperature", "hot"),
        ("temperature", "3"),
        ("max_tokens", "1.5"),
        ("top_p", "-0.1"),
        ("seed", "nan"),
    ):
        with pytest.raises(SettingsError, match=next(f.label for f in FIELDS if f.name == name)):
            parse_value(name, bad)


def test_settings_reach_the_engine_dataclass():
    sampler = pytest.importorskip("bitnet_web.text.sampler")
    s = to_engine_settings(greedy(20), sampler.SamplerSettings)
    assert s.temperature == 0 and s.top_k == 1 and s.seed == 0
    s = to_engine_settings(parse_form({"seed": ""}), sampler.SamplerSettings)
    assert s.seed is None  # empty seed: the engine's default (fresh entropy)


# -- download helpers ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("bytes 100-199/1000", (100, 199, 1000)),
        ("bytes 0-0/1", (0, 0, 1)),
        ("bytes 5-9/*", (5, 9, None)),
        ("bytes 10-5/100", None),
        ("bytes 0-100/100", None),
        ("items 0-1/2", None),
        (None, None),
        ("bytes x-y/z", None),
    ],
)
def test_parse_content_range(value, expected):
    got = parse_content_range(value)
    assert (tuple(got) if got else None) == expected


def test_etags_and_lengths():
    assert is_strong_etag('"abc"') and not is_strong_etag('W/"abc"') and not is_strong_etag(None)
    assert content_length({"Content-Length": "42"}) == 42
    assert content_length({"Content-Length": "42", "Content-Encoding": "gzip"}) is None


def test_non_gguf_description_names_html():
    text = describe_non_gguf(b"<!doctype html><html>", "text/html", "http://x/y")
    assert "HTML page" in text and "'GGUF'" in text and "<!doctype" in text


# -- model info and prompts ----------------------------------------------------------------------


def test_header_info_counts_match_the_file(tmp_path):
    from bitnet_web.convert.synthetic import write_random_bitnet
    from bitnet_web.formats.gguf_reader import open_gguf, parse_header
    from bitnet_web.web.shared.modelinfo import header_info, info_rows

    path = tmp_path / "m.gguf"
    size = write_random_bitnet(
        str(path), dim=128, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=256, vocab_size=300, context_length=512
    )
    data = np.fromfile(path, dtype=np.uint8)
    info = header_info(parse_header(data, size), size)
    ref = open_gguf(str(path))
    assert info["n_params"] == sum(t.n_elements for t in ref.tensors.values())
    assert info["context_length"] == 512 and info["vocab_size"] == 300 and info["arch"] == ref.architecture
    assert sum(info["weight_types"].values()) == info["n_params"]
    rows = dict(info_rows(info, {"context_used": 10}))
    assert rows["Context"] == "10 of 512 tokens used"


def test_clip_to_context_keeps_a_prefix_within_budget():
    text = "word " * 5000
    clipped, cut = clip_to_context(text, 1024, reserve_tokens=200)
    assert cut and text.strip().startswith(clipped) and len(clipped) <= (1024 - 200) * 3
    assert clip_to_context("short", 1024, 200) == ("short", False)
    assert summary_messages("abc")[-1]["content"].endswith("abc")


def test_turn_request_for_chat_and_completion_models():
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    how, messages = turn_request("bitnet", "sys", history, "c")
    assert how == "chat" and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[-1]["content"] == "c" and turn_request("llama3", "  ", [], "x")[1][0]["role"] == "user"
    assert turn_request("completion", "sys", history, "c") == ("complete", "abc")
