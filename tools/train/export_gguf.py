"""Export the trained ternary checkpoint to GGUF I2_S (architecture `bitnet-b1.58`) plus a model card.

Input: `bitnet_ternary.pt` and `metrics.json` written by train.py, the tokenizer.json the corpus was
built with, and the corpus manifest. Output: static/models/<name>.gguf, <name>.json (model card data)
with greedy sample completions computed on the CPU from the exported file itself.

Tensors: token_embd F16 (tied LM head, no output.weight), norms F32, the seven BitLinear weights of
each block as I2_S (x86 layout, one absmean scale per tensor), written by the project's GGUFWriter.
Tokenizer: `gpt2` byte-level BPE with the Llama 3 pre-tokenizer (`tokenizer.ggml.pre = llama-bpe`),
no chat template (a completion model).

    python tools/train/export_gguf.py --checkpoint DIR/bitnet_ternary.pt --metrics DIR/metrics.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "app"))

from model import BitNetConfig, BitNetLM, greedy_generate  # noqa: E402
from train import CHECKPOINT_FORMAT, unpack_codes  # noqa: E402

from bitnet_web.convert.synthetic import bitnet_model_metadata  # noqa: E402
from bitnet_web.formats.ggml import GGMLType, Keys  # noqa: E402
from bitnet_web.formats.gguf_reader import open_gguf  # noqa: E402
from bitnet_web.formats.gguf_writer import GGUFWriter  # noqa: E402
from bitnet_web.formats.quants import i2s_decode  # noqa: E402
from bitnet_web.model.config import config_from_gguf  # noqa: E402
from bitnet_web.model.reference import ReferenceModel  # noqa: E402
from bitnet_web.text.tokenizer import Tokenizer  # noqa: E402

ARCH = "bitnet-b1.58"
DEFAULT_NAME = "bitnet-pystdlib-27m-i2_s"
# model module name (inside blocks.N) -> GGUF tensor name (inside blk.N)
LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "attn_sub_norm.weight": "attn_sub_norm.weight",
    "o_proj": "attn_output.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "ffn_sub_norm.weight": "ffn_sub_norm.weight",
    "down_proj": "ffn_down.weight",
}
SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    'class Stack:\n    """A simple LIFO stack."""\n\n    def __init__(self):\n',
    "    def test_split(self):\n        self.assertEqual(",
]


def tokenizer_metadata(tokenizer_json: Path) -> dict[str, object]:
    """gpt2-style GGUF vocabulary keys from a Hugging Face byte-level BPE tokenizer.json."""
    tj = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = tj["model"]["vocab"]
    added = {a["id"]: a for a in tj.get("added_tokens", [])}
    n = max([*vocab.values(), *added]) + 1
    tokens = [""] * n
    types = np.full(n, 1, dtype=np.int32)  # NORMAL
    for text, i in vocab.items():
        tokens[i] = text
    for i, a in added.items():
        tokens[i] = a["content"]
        types[i] = 3 if a.get("special") else 4  # CONTROL / USER_DEFINED
    if "" in tokens:
        raise ValueError(f"{tokenizer_json}: token ids are not contiguous (id {tokens.index('')} missing)")
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    ids = {t: tokens.index(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")}
    return {
        Keys.TOKENIZER_MODEL: "gpt2",
        Keys.TOKENIZER_PRE: "llama-bpe",  # the Llama 3 regex, which the tokenizer was trained with
        Keys.TOKENS: tokens,
        Keys.TOKEN_TYPE: types,
        Keys.MERGES: merges,
        Keys.BOS_ID: ids["<|begin_of_text|>"],
        Keys.EOS_ID: ids["<|end_of_text|>"],
        Keys.EOT_ID: ids["<|eot_id|>"],
        Keys.PAD_ID: ids["<|end_of_text|>"],
        Keys.ADD_BOS: True,
    }


def load_checkpoint(path: Path) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise SystemExit(f"{path}: format {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    return state


def write_gguf(state: dict, metrics: dict, manifest: dict, tokenizer_json: Path, out: Path, description: str) -> int:
    cfg = state["config"]
    tensors = state["tensors"]
    w = GGUFWriter(str(out))
    w.add_dict(
        bitnet_model_metadata(
            ARCH,
            dim=cfg["dim"],
            n_layers=cfg["n_layers"],
            n_heads=cfg["n_heads"],
            n_kv_heads=cfg["n_kv_heads"],
            ffn_dim=cfg["ffn_dim"],
            vocab_size=cfg["vocab_size"],
            context_length=cfg["context_length"],
            rope_theta=cfg["rope_theta"],
            norm_eps=cfg["norm_eps"],
            name=out.stem,
        )
    )
    w.add("general.description", description)
    w.add("general.license", "MIT")
    w.add_dict(tokenizer_metadata(tokenizer_json))

    def ternary(module: str) -> tuple[np.ndarray, float]:
        t = tensors[module]
        return unpack_codes(t["packed"].numpy(), tuple(t["shape"])), float(t["scale"])

    embd = tensors["token_embd.weight"].numpy().astype(np.float16)
    w.add_tensor("token_embd.weight", embd.shape, GGMLType.F16, embd)
    for i in range(cfg["n_layers"]):
        for src, dst in LAYER_TENSORS.items():
            key = f"blocks.{i}.{src}"
            if src.endswith(".weight"):
                arr = tensors[key].numpy().astype(np.float32)
                w.add_tensor(f"blk.{i}.{dst}", arr.shape, GGMLType.F32, arr)
            else:
                values, scale = ternary(key)
                w.add_tensor(f"blk.{i}.{dst}", values.shape, GGMLType.I2_S, (values, scale))
    norm = tensors["output_norm.weight"].numpy().astype(np.float32)
    w.add_tensor("output_norm.weight", norm.shape, GGMLType.F32, norm)
    return w.write()


def torch_model_from_gguf(gguf) -> BitNetLM:
    """The training model in inference ('frozen') mode with every weight read back from the GGUF."""
    cfg = config_from_gguf(gguf)
    model = BitNetLM(
        BitNetConfig(
            vocab_size=cfg.vocab_size,
            dim=cfg.dim,
            n_layers=cfg.n_layers,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            ffn_dim=cfg.ffn_dim,
            context_length=cfg.context_length,
            rope_theta=cfg.rope_theta,
            norm_eps=cfg.norm_eps,
        )
    )
    gguf_names = {"token_embd.weight": "token_embd.weight", "output_norm.weight": "output_norm.weight"}
    for i in range(cfg.n_layers):
        for src, dst in LAYER_TENSORS.items():
            gguf_names[f"blocks.{i}.{src}"] = f"blk.{i}.{dst}"
    with torch.no_grad():
        for src, name in gguf_names.items():
            info = gguf.tensors[name]
            if info.ggml_type == GGMLType.I2_S:
                values, scale = i2s_decode(gguf.tensor_bytes(name), info.shape)
                model.get_submodule(src).load_ternary(torch.from_numpy(values.copy()), scale)
            else:
                model.get_parameter(src).copy_(torch.from_numpy(np.array(gguf.tensor(name), np.float32)))
    model.set_mode("frozen")
    return model.eval()


def sample_completions(gguf_path: Path, n_new: int) -> list[dict[str, str]]:
    """Greedy continuations from the written file: generated by the PyTorch model loaded from it, then
    confirmed in one teacher-forced pass of the project's numpy reference (at every generated position
    its argmax must be the token chosen, up to near-ties)."""
    g = open_gguf(str(gguf_path))
    tok = Tokenizer.from_gguf(g.metadata)
    model = torch_model_from_gguf(g)
    ref = ReferenceModel(g)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt, add_bos=True)
        out = greedy_generate(model, ids, n_new)
        rows = ref.logits(ids + out)[len(ids) - 1 : -1]
        gaps = rows.max(axis=-1) - rows[np.arange(len(out)), out]  # 0 where the reference agrees
        if gaps.max() >= 0.4:  # only near-ties may differ (int8 rounding; tests/test_trained_model.py)
            raise SystemExit(f"numpy reference and PyTorch disagree on the greedy continuation of {prompt!r}")
        stop = next((i for i, t in enumerate(out) if t in tok.stop_ids), len(out))
        samples.append({"prompt": prompt, "completion": tok.decode(out[:stop])})
    return samples


PERPLEXITY_MEANING = {
    "unigram": "train-split token frequencies (add-one smoothing), no context",
    "exported_ternary": "this GGUF: ternary weights, int8 activations, F16 embedding, float32 math",
    "qat_model_qat_mode_bf16": "the QAT network as trained (on-the-fly ternarization, bf16 autocast)",
    "qat_model_full_precision_mode": "the QAT network's latent weights used unquantized (not what it was trained for)",
    "fp_twin_full_precision": "same architecture, data order and steps trained without any quantization",
    "fp_twin_ternarized_after_training": "that full-precision twin ternarized after training (no QAT)",
}


def steady_tokens_per_s(train_log: Path, run: str, tokens_per_step: int, skip_steps: int = 100) -> float | None:
    """Training throughput after compilation and warm-up, from the logged step times."""
    if not train_log.exists():
        return None
    rows = [json.loads(line) for line in train_log.read_text().splitlines()]
    rows = [r for r in rows if r.get("run") == run and "loss" in r and r["step"] >= skip_steps]
    if len(rows) < 2:
        return None
    return (rows[-1]["step"] - rows[0]["step"]) * tokens_per_step / (rows[-1]["elapsed_s"] - rows[0]["elapsed_s"])


def model_card(
    out: Path, metrics: dict, manifest: dict, tokenizer_json: Path, samples: list[dict], train_log: Path
) -> dict:
    cfg = metrics["config"]
    hp = metrics["hyperparameters"]
    tokens_per_step = hp["batch_size"] * hp["seq_len"]
    val = metrics["validation"]
    qat = metrics["runs"]["qat"]
    n_ternary = cfg["n_layers"] * (
        cfg["dim"] * cfg["dim"] * 2
        + 2 * cfg["dim"] * cfg["n_kv_heads"] * (cfg["dim"] // cfg["n_heads"])
        + 3 * cfg["dim"] * cfg["ffn_dim"]
    )
    return {
        "name": out.stem,
        "file": out.name,
        "file_bytes": out.stat().st_size,
        "file_sha256": hashlib.sha256(out.read_bytes()).hexdigest(),
        "architecture": ARCH,
        "kind": "Python source code completion (not chat-tuned)",
        "license": "MIT (model weights, as the bitnet-web project); training text PSF-2.0",
        "config": cfg,
        "parameters": {
            "ternary": n_ternary,
            "embedding_f16": cfg["vocab_size"] * cfg["dim"],
            "norms_f32": cfg["n_layers"] * (2 * cfg["dim"] + cfg["dim"] + cfg["ffn_dim"]) + cfg["dim"],
        },
        "corpus": {
            "source": manifest["source"],
            "python_version": manifest["python_version"],
            "license": manifest["license"],
            "selection": manifest["selection"],
            "file_list_sha256": manifest["file_list_sha256"],
            "train": {k: v for k, v in manifest["splits"]["train"].items() if k != "paths"},
            "val": {k: v for k, v in manifest["splits"]["val"].items() if k != "paths"},
            "skipped_not_utf8": manifest["skipped_not_utf8"],
        },
        "tokenizer": {
            "type": "byte-level BPE (HF tokenizers), Llama 3 pre-tokenizer regex",
            "vocab_size": cfg["vocab_size"],
            "sha256": hashlib.sha256(tokenizer_json.read_bytes()).hexdigest(),
            "special_tokens": {"<|begin_of_text|>": 0, "<|end_of_text|>": 1, "<|eot_id|>": 2},
        },
        "training": {
            "steps": qat["steps"],
            "selected_step": qat["selected_step"],
            "selection": "the step with the lowest validation loss among evaluations every "
            f"{hp['eval_every']} steps (early stopping: later steps overfit)",
            "tokens_trained": qat["tokens_trained"],
            "tokens_at_selected_step": qat["selected_step"] * tokens_per_step,
            "epochs": round(qat["epochs"], 3),
            "wall_s_including_compile_and_evals": round(qat["wall_s"], 1),
            "steady_tokens_per_s": steady_tokens_per_s(train_log, "qat", tokens_per_step),
            "device": metrics["environment"]["device"],
            "torch": metrics["environment"]["torch"],
            "command": "python tools/train/train.py --data .device-carry/stdlib-corpus --out OUT "
            f"--steps {qat['steps']} --eval-every {hp['eval_every']} --fp-twin --seed {hp['seed']}",
            "hyperparameters": {
                k: hp[k]
                for k in (
                    "seed",
                    "seq_len",
                    "batch_size",
                    "lr",
                    "fp_lr",
                    "warmup",
                    "min_lr_ratio",
                    "weight_decay",
                    "grad_clip",
                )
            }
            | {"optimizer": "AdamW (0.9, 0.95), cosine schedule, bf16 autocast, float32 master weights"},
        },
        "validation_perplexity": {k: round(v["perplexity"], 3) for k, v in val.items()},
        "validation_nll_per_token": {k: round(v["nll_per_token"], 5) for k, v in val.items()},
        "validation_perplexity_meaning": PERPLEXITY_MEANING,
        "validation_tokens": metrics["validation_split"]["target_tokens"],
        "fp_twin_training": metrics["runs"].get("fp_twin"),
        "samples_greedy": samples,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="bitnet_ternary.pt from train.py")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics.json from the same run")
    parser.add_argument("--tokenizer", type=Path, default=Path(__file__).with_name("tokenizer.json"))
    parser.add_argument("--manifest", type=Path, default=REPO_ROOT / ".device-carry/stdlib-corpus/manifest.json")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "static" / "models")
    parser.add_argument("--name", default=DEFAULT_NAME)
    parser.add_argument("--sample-tokens", type=int, default=48)
    args = parser.parse_args()

    torch.set_num_threads(1)  # short CPU sequences: threads only contend (see the test's note)
    state = load_checkpoint(args.checkpoint)
    metrics = json.loads(args.metrics.read_text())
    manifest = json.loads(args.manifest.read_text())
    tok_sha = hashlib.sha256(args.tokenizer.read_bytes()).hexdigest()
    if manifest["tokenizer_sha256"] != tok_sha:
        raise SystemExit(
            f"{args.tokenizer} (sha256 {tok_sha}) is not the tokenizer the corpus was built with "
            f"({manifest['tokenizer_sha256']})"
        )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.name}.gguf"
    hp = metrics["hyperparameters"]
    selected_tokens = state["info"]["selected_step"] * hp["batch_size"] * hp["seq_len"]
    description = (
        "BitNet b1.58 Python-code completion model (not chat-tuned) trained by bitnet-web with "
        f"quantization-aware training on the CPython {manifest['python_version']} standard library source "
        f"(PSF-2.0 license). {selected_tokens:,} training tokens, context "
        f"{state['config']['context_length']} tokens. Use it in completion mode: give it the start of a "
        f"Python file or function. Corpus file list sha256 {manifest['file_list_sha256']}."
    )
    size = write_gguf(state, metrics, manifest, args.tokenizer, out, description)
    print(f"wrote {out}: {size} bytes")
    samples = sample_completions(out, args.sample_tokens)
    card = model_card(out, metrics, manifest, args.tokenizer, samples, args.metrics.with_name("train_log.jsonl"))
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(card, indent=1) + "\n")
    print(json.dumps(card["validation_perplexity"], indent=1))
    for s in samples:
        print("----\n" + s["prompt"] + "\u2502" + s["completion"])


if __name__ == "__main__":
    main()
