"""Command line: `python -m bitnet_web {inspect,tokenize,generate,logits,convert,bench} ...`.

Bad input prints one line to stderr and exits with status 2; nothing a user can cause prints a
traceback (set BITNET_WEB_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

EXIT_BAD_INPUT = 2


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("at least one token id is needed")
    return ids


def _max_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-tokens must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"--max-tokens must be at least 1 (got {value}): it is how many tokens to generate"
        )
    return value


def _speculate(text: str) -> int:
    from .kernels.speculative import SPECULATE_MAX

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speculate must be a whole number, got {text!r}") from None
    if not 0 <= value <= SPECULATE_MAX:
        raise argparse.ArgumentTypeError(f"--speculate takes 0 (off) to {SPECULATE_MAX} drafted tokens, got {value}")
    return value


def _progress(phase: str, done: int, total: int) -> None:
    # Only on a terminal: a redirected stderr keeps exactly the lines that matter (errors, stats).
    if not total or not sys.stderr.isatty():
        return
    amount = f" ({done / 1e6:.1f} / {total / 1e6:.1f} MB)" if phase == "download" else ""
    print(f"\r{phase}: {done / total:6.1%}{amount}", end="", file=sys.stderr)
    if done >= total:
        print(file=sys.stderr)


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line on stderr (no usage block), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see: {self.prog} --help)\n")


def cmd_inspect(args: argparse.Namespace) -> int:
    from .convert import hf_checkpoint
    from .formats.gguf_reader import describe, open_gguf

    source = args.model or args.file
    if source is None:
        print("error: give a GGUF file or --model (GGUF, checkpoint folder or folder URL)", file=sys.stderr)
        return EXIT_BAD_INPUT
    if hf_checkpoint.is_checkpoint_location(source):
        gguf = hf_checkpoint.load(source, allow_lossy_ternarization=args.ternarize_lossy)
    else:
        gguf = open_gguf(source)
    print(describe(gguf))
    if gguf.tensors:  # a model, not a vocab-only file: say now whether the engine can run it
        from .model.config import ModelConfigError, config_from_gguf

        try:
            config_from_gguf(gguf)
        except ModelConfigError as exc:
            print(f"error: {source}: the engine cannot run this model: {_describe(exc)}", file=sys.stderr)
            return EXIT_BAD_INPUT
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from .formats.gguf_reader import open_gguf
    from .text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(open_gguf(args.model or str(bundled_model_path())).metadata)
    print(json.dumps(tokenizer.encode(args.text, add_bos=args.bos, allow_special=args.special)))
    return 0


def bundled_model_path():
    """The model shipped in static/models (repository checkout or the package's own copy)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for folder in (here / "models", here.parent.parent / "static" / "models"):
        found = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
        if found:
            return found[0]
    raise FileNotFoundError("no bundled model found (static/models/*.gguf); pass --model")


def _load_engine(args: argparse.Namespace):
    from .engine import Engine

    engine = Engine(
        max_binding_size=getattr(args, "max_binding_size", None),
        int8_head=getattr(args, "int8_head", False),
        screened_head=False if getattr(args, "no_screened_head", False) else None,  # None: the engine decides
    )
    if args.model is None:
        args.model = str(bundled_model_path())
    try:
        engine.load(
            args.model,
            progress=None if args.quiet else _progress,
            allow_lossy_ternarization=getattr(args, "ternarize_lossy", False),
        )
        tokens = getattr(args, "tokens", None)
        vocab = engine.config.vocab_size
        bad = [t for t in tokens or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"--tokens: {', '.join(map(str, bad[:5]))}{' ...' if len(bad) > 5 else ''} outside the "
                f"vocabulary of {args.model} ({vocab} tokens, ids 0..{vocab - 1})"
            )
    except BaseException:
        # The engine's event loop and GPU device must be released here, or interpreter shutdown
        # prints "Exception ignored in BaseEventLoop.__del__" after the one-line error.
        engine.close()
        raise
    return engine


def cmd_generate(args: argparse.Namespace) -> int:
    from .text.sampler import SamplerSettings

    settings = SamplerSettings(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    engine = _load_engine(args)
    try:
        if args.chat and engine.template is not None and engine.template.kind == "completion":
            raise ValueError(
                f"--chat: {args.model} is a completion-only model ({engine.template.note or 'no chat template'}); "
                "leave out --chat to continue the prompt as plain text"
            )
        options = dict(settings=settings, max_tokens=args.max_tokens)
        if args.speculate is not None:
            options["speculate"] = args.speculate
        if args.tokens is not None:
            stream = engine.generate(tokens=args.tokens, **options)
        elif args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": args.prompt})
            stream = engine.generate(messages=messages, **options)
        else:
            stream = engine.generate(args.prompt, **options)
        pieces = []
        for piece in stream:
            pieces.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
        stats = engine.last_stats
        if args.json:
            print(
                json.dumps(
                    {
                        "tokens": engine.generated_tokens,
                        "text": "".join(pieces),
                        "draft_accepted": stats.draft_accepted,
                        "draft_proposed": stats.draft_proposed,
                        "stats": stats.as_dict(),
                    },
                    ensure_ascii=False,
                )
            )
        else:
            print()
            if not args.quiet:
                drafts = (
                    f", drafts {stats.draft_accepted}/{stats.draft_proposed} accepted (k={stats.speculate})"
                    if stats.speculate
                    else ""
                )
                print(
                    f"[{stats.n_generated} tokens, prefill {stats.prefill_tok_per_s:.1f} tok/s, "
                    f"decode {stats.decode_tok_per_s:.1f} tok/s{drafts}, stop: {stats.stop_reason}]",
                    file=sys.stderr,
                )
    finally:
        engine.close()
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from .outfiles import atomic_path, check_output

    check_output(args.out, [args.model] if args.model else [], "--out")
    engine = _load_engine(args)
    try:
        logits = engine.logits(args.tokens)
    finally:
        engine.close()
    with atomic_path(args.out) as tmp, open(tmp, "wb") as f:
        np.save(f, logits.astype(np.float32))  # a file object: numpy appends no ".npy"
    if not args.quiet:
        print(f"wrote {logits.shape[0]} x {logits.shape[1]} float32 logits to {args.out}", file=sys.stderr)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert.convert_hf import convert
    from .outfiles import atomic_path, check_output

    if os.path.isfile(args.hf_dir):
        with open(args.hf_dir, "rb") as f:
            kind = "a GGUF file, which needs no conversion" if f.read(4) == b"GGUF" else "a file"
        raise ValueError(
            f"convert expects a checkpoint folder (config.json, tokenizer.json, *.safetensors); {args.hf_dir} is {kind}"
        )
    check_output(args.out, [args.hf_dir], "output")
    with atomic_path(args.out) as tmp:
        convert(args.hf_dir, tmp, allow_lossy_ternarization=args.ternarize_lossy)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="python -m bitnet_web", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def lossy_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--ternarize-lossy",
            action="store_true",
            help="EXPERIMENTAL: accept an ordinary (non-BitNet) Llama checkpoint and ternarize it "
            "by absmean on load (lossy: expect degraded output)",
        )

    p = sub.add_parser("inspect", help="summarize a GGUF file or a Hugging Face checkpoint (as converted)")
    p.add_argument("file", nargs="?")
    p.add_argument("--model", default=None, help="GGUF path, safetensors checkpoint folder or folder URL")
    lossy_arg(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    p.add_argument(
        "--model",
        default=None,
        help="a GGUF with tokenizer metadata (vocab-only files work); default: the bundled model",
    )
    p.add_argument("--text", required=True)
    p.add_argument("--bos", action="store_true", help="prepend the BOS token")
    p.add_argument("--special", action="store_true", help="parse special-token text such as <|eot_id|>")
    p.set_defaults(func=cmd_tokenize)

    def int8_head_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--int8-head",
            action="store_true",
            help="APPROXIMATE: read an int8 per-row-scaled copy of the LM head (half the bytes of "
            "F16, faster decoding; logits differ slightly, so greedy text may too)",
        )
        p.add_argument(
            "--no-screened-head",
            action="store_true",
            help="greedy steps read the whole F16 LM head instead of an int8 screen and the few rows that "
            "can win (the same tokens; the screen's int8 copy costs half the head's GPU memory again)",
        )

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            default=None,
            help="GGUF path or URL, or a Hugging Face safetensors "
            "checkpoint folder or folder URL (.../ORG/REPO, .../resolve/main/); downloads are cached. "
            "Default: the bundled model (a 27M-parameter Python-code completion model)",
        )
        lossy_arg(p)
        p.add_argument("--max-binding-size", type=int, default=None, help=argparse.SUPPRESS)
        int8_head_arg(p)
        p.add_argument("--quiet", "-q", action="store_true", help="no progress or statistics on stderr")

    from .kernels.speculative import SPECULATE_GPU

    p = sub.add_parser("generate", help="generate text (streams to stdout)")
    model_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--tokens", type=_parse_ids, help="comma-separated token ids, used as given (no BOS)")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the model's chat template")
    p.add_argument("--system", default="", help="system prompt for --chat")
    p.add_argument("--max-tokens", type=_max_tokens, default=128, help="at most this many tokens (at least 1)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--speculate",
        type=_speculate,
        default=None,
        metavar="K",
        help="speculative decoding: verify prompt-lookup drafts of up to K tokens per forward pass (greedy: "
        "the same output; sampled: the same distribution); 0 = off; default: "
        f"{SPECULATE_GPU} on a GPU, 0 on a software adapter",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"tokens": [...], "text": "...", "stats": {...}} at the end; "tokens" leaves out the '
        "end-of-text token that stopped generation (stats.stop_reason is then 'eos')",
    )
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("logits", help="save float32 logits [n_tokens, vocab] for a token id sequence")
    model_args(p)
    p.add_argument("--tokens", type=_parse_ids, required=True)
    p.add_argument("--out", required=True, help="the .npy file to write (exactly this path)")
    p.set_defaults(func=cmd_logits)

    p = sub.add_parser("convert", help="convert a Hugging Face BitNet checkpoint folder to GGUF I2_S")
    p.add_argument("hf_dir")
    p.add_argument("out")
    lossy_arg(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("bench", help="benchmark load, prefill and decode (prints JSON)")
    p.add_argument("--model", default=None, help="GGUF to benchmark (default: a synthetic 2B-4T-shaped model)")
    p.add_argument("--synthetic", default="2b4t", help="synthetic shape when no --model is given")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--quick", action="store_true", help="fewer tokens (smoke test)")
    p.add_argument(
        "--workload-model",
        default=None,
        help="model for the speculative-decoding workloads (acceptance); default: the bundled model when "
        "present; '' skips them",
    )
    p.add_argument(
        "--pauses",
        type=int,
        default=0,
        help="also N rounds of the same reply right after another, after 5 s idle, and after 5 s idle and a "
        "GPU warm-up (what an idle GPU's lowered clocks cost; ~22 s a round)",
    )
    int8_head_arg(p)
    p.set_defaults(func=cmd_bench)
    return parser


_GPU_COMMANDS = frozenset({"generate", "logits", "bench"})


def _private_runtime_dir() -> None:
    """Give Mesa's Vulkan drivers an XDG_RUNTIME_DIR where the session has none (a container, ssh,
    cron): without one they print "XDG_RUNTIME_DIR is invalid or not set" for every device opened.
    A private folder (mode 0700, removed at exit) is what they expect."""
    current = os.environ.get("XDG_RUNTIME_DIR")
    if current and os.path.isdir(current) and os.access(current, os.W_OK):
        return
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="bitnet-web-runtime-")  # mkdtemp makes it 0700
    os.environ["XDG_RUNTIME_DIR"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in _GPU_COMMANDS:
        _private_runtime_dir()  # before wgpu loads the drivers
    if args.command == "generate" and args.prompt is None and args.chat:
        print("error: --chat needs --prompt", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line for anything the user can cause
        if os.environ.get("BITNET_WEB_DEBUG"):
            raise
        print(f"error: {_describe(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT if _is_user_error(exc) else 1


def _describe(exc: BaseException) -> str:
    if isinstance(exc, FileNotFoundError):
        return f"no such file: {exc.filename}"
    if isinstance(exc, IsADirectoryError):
        return f"is a directory, not a GGUF file: {exc.filename}"
    # One line: a multi-line message (a list of config problems, a driver's "Caused by" chain) is joined.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return lines[0] + (" " + "; ".join(lines[1:]) if len(lines) > 1 else "")


def _is_user_error(exc: BaseException) -> bool:
    from .formats.ggml import GGUFError

    names = {c.__name__ for c in type(exc).__mro__}
    return isinstance(exc, GGUFError | OSError | ValueError) or bool(
        names & {"EngineError", "DownloadError", "GPUUnavailableError", "ModelConfigError", "TokenizerError"}
    )
