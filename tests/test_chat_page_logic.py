"""The chat page's pure-Python policies (issue 16): completion-mode context trimming, allowed model
hosts from the CSP, settings wording and switches, reply notes, prefill progress."""

from __future__ import annotations

import re

import pytest

from bitnet_web.web.shared import hosts
from bitnet_web.web.shared.progress import cut_note, loaded_from, progress_text, stats_line
from bitnet_web.web.shared.prompts import keep_recent_tokens, reply_room
from bitnet_web.web.shared.settings import (
    FIELDS,
    Field,
    SettingsError,
    format_number,
    greedy,
    parse_field,
    parse_form,
    parse_value,
    speculate_option,
    to_engine_settings,
)


def _page_csp() -> str:
    import build

    return build.CSP_PAGE


@pytest.mark.parametrize("n", [1, 5, 99, 100, 101, 150, 199, 200, 201, 350, 1000])
def test_keep_recent_tokens_keeps_bos_and_the_newest_within_budget(n):
    ids = list(range(n))  # id i is the i-th token: what is kept must be BOS + a contiguous newest run
    budget = 100
    kept = keep_recent_tokens(ids, budget, keep_first=1, min_keep=30)
    assert len(kept) <= budget
    assert kept[0] == 0
    tail = kept[1:]
    assert tail == list(range(n - len(tail), n)), "the newest tokens, in order, without gaps"
    if n <= budget:
        assert kept == ids
    else:
        assert len(tail) >= 30, "the latest message (min_keep) is never cut when it fits"


def test_keep_recent_tokens_cut_is_stable_as_the_text_grows():
    """The same cut turn after turn (so the engine reuses its cached prefix) until the text grew by
    another half budget."""
    budget = 100
    cuts = []
    for n in range(101, 180):
        kept = keep_recent_tokens(list(range(n)), budget, keep_first=1)
        cuts.append(kept[1])
    assert len(set(cuts)) < len(cuts) / 10, f"the cut moved {len(set(cuts))} times in {len(cuts)} turns"


def test_reply_room_is_at_most_half_the_context():
    assert reply_room(512, 8) == 8 and reply_room(512, 5000) == 256 and reply_room(512, 0) == 1


def test_allowed_hosts_follow_the_build_csp():
    sources = hosts.connect_sources(_page_csp())
    assert "'self'" in sources
    page = "http://127.0.0.1:8000"
    assert hosts.allowed("http://127.0.0.1:8000/models/x.gguf", sources, page)
    assert hosts.allowed("https://huggingface.co/a/b/resolve/main/m.gguf", sources, page)
    assert hosts.allowed("https://cdn-lfs.hf.co/x", sources, page)
    assert not hosts.allowed("https://example.com/m.gguf", sources, page)
    assert not hosts.allowed("http://huggingface.co/m.gguf", sources, page), "scheme must match"
    assert not hosts.allowed("https://evilhuggingface.co/m.gguf", sources, page)
    assert not hosts.allowed("http://127.0.0.1:9999/m.gguf", sources, page), "another port is another origin"
    message = hosts.blocked_message("https://example.com/m.gguf", sources)
    assert message.startswith("example.com is not a host") and "https://example.com/m.gguf" in message, message
    assert "huggingface.co" in message and "this site" in message


def test_settings_numbers_read_as_written():
    seed = next(f for f in FIELDS if f.name == "seed")
    assert format_number(seed.high) == "4294967295" and format_number(0.7) == "0.7"
    with pytest.raises(SettingsError, match=re.escape("outside 0 to 4294967295")) as e:
        parse_value("seed", "-1")
    assert e.value.field == "seed"


