"""Untrusted model metadata, CPython side: a model whose vocabulary holds HTML/JS tokens and whose
general.name and chat template hold HTML, JS and Jinja code.

Loading works; chat templates are only recognised by their text, never executed (the templates below
would create a marker file, print, or raise if any Jinja engine ran them: a positive control renders
them with jinja2 and sees exactly that); describe() and engine.info carry the strings verbatim as
text (escaping is the page's job, tested by the browser tests); message contents never become control
tokens even when a control token's text is HTML.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bitnet_web.convert.synthetic import random_bitnet_writer, synthetic_vocab_metadata  # noqa: E402
from bitnet_web.formats.ggml import Keys  # noqa: E402
from bitnet_web.formats.gguf_reader import open_gguf
from bitnet_web.text.bpe import BYTE_TO_UNICODE
from bitnet_web.text.chat import ChatTemplate  # noqa: E402
from bitnet_web.text.sampler import SamplerSettings  # noqa: E402
from bitnet_web.text.tokenizer import StreamDecoder, Tokenizer, TokenType  # noqa: E402

VOCAB = 300
IMG = "<img src=x onerror=alert(1)>"
SCRIPT = "<script>alert(1)</script>"
SVG = "\"'></textarea><svg onload=alert(document.cookie)>"
NAME = "<img src=x onerror=alert('name')> \"quoted\" <script>alert(2)</script> {{ 7*7 }}"
HOSTILE_TOKENS = {256: (IMG, TokenType.NORMAL), 257: (SCRIPT, TokenType.CONTROL), 258: (SVG, TokenType.NORMAL)}


def payload(marker: Path) -> str:
    """Jinja that, if executed, touches `marker`, prints, walks Python's class tree and raises."""
    return (
        "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
        "{{ self.__init__.__globals__.__builtins__.print('TEMPLATE EXECUTED') }}"
        "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        "{% for i in range(3) %}{{ raise_exception('template executed') }}{% endfor %}"
    )


def llama3_looking_template(marker: Path) -> str:
    """Recognised as llama3 by its header tokens; the payload sits inside the message loop."""
    return (
        "{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        + payload(marker)
        + "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )


def unrecognised_template(marker: Path) -> str:
    return payload(marker) + SCRIPT + "{% for m in messages %}{{ m.content }}{% endfor %}"


def hostile_vocab() -> dict[str, object]:
    md = synthetic_vocab_metadata(VOCAB)
    b2u = BYTE_TO_UNICODE
    tokens = list(md[Keys.TOKENS])
    token_type = md[Keys.TOKEN_TYPE].copy()
    for tid, (text, ttype) in HOSTILE_TOKENS.items():
        # Normal byte-level BPE tokens are stored in the GPT-2 byte alphabet; control tokens as text.
        tokens[tid] = text if ttype == TokenType.CONTROL else "".join(b2u[b] for b in text.encode())
        token_type[tid] = ttype
    md[Keys.TOKENS] = tokens
    md[Keys.TOKEN_TYPE] = token_type
    md[Keys.PAD_ID] = 257
    return md


def write_hostile_model(path: Path, template: str) -> str:
    md = hostile_vocab()
    md[Keys.CHAT_TEMPLATE] = template
    w = random_bitnet_writer(
        str(path),
        dim=128,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        ffn_dim=256,
        vocab_size=VOCAB,
        context_length=512,
        tokenizer_metadata=md,
        seed=2,
    )
    w.metadata[Keys.NAME] = NAME
    w.write()
    return str(path)


@pytest.mark.parametrize("make_template", [llama3_looking_template, unrecognised_template])
def test_payload_templates_are_live_under_jinja(tmp_path, capfd, make_template):
    """Positive control: the templates really execute code when a Jinja engine renders them, so the
    absence of their effects elsewhere proves they were not run."""
    jinja2 = pytest.importorskip("jinja2")
    marker = tmp_path / "executed"
    template = jinja2.Environment().from_string(make_template(marker))
    with pytest.raises(jinja2.exceptions.UndefinedError, match="raise_exception"):
        template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert marker.exists()
    assert "TEMPLATE EXECUTED" in capfd.readouterr().out


# Runs in a fresh interpreter so that "jinja2 was never imported" means something (other tests in the
# same session import transformers, which imports jinja2).
_NO_JINJA_SCRIPT = r"""
import json, sys
from bitnet_web.text.chat import ChatTemplate
from bitnet_web.formats.gguf_reader import describe, open_gguf
from bitnet_web.text.tokenizer import Tokenizer
g = open_gguf(sys.argv[1])
tok = Tokenizer.from_gguf(g.metadata)
template = ChatTemplate.from_gguf(g.metadata)
messages = [{"role": "system", "content": "<script>alert(1)</script>"}, {"role": "user", "content": "hi"}]
ids = template.render_tokens(tok, messages)
print(json.dumps({"kind": template.kind, "note": template.note, "describe": describe(g),
                  "decoded": tok.decode(ids), "jinja": sorted(m for m in sys.modules if "jinja" in m)}))
"""


@pytest.mark.parametrize(
    ("make_template", "kind"), [(llama3_looking_template, "llama3"), (unrecognised_template, "completion")]
)
def test_templates_are_recognised_by_text_never_executed(tmp_path, make_template, kind):
    marker = tmp_path / "executed"
    template = make_template(marker)
    path = write_hostile_model(tmp_path / "hostile.gguf", template)
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "app"), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", _NO_JINJA_SCRIPT, path],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert "TEMPLATE EXECUTED" not in run.stdout + run.stderr
    assert not marker.exists()
    assert out["jinja"] == []  # no template engine was even imported
    assert out["kind"] == kind
    if kind == "completion":
        assert out["note"] == "tokenizer.chat_template not recognised"
    # The rendered prompt is the Python format's, with the contents as plain text: nothing from the
    # template's own text besides what the known format prescribes.
    assert "__class__" not in out["decoded"] and "os.system" not in out["decoded"]
    assert SCRIPT in out["decoded"]
    # describe(): the name and the start of the template verbatim.
    assert f"name: {NAME}" in out["describe"]
    assert template[:160].replace("\n", "\\n") in out["describe"]
    assert f"pad 257 {SCRIPT!r}" in out["describe"]


