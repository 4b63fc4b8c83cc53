"""Train the bundled BitNet b1.58 model (quantization-aware) on the tokenized stdlib corpus.

Reproducible: one seed fixes the initialization and the data order (epochs of non-overlapping
windows, a seeded random shift and shuffle per epoch). The step count is either given (--steps) or,
with --steps 0, calibrated once from the measured step time so that training fits --time-budget;
the chosen count is written to metrics.json, and re-running with --steps N and the same seed
repeats the run (up to GPU non-determinism in float sums).

After training it evaluates, on the held-out validation split (files never seen in training):
  * the exported model: frozen ternary codes + scales, int8 activations, F16 embedding, float32 math;
  * the same network in full-precision mode (latent weights, no quantization);
  * with --fp-twin: the same architecture trained the same way without ternarization, as is and
    ternarized after training (post-training quantization);
  * a unigram baseline (train-split token frequencies, add-one smoothing).
and writes into --out: bitnet_ternary.pt (packed ternary checkpoint, input of export_gguf.py),
metrics.json and train_log.jsonl.

The bundled model (H100, ~5 min with the twin):
    python tools/train/train.py --data .device-carry/stdlib-corpus --out $OUT \
        --steps 1500 --eval-every 150 --fp-twin
Time-budgeted run:   python tools/train/train.py --out $OUT --time-budget 190
CPU smoke test:      python tools/train/train.py --smoke --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from model import BitLinear, BitNetConfig, BitNetLM

CHECKPOINT_FORMAT = "bitnet-web-ternary-v1"


# ----------------------------------------------------------------------------- data


@dataclass
class Corpus:
    train: np.ndarray  # (n_train,) uint16 token stream
    val: np.ndarray  # (n_val,) uint16
    manifest: dict


def load_corpus(data_dir: Path) -> Corpus:
    manifest = json.loads((data_dir / "manifest.json").read_text())
    train = np.fromfile(data_dir / "train.bin", dtype="<u2")
    val = np.fromfile(data_dir / "val.bin", dtype="<u2")
    for split, arr in (("train", train), ("val", val)):
        expected = manifest["splits"][split]["tokens"]
        if arr.size != expected:
            raise SystemExit(f"{data_dir}/{split}.bin has {arr.size} tokens, manifest.json says {expected}")
    return Corpus(train, val, manifest)


def smoke_corpus(vocab: int, seed: int) -> Corpus:
    """A tiny synthetic corpus with learnable structure (repeated random phrases) for --smoke."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(3, vocab, size=int(rng.integers(4, 12))) for _ in range(40)]

    def stream(n_docs: int) -> np.ndarray:
        docs = [np.concatenate([[0], *[phrases[i] for i in rng.integers(0, 40, 30)], [1]]) for _ in range(n_docs)]
        return np.concatenate(docs).astype(np.uint16)

    return Corpus(stream(60), stream(6), {"source": "synthetic smoke-test corpus"})


class WindowSampler:
    """Deterministic batches of (seq_len + 1)-token windows: each epoch uses every window once."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size = tokens, seq_len, batch_size
        self.rng = np.random.default_rng(seed)
        self.epoch, self.queue = 0, np.zeros(0, dtype=np.int64)

    def _refill(self) -> None:
        shift = int(self.rng.integers(0, self.seq_len))
        n_windows = (self.tokens.size - shift - 1) // self.seq_len
        starts = shift + self.seq_len * np.arange(n_windows, dtype=np.int64)
        self.queue = np.concatenate([self.queue, self.rng.permutation(starts)])
        self.epoch += 1

    def next_batch(self) -> np.ndarray:
        while self.queue.size < self.batch_size:
            self._refill()
        starts, self.queue = self.queue[: self.batch_size], self.queue[self.batch_size :]
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return self.tokens[idx].astype(np.int64)  # (B, T + 1)


def val_windows(val: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping (seq_len + 1)-token windows sharing one token at the seams: every val token
    after the first is a prediction target exactly once."""
    n = (val.size - 1) // seq_len
    idx = seq_len * np.arange(n)[:, None] + np.arange(seq_len + 1)[None, :]
    return val[idx].astype(np.int64)


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: BitNetLM, windows: torch.Tensor, mode: str, autocast: bool, batch: int = 32) -> dict:
    model.eval()
    model.set_mode(mode)
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(w[:, :-1])
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), w[:, 1:].reshape(-1), reduction="sum")
        total += float(nll)
        count += w[:, 1:].numel()
    model.train()
    return {"nll_per_token": total / count, "perplexity": math.exp(total / count), "tokens": count}