def test_speculative_decoding_setting_bounds_and_wording():
    field = next(f for f in FIELDS if f.name == "speculate")
    assert field.label == "Speculative decoding (draft tokens)" and "0 = off" in field.hint
    assert parse_value("speculate", "") is None and field.blank == "auto"  # empty: the engine decides
    assert parse_value("speculate", " 4 ") == 4 and parse_value("speculate", "0") == 0
    for bad, words in (("9", "outside 0 to 8"), ("-1", "outside 0 to 8"), ("2.5", "not a whole number")):
        with pytest.raises(SettingsError, match=re.escape("Speculative decoding (draft tokens): ")) as e:
            parse_value("speculate", bad)
        assert words in str(e.value) and e.value.field == "speculate"
    assert greedy(8)["speculate"] is None  # the widget leaves it to the engine


def test_speculative_decoding_setting_bound_is_the_engines():
    speculative = pytest.importorskip("bitnet_web.kernels.speculative")  # merged from issue 15's engine work
    assert next(f for f in FIELDS if f.name == "speculate").high == speculative.SPECULATE_MAX


def test_speculate_reaches_an_engine_that_takes_it_and_is_reported_otherwise():
    async def drafting(prompt_ids, settings, max_tokens=256, stop_strings=(), speculate=0): ...

    async def plain(prompt_ids, settings, max_tokens=256, stop_strings=()): ...

    settings = parse_form({"speculate": "3"})
    assert speculate_option(settings, drafting) == ({"speculate": 3}, "")
    options, note = speculate_option(settings, plain)
    assert options == {} and note.startswith("speculative decoding (3 draft tokens) is not available")
    assert speculate_option(parse_form({}), drafting) == ({}, "")  # empty: the engine's default
    assert speculate_option(parse_form({"speculate": "0"}), drafting) == ({"speculate": 0}, "")  # off, said so
    assert speculate_option(parse_form({"speculate": "0"}), plain) == ({}, "")  # off, and it never drafts
    sampler = pytest.importorskip("bitnet_web.text.sampler")
    assert not hasattr(to_engine_settings(settings, sampler.SamplerSettings), "speculate")  # not a sampler field


def test_stats_line_counts_and_notes():
    assert stats_line({"n_generated": 1}).startswith("1 token") and "1 tokens" not in stats_line({"n_generated": 1})
    assert "2 tokens" in stats_line({"n_generated": 2})
    assert "oldest 40 tokens" in stats_line({"n_generated": 2, "dropped_tokens": 40})
    assert cut_note({"stop_reason": "max_tokens"}, {"max_tokens": 8}, 512).startswith("cut at Max tokens (8)")
    assert "512" in cut_note({"stop_reason": "context_full"}, {"max_tokens": 8}, 512)
    assert cut_note({"stop_reason": "eos"}, {}, 512) == ""


def test_a_switch_setting_parses_true_false_and_empty():
    """A kind-bool Field (shown as a checkbox) reads "true"/"false"; empty is its default; other text
    is refused naming the field."""
    switch = Field("draft", "Speculative decoding", bool, False, 0, 1, "faster on repetitive text")
    assert parse_field(switch, "true") is True and parse_field(switch, " False ") is False
    assert parse_field(switch, "") is False
    with pytest.raises(SettingsError, match="Speculative decoding: 'yes' is not true or false") as e:
        parse_field(switch, "yes")
    assert e.value.field == "draft"


def test_prefill_progress_and_a_stop_before_the_first_token():
    assert progress_text("prefill", 1024, 3000, None, None) == "Reading the prompt: 1,024 of 3,000 tokens"
    line = stats_line({"n_generated": 0, "ttft_s": 0.0}, "aborted")
    assert line == "0 tokens, stopped while reading the prompt", line
    assert stats_line({"n_generated": 3, "ttft_s": 0.25}, "aborted").endswith("first token after 0.25 s, stopped")


def test_only_a_download_is_said_to_come_from_the_network():
    said = {(source, copy): loaded_from(source, copy) for source in ("cache", "network") for copy in (False, True)}
    assert said[("cache", False)] == said[("cache", True)] and "browser storage" in said[("cache", True)]
    assert "offline copy" in said[("network", True)] and "Downloaded" in said[("network", False)]
    assert [k for k, text in said.items() if "Downloaded" in text] == [("network", False)]