def test_hostile_tokens_decode_verbatim_and_content_cannot_produce_them(tmp_path):
    g = open_gguf(write_hostile_model(tmp_path / "m.gguf", llama3_looking_template(tmp_path / "x")))
    tok = Tokenizer.from_gguf(g.metadata)
    for tid, (text, _) in HOSTILE_TOKENS.items():
        assert tok.decode([tid]) == text
        stream = StreamDecoder(tok)
        assert stream.push(tid) + stream.flush() == text
    assert tok.is_special(257) and tok.decode([5, 257, 6], skip_special=True) == tok.decode([5, 6])
    # The control token's text typed by a user stays plain text.
    template = ChatTemplate.from_gguf(g.metadata)
    ids = template.render_tokens(tok, [{"role": "user", "content": f"{SCRIPT} and {IMG}"}])
    assert 257 not in ids
    assert tok.decode(ids).count(SCRIPT) == 1 and IMG in tok.decode(ids)
    assert tok.encode(SCRIPT, allow_special=True) == [257]  # (markup could produce it)


@pytest.mark.gpu
@pytest.mark.slow
def test_engine_loads_and_chats_with_hostile_metadata(tmp_path, capfd):
    from bitnet_web.engine import Engine

    marker = tmp_path / "executed"
    path = write_hostile_model(tmp_path / "hostile.gguf", llama3_looking_template(marker))
    engine = Engine(prefill_chunk=32)
    try:
        engine.load(path)
        info = engine.info
        assert info["description"] == NAME  # verbatim, as text
        assert info["template_kind"] == "llama3"
        json.dumps(info)  # plain data for the page
        for settings in (SamplerSettings(temperature=0), SamplerSettings(temperature=1.0, seed=3)):
            messages = [{"role": "system", "content": NAME}, {"role": "user", "content": f"{SCRIPT}{IMG}"}]
            text = "".join(engine.generate(messages=messages, settings=settings, max_tokens=8))
            if engine.last_stats.stop_reason != "stop_string":
                assert text == engine.tokenizer.decode(engine.generated_tokens)  # the stream, verbatim
            assert 257 not in engine.encode_chat(messages)
    finally:
        engine.close()
    assert not marker.exists()
    assert "TEMPLATE EXECUTED" not in capfd.readouterr().out
