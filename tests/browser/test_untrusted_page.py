"""Untrusted model output in the chat page: a model whose greedy reply is HTML and JS.

The model reuses tests/test_untrusted_metadata.py's hostile vocabulary (`<img src=x onerror=alert(1)>`,
a `<script>alert(1)</script>` control token, a quote-breaking `<svg onload>`, an HTML/JS/Jinja
general.name and a chat template carrying Jinja code) and adds two tokens whose payloads would set
`window.__pwned`. Its weights make the reply a fixed chain through all five hostile tokens whatever
the prompt: a 1000 x one-hot embedding dominates the residual stream (the random layer adds O(1)), so
the logits depend only on the current token, and output.weight maps each token of the chain to the
next one (a bigram table). The CPython engine, run on the same file, is the reference: the page must
show exactly its text, and the test first checks that this text holds every payload.

Nothing may execute: no payload flag, no dialog (alert), no <img>/<script>/<svg> element created
anywhere in the page (MutationObserver), the reply bubble holds text nodes only.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import (
    GREEDY_FORM,
    SYSTEM,
    app_page,
    cpython_turn,
    load_custom,
    model_info,
    needs_engine,
    notice,
    screenshot,
    send_and_wait,
    set_settings,
)

from bitnet_web.convert.synthetic import random_bitnet_writer
from bitnet_web.formats.ggml import Keys
from bitnet_web.text.bpe import BYTE_TO_UNICODE
from bitnet_web.text.tokenizer import TokenType
from bitnet_web.web.shared.settings import parse_form

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_untrusted_metadata as hostile  # noqa: E402  (tests/: the CPython side's builder)

pytestmark = [pytest.mark.browser, needs_engine]

IMG_FLAG = "<img src=x onerror=\"window.__pwned='img'\">"
SCRIPT_FLAG = "<script>window.__pwned='script'</script>"
FLAG_TOKENS = {259: IMG_FLAG, 260: SCRIPT_FLAG}
DIM = 128
SETTINGS = {**GREEDY_FORM, "max_tokens": "8"}

# Any element of these kinds appearing in the page after it started is a failure.
_WATCH = """() => {
  window.__added = [];
  new MutationObserver((records) => {
    for (const r of records) for (const n of r.addedNodes) {
      if (n.nodeType !== 1) continue;
      for (const e of [n, ...n.querySelectorAll('*')]) {
        if (['IMG', 'SCRIPT', 'SVG', 'IFRAME', 'OBJECT', 'EMBED'].includes(e.tagName.toUpperCase()))
          window.__added.push(e.outerHTML.slice(0, 200));
      }
    }
  }).observe(document.body, {childList: true, subtree: true});
}"""


def write_hostile_reply_model(path: Path, marker: Path) -> None:
    md = hostile.hostile_vocab()
    b2u = BYTE_TO_UNICODE
    tokens, token_type = list(md[Keys.TOKENS]), md[Keys.TOKEN_TYPE].copy()
    for tid, text in FLAG_TOKENS.items():
        tokens[tid] = "".join(b2u[b] for b in text.encode())  # normal byte-level BPE tokens
        token_type[tid] = TokenType.NORMAL
    md[Keys.TOKENS], md[Keys.TOKEN_TYPE] = tokens, token_type
    md[Keys.CHAT_TEMPLATE] = hostile.llama3_looking_template(marker)
    writer = random_bitnet_writer(
        str(path),
        dim=DIM,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=256,
        vocab_size=hostile.VOCAB,
        context_length=512,
        tokenizer_metadata=md,
        seed=2,
        untied=True,
    )
    writer.metadata[Keys.NAME] = hostile.NAME
    # the reply: both flag tokens, then the three hostile tokens of the CPython test, then EOS
    chain = [259, 260, *hostile.HOSTILE_TOKENS, md[Keys.EOS_ID]]
    assert len({t % DIM for t in chain}) == len(chain), "two chain tokens share an embedding slot"
    embedding = np.zeros((hostile.VOCAB, DIM), np.float32)
    embedding[np.arange(hostile.VOCAB), np.arange(hostile.VOCAB) % DIM] = 1000.0
    output = np.zeros((hostile.VOCAB, DIM), np.float32)
    output[chain[0], :] = 4.0  # from any token outside the chain: start it
    for current, following in zip(chain[:-1], chain[1:], strict=True):
        output[chain[0], current % DIM] = 0.0
        output[following, current % DIM] = 8.0
    replace = {"token_embd.weight": embedding, "output.weight": output}
    writer.tensors = [
        t._replace(source=replace[t.name].astype("<f2")) if t.name in replace else t for t in writer.tensors
    ]
    writer.write()


@pytest.fixture(scope="module")
def model_path(test_files) -> Path:
    path = test_files / "hostile-reply.gguf"
    write_hostile_reply_model(path, test_files / "TEMPLATE-EXECUTED")
    return path


@pytest.fixture(scope="module")
def app(browser, site):
    with app_page(browser, site) as page:
        dialogs: list[str] = []
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.evaluate(_WATCH)
        page.bitnet_dialogs = dialogs
        yield page


def assert_nothing_ran(page) -> None:
    assert page.evaluate("() => window.__pwned") is None, "a payload from the model ran"
    assert page.bitnet_dialogs == [], f"a payload opened dialogs: {page.bitnet_dialogs}"
    assert page.evaluate("() => window.__added") == [], "elements were created from model text"


def test_hostile_metadata_is_shown_as_text(app, site, model_path, test_files):
    assert load_custom(app, site.url + "_test/" + model_path.name) == "loaded", notice(app)
    info = model_info(app)
    assert info["Name"] == hostile.NAME
    assert info["Chat format"] == "llama3"  # recognised by its text; the Jinja in it never runs
    assert not (test_files / "TEMPLATE-EXECUTED").exists()
    assert_nothing_ran(app)


def test_a_reply_made_of_html_and_script_tokens_is_shown_literally(app, model_path):
    settings = parse_form(SETTINGS)
    expected = cpython_turn(model_path, SYSTEM, [], "hi", settings)
    for payload in (IMG_FLAG, SCRIPT_FLAG, hostile.IMG, hostile.SVG, hostile.SCRIPT):
        assert payload in expected, f"the model's greedy reply {expected!r} lacks {payload!r}"
    set_settings(app, SETTINGS, SYSTEM)
    reply = send_and_wait(app, "hi")
    assert reply["state"] == "done"
    assert reply["text"] == expected
    bubble = app.locator(".msg.assistant .text").last
    assert bubble.evaluate("(t) => t.childElementCount") == 0, "the reply holds elements, not only text"
    assert app.locator("#messages img, #messages script, #messages svg").count() == 0
    app.wait_for_timeout(500)  # an onerror / onload handler would have fired by now
    assert_nothing_ran(app)
    screenshot(app, "chat-untrusted-reply")


def test_the_hostile_reply_goes_back_into_the_prompt_as_text(app, model_path, test_files):
    """The second turn carries the first reply in its history: its `<script>` text must stay
    plain-text tokens (not the control token), so the reply equals CPython's for that history."""
    settings = parse_form(SETTINGS)
    first = app.locator(".msg.assistant .text").last.text_content()
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first}]
    reply = send_and_wait(app, "and again")
    assert reply["state"] == "done"
    assert reply["text"] == cpython_turn(model_path, SYSTEM, history, "and again", settings)
    assert_nothing_ran(app)
    # the CPython reference rendered the same template three times: had it run the Jinja payload,
    # the marker file would exist
    assert not (test_files / "TEMPLATE-EXECUTED").exists()
