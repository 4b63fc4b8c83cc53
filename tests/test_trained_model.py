"""The bundled trained model (static/models/): the exported GGUF against the training code.

Checks, all on the CPU:
- the file is what the model card says (size, hash, config) and small enough to bundle;
- its vocabulary, read by our tokenizer from the GGUF, encodes exactly like Hugging Face `tokenizers`
  with the tokenizer.json it was trained as;
- greedy continuations (64 tokens, several prompts) from the project's numpy reference forward pass
  equal those of the PyTorch training model (tools/train/model.py, inference mode, float32) loaded
  with the GGUF's weights, and their logits agree to int8-rounding tolerance;
- the model actually learned: on a held-out stdlib file its perplexity is far below the unigram
  baseline of the card (a wrong tensor mapping or layout would not be).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from bitnet_web.config import config_from_gguf
from bitnet_web.gguf import GGMLType, open_gguf
from bitnet_web.quants import i2s_decode
from bitnet_web.reference import ReferenceModel
from bitnet_web.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
MODEL_PATH = Path(os.environ.get("BITNET_TRAINED_MODEL", REPO / "static/models/bitnet-pystdlib-27m-i2_s.gguf"))
CARD_PATH = MODEL_PATH.with_suffix(".json")
TOKENIZER_JSON = REPO / "tools/train/tokenizer.json"
MAX_BUNDLE_BYTES = 15 * 1024 * 1024
N_GREEDY = 64
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Stack:\n    \"\"\"A simple LIFO stack.\"\"\"\n\n    def __init__(self):\n        self.",
    "    def test_split(self):\n        self.assertEqual(",
    "# Copyright (C) 2001 Python Software Foundation\n\"\"\"Utilities for",
]

torch = pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tools/train"))
from model import BitNetConfig, BitNetLM  # noqa: E402

TORCH_TO_GGUF = {  # module inside blocks.N -> tensor inside blk.N
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
    "attn_norm": "attn_norm", "attn_sub_norm": "attn_sub_norm", "ffn_norm": "ffn_norm",
    "ffn_sub_norm": "ffn_sub_norm",
}


@pytest.fixture(scope="module")
def gguf():
    if not MODEL_PATH.exists():
        pytest.fail(f"the bundled model {MODEL_PATH} is missing (tools/train/export_gguf.py writes it)")
    return open_gguf(str(MODEL_PATH))


@pytest.fixture(scope="module")
def card() -> dict:
    return json.loads(CARD_PATH.read_text())


@pytest.fixture(scope="module")
def tokenizer(gguf) -> Tokenizer:
    return Tokenizer.from_gguf(gguf.metadata)


@pytest.fixture(scope="module")
def reference(gguf) -> ReferenceModel:
    return ReferenceModel(gguf)


@pytest.fixture(scope="module")
def torch_model(gguf) -> BitNetLM:
    """The training model in inference ('frozen') mode, every weight taken from the GGUF."""
    cfg = config_from_gguf(gguf)
    model = BitNetLM(BitNetConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, n_layers=cfg.n_layers,
                                  n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, ffn_dim=cfg.ffn_dim,
                                  context_length=cfg.context_length, rope_theta=cfg.rope_theta,
                                  norm_eps=cfg.norm_eps))
    with torch.no_grad():
        model.token_embd.weight.copy_(torch.from_numpy(np.asarray(gguf.tensor("token_embd.weight"), np.float32)))
        model.output_norm.weight.copy_(torch.from_numpy(np.asarray(gguf.tensor("output_norm.weight"), np.float32)))
        for i, block in enumerate(model.blocks):
            for module_name, tensor_name in TORCH_TO_GGUF.items():
                name = f"blk.{i}.{tensor_name}.weight"
                info = gguf.tensors[name]
                module = getattr(block, module_name)
                if info.ggml_type == GGMLType.I2_S:
                    values, scale = i2s_decode(gguf.tensor_bytes(name), info.shape)
                    module.load_ternary(torch.from_numpy(values.copy()), scale)
                else:
                    module.weight.copy_(torch.from_numpy(np.asarray(gguf.tensor(name), np.float32)))
    model.set_mode("frozen")
    return model.eval()


def torch_logits(model: BitNetLM, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].numpy()


def test_file_matches_card_and_is_small(gguf, card):
    data = MODEL_PATH.read_bytes()
    assert len(data) == card["file_bytes"] < MAX_BUNDLE_BYTES
    assert hashlib.sha256(data).hexdigest() == card["file_sha256"]
    cfg = config_from_gguf(gguf)
    for key in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "context_length"):
        assert getattr(cfg, key) == card["config"][key], key
    assert cfg.arch == "bitnet-b1.58" and cfg.rope_style == "neox" and cfg.activation == "relu2"
    assert cfg.tied_embeddings and cfg.has_sub_norms
    assert cfg.rope_theta == card["config"]["rope_theta"]


def test_tensor_types_are_the_bitnet_layout(gguf):
    types = {name: info.ggml_type for name, info in gguf.tensors.items()}
    assert types.pop("token_embd.weight") == GGMLType.F16
    assert "output.weight" not in types
    for name, t in types.items():
        expected = GGMLType.F32 if "norm" in name else GGMLType.I2_S
        assert t == expected, name


def test_completion_model_has_no_chat_template(gguf):
    assert "tokenizer.chat_template" not in gguf.metadata
    assert "completion" in gguf.metadata["general.description"].lower()


def _sample_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / name).read_text(encoding="utf-8") for name in ("fnmatch.py", "textwrap.py", "pprint.py")]
    texts += [
        "x = 1\r\n\tif x  >=  10_000:  return 'caf\u00e9' # \u00fcber \u4e2d\u6587 \U0001f600\n\n\n",
        "   leading spaces, trailing spaces   \n\n  \n",
        "<|begin_of_text|>special tokens stay plain text<|eot_id|>",
        "It's what they'd've done; I'll see, you're sure? 1234567 3.14159",
    ]
    return texts


def test_tokenizer_encodes_like_hf_tokenizers(tokenizer):
    hf = pytest.importorskip("tokenizers").Tokenizer.from_file(str(TOKENIZER_JSON))
    for text in _sample_texts():
        expected = hf.encode(text, add_special_tokens=False).ids
        # HF matches added tokens in raw text; ours only with allow_special=True. Compare like with like.
        ours = tokenizer.encode(text, allow_special=True)
        assert ours == expected, text[:60]
        assert tokenizer.decode(ours) == text
    assert tokenizer.encode("def f():", add_bos=True)[0] == tokenizer.bos_id == hf.token_to_id("<|begin_of_text|>")
    assert {tokenizer.eos_id, tokenizer.eot_id} <= tokenizer.stop_ids


def greedy(logits_fn, prompt_ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(np.argmax(logits_fn(ids)[-1])))
    return ids[len(prompt_ids):], logits_fn(ids)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_torch_model(prompt, tokenizer, reference, torch_model):
    ids = tokenizer.encode(prompt, add_bos=True)
    ref_tokens, ref_logits = greedy(reference.logits, ids, N_GREEDY)
    pt_tokens, pt_logits = greedy(lambda x: torch_logits(torch_model, x), ids, N_GREEDY)
    assert pt_tokens == ref_tokens, (tokenizer.decode(ref_tokens), tokenizer.decode(pt_tokens))
    # Same final sequence, so logits are comparable position by position: int8 rounding of one
    # activation can move a logit by ~1e-2 (ground-truth.md); a real bug moves them by O(1).
    scale = np.abs(ref_logits).max()
    assert np.abs(pt_logits - ref_logits).max() < 0.02 * scale
    assert len(set(ref_tokens)) > 3, "degenerate output: the model repeats one or two tokens"


def test_model_beats_unigram_on_held_out_file(tokenizer, reference, torch_model, card):
    # fnmatch.py is in the validation split (by path hash, tools/train/corpus.py): never trained on.
    sys.path.insert(0, str(REPO / "tools/train"))
    import corpus

    assert corpus.split_of("fnmatch.py") == "val"
    text = (Path(sysconfig.get_paths()["stdlib"]) / "fnmatch.py").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_bos=True)[:257]
    targets = np.array(ids[1:])

    def nll(logits: np.ndarray) -> float:
        logits = logits[:-1].astype(np.float64)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        return float(np.mean(logz - logits[np.arange(len(targets)), targets]))

    ref_nll = nll(reference.logits(ids))
    pt_nll = nll(torch_logits(torch_model, ids))
    assert abs(ref_nll - pt_nll) < 0.01
    unigram_ppl = card["validation_perplexity"]["unigram"]
    assert math.exp(ref_nll) < unigram_ppl / 4, (math.exp(ref_nll), unigram_ppl)