def unigram_eval(train: np.ndarray, windows: np.ndarray, vocab: int) -> dict:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0  # add-one smoothing
    logp = np.log(counts / counts.sum())
    targets = windows[:, 1:].reshape(-1)
    nll = float(-logp[targets].mean())
    return {"nll_per_token": nll, "perplexity": math.exp(nll), "tokens": int(targets.size)}


# ----------------------------------------------------------------------------- checkpoint


def pack_codes(codes: torch.Tensor) -> np.ndarray:
    """int8 codes {-1,0,1} -> uint8, 4 per byte (value+1 at bits 0,2,4,6 of consecutive elements)."""
    c = (codes.to(torch.int16).cpu().numpy().reshape(-1) + 1).astype(np.uint8)
    c = c.reshape(-1, 4)
    return c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)


def unpack_codes(packed: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    p = np.asarray(packed, dtype=np.uint8)
    c = np.stack([(p >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)
    return (c.astype(np.int8) - 1).reshape(shape)


def save_ternary_checkpoint(model: BitNetLM, path: Path, info: dict) -> None:
    """The exported content only: F16 embedding, F32 norms, packed ternary codes + F32 scales."""
    state: dict[str, object] = {"format": CHECKPOINT_FORMAT, "config": model.cfg.to_dict(), "info": info}
    tensors: dict[str, object] = {}
    for name, p in model.named_parameters():
        module_name = name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        if isinstance(module, BitLinear):
            module.freeze()
            tensors[module_name] = {
                "packed": torch.from_numpy(pack_codes(module.codes)),
                "shape": tuple(module.codes.shape),
                "scale": float(module.scale),
            }
        elif name == "token_embd.weight":
            tensors[name] = p.detach().to(torch.float16).cpu()
        else:
            tensors[name] = p.detach().float().cpu()
    state["tensors"] = tensors
    torch.save(state, path)


def load_ternary_checkpoint(path: Path, device: str = "cpu") -> BitNetLM:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: format {state.get('format')!r}, expected {CHECKPOINT_FORMAT!r}")
    model = BitNetLM(BitNetConfig(**state["config"])).to(device)
    for name, value in state["tensors"].items():
        if isinstance(value, dict):
            codes = torch.from_numpy(unpack_codes(value["packed"].numpy(), value["shape"]))
            model.get_submodule(name).load_ternary(codes, value["scale"])
        else:
            with torch.no_grad():
                model.get_parameter(name).copy_(value.float())
    model.set_mode("frozen")
    return model


# ----------------------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: BitNetLM, lr: float, weight_decay: float, device: str) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if n.endswith("proj.weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("proj.weight")]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")


def train_run(
    label: str,
    mode: str,
    args: argparse.Namespace,
    cfg: BitNetConfig,
    corpus: Corpus,
    val: torch.Tensor,
    steps: int,
    budget_s: float,
    lr: float,
    log,
) -> tuple[BitNetLM, dict]:
    """Train one model in `mode` ('qat' or 'fp'). steps == 0: calibrate the count from budget_s."""
    torch.manual_seed(args.seed)
    device = args.device
    model = BitNetLM(cfg).to(device)
    model.set_mode(mode)
    opt = make_optimizer(model, lr, args.weight_decay, device)
    fwd = model
    if args.compile:
        fwd = torch.compile(model)
    sampler = WindowSampler(corpus.train, args.seq_len, args.batch_size, args.seed)
    use_amp = device == "cuda"
    calib_from, calib_to = 10, 40
    total = steps if steps > 0 else 10**9
    eval_every = max(1, args.eval_every)
    best = {"nll_per_token": float("inf"), "step": -1}
    best_state = None
    t0 = time.perf_counter()
    t_calib = None
    steady_from, t_steady = 100, None  # throughput measured after compilation and warm-up
    step = 0
    stopped_by_time = False
    while step < total:
        if steps == 0 and step == calib_from:
            if device == "cuda":
                torch.cuda.synchronize()
            t_calib = time.perf_counter()
        if steps == 0 and step == calib_to:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            per_step = (now - t_calib) / (calib_to - calib_from)
            n_evals = 10
            eval_cost = n_evals * args.eval_cost_s
            total = calib_to + max(1, int((budget_s - (now - t0) - eval_cost) / per_step))
            log({"run": label, "calibrated_steps": total, "step_time_s": per_step, "elapsed_s": now - t0})
            eval_every = max(1, total // n_evals)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total if total < 10**9 else 10**6, lr, args.warmup, args.min_lr_ratio)
        batch = torch.from_numpy(sampler.next_batch()).to(device, non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            try:
                logits = fwd(batch[:, :-1])
            except Exception as exc:  # noqa: BLE001 - a compiler failure must not cost the device run
                if fwd is model:
                    raise
                log({"run": label, "compile_failed": repr(exc)[:500], "fallback": "eager"})
                fwd = model
                logits = fwd(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        if step == steady_from:
            if device == "cuda":
                torch.cuda.synchronize()
            t_steady = time.perf_counter()
        if step % args.log_every == 0 or step == total:
            log(
                {
                    "run": label,
                    "step": step,
                    "loss": float(loss.detach()),
                    "grad_norm": float(grad_norm),
                    "lr": opt.param_groups[0]["lr"],
                    "epoch": sampler.epoch,
                    "elapsed_s": time.perf_counter() - t0,
                }
            )
        if total < 10**9 and (step % eval_every == 0 or step == total):
            ev = evaluate(model, val, mode, autocast=use_amp)
            model.set_mode(mode)
            log(
                {
                    "run": label,
                    "step": step,
                    "val_nll": ev["nll_per_token"],
                    "val_ppl": ev["perplexity"],
                    "elapsed_s": time.perf_counter() - t0,
                }
            )
            if ev["nll_per_token"] < best["nll_per_token"]:
                best = {"nll_per_token": ev["nll_per_token"], "step": step}
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        if steps > 0 and budget_s > 0 and time.perf_counter() - t0 > budget_s:
            stopped_by_time = True
            log({"run": label, "stopped_by_time_at_step": step})
            break
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    final_step = step
    if best_state is not None and best["step"] != final_step:
        model.load_state_dict(best_state)  # early stopping: keep the best validation checkpoint
    stats = {
        "mode": mode,
        "steps": final_step,
        "planned_steps": total,
        "stopped_by_time": stopped_by_time,
        "selected_step": best["step"],
        "tokens_trained": final_step * args.batch_size * args.seq_len,
        "epochs": final_step * args.batch_size * args.seq_len / corpus.train.size,
        "wall_s": wall,
        "tokens_per_s": final_step * args.batch_size * args.seq_len / wall,
        "peak_lr": lr,
        "steady_tokens_per_s": None
        if t_steady is None or final_step <= steady_from
        else (final_step - steady_from) * args.batch_size * args.seq_len / (wall - (t_steady - t0)),
    }
    return model, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(".device-carry/stdlib-corpus"),
        help="folder with train.bin, val.bin, manifest.json (build_corpus.py)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--smoke", action="store_true", help="tiny model on a synthetic corpus, CPU, seconds")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=8)
    parser.add_argument("--n-kv-heads", type=int, default=4)
    parser.add_argument("--ffn-dim", type=int, default=1536)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--seq-len", type=int, default=512, help="training window = context_length")
    parser.add_argument("--batch-size", type=int, default=128, help="windows per step")
    parser.add_argument("--steps", type=int, default=0, help="0: calibrate from --time-budget")
    parser.add_argument("--time-budget", type=float, default=190.0, help="seconds for the QAT run")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak LR of the QAT run")
    parser.add_argument("--fp-twin", action="store_true", help="also train the unquantized twin")
    parser.add_argument("--fp-lr", type=float, default=1e-3, help="peak LR of the full-precision twin")
    parser.add_argument("--fp-time-cap", type=float, default=150.0, help="seconds; the twin stops there")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--min-lr-ratio", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=250, help="steps (recomputed when calibrating)")
    parser.add_argument("--eval-cost-s", type=float, default=1.0, help="time reserved per evaluation")
    parser.add_argument("--val-limit", type=int, default=0, help="evaluate only this many windows (0: all)")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the training step (default: on for CUDA)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    if args.smoke:
        args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.ffn_dim = 128, 2, 4, 2, 256
        args.seq_len, args.batch_size, args.steps, args.warmup = 64, 8, 60, 10
        args.eval_every, args.log_every, args.time_budget = 20, 10, 0
        corpus = smoke_corpus(vocab=512, seed=args.seed)
        vocab = 512
    else:
        corpus = load_corpus(args.data)
        vocab = 4096 if "tokenizer_vocab_size" not in corpus.manifest else corpus.manifest["tokenizer_vocab_size"]
    if args.steps == 0 and args.warmup < 40:
        parser.error(
            "--steps 0 calibrates at step 40: --warmup must be >= 40 so the schedule before it "
            "does not depend on the calibrated total"
        )
    if args.compile is None:
        args.compile = args.device == "cuda"
    vocab = max(vocab, int(corpus.train.max()) + 1)
    cfg = BitNetConfig(
        vocab_size=vocab,
        dim=args.dim,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        ffn_dim=args.ffn_dim,
        context_length=args.seq_len,
        rope_theta=args.rope_theta,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "train_log.jsonl").open("w")

    def log(record: dict) -> None:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        print(json.dumps(record), flush=True)

    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # final float32 evaluations must be real float32
        torch.backends.cudnn.allow_tf32 = False
    val_np = val_windows(corpus.val, args.seq_len)
    if args.val_limit:
        val_np = val_np[: args.val_limit]
    val = torch.from_numpy(val_np).to(args.device)
    t_start = time.perf_counter()

    qat_budget = args.time_budget if args.steps == 0 else 0.0  # an explicit step count is never cut short
    model, qat_stats = train_run("qat", "qat", args, cfg, corpus, val, args.steps, qat_budget, args.lr, log)
    ckpt = args.out / "bitnet_ternary.pt"
    info = {
        "seed": args.seed,
        "steps": qat_stats["steps"],
        "selected_step": qat_stats["selected_step"],
        "tokens_trained": qat_stats["tokens_trained"],
    }
    save_ternary_checkpoint(model, ckpt, info)

    results: dict[str, object] = {"unigram": unigram_eval(corpus.train, val_np, vocab)}
    exported = load_ternary_checkpoint(ckpt, args.device)  # exactly what the GGUF will hold
    results["exported_ternary"] = evaluate(exported, val, "frozen", autocast=False)
    results["qat_model_full_precision_mode"] = evaluate(model, val, "fp", autocast=False)
    results["qat_model_qat_mode_bf16"] = evaluate(model, val, "qat", autocast=args.device == "cuda")
    runs = {"qat": qat_stats}

    def write_metrics() -> None:
        metrics = {
            "config": cfg.to_dict(),
            "hyperparameters": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "runs": runs,
            "validation": results,
            "validation_split": {
                "tokens": int(corpus.val.size),
                "windows": int(val_np.shape[0]),
                "target_tokens": int(val_np.shape[0] * args.seq_len),
            },
            "corpus": {k: v for k, v in corpus.manifest.items() if k != "splits"},
            "checkpoint_bytes": ckpt.stat().st_size,
            "total_wall_s": time.perf_counter() - t_start,
            "environment": {
                "torch": torch.__version__,
                "python": platform.python_version(),
                "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
                "host": os.uname().nodename,
            },
        }
        (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")

    write_metrics()  # before the twin: the QAT results survive whatever happens next
    if args.fp_twin:
        twin, fp_stats = train_run(
            "fp_twin", "fp", args, cfg, corpus, val, qat_stats["steps"], args.fp_time_cap, args.fp_lr, log
        )
        runs["fp_twin"] = fp_stats
        results["fp_twin_full_precision"] = evaluate(twin, val, "fp", autocast=False)
        twin.set_mode("frozen")  # post-training ternarization of the twin's weights
        results["fp_twin_ternarized_after_training"] = evaluate(twin, val, "frozen", autocast=False)
    write_metrics()
    summary = {k: round(v["perplexity"], 3) for k, v in results.items()}
    log(
        {
            "summary_val_perplexity": summary,
            "qat_tokens": qat_stats["tokens_trained"],
            "qat_wall_s": round(qat_stats["wall_s"], 1),
        }
    )


if __name__ == "__main__":
    main()
