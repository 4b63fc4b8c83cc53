"""Tokenize the stdlib corpus into flat uint16 token streams for training.

Each file becomes `<|begin_of_text|> tokens <|end_of_text|>`, files concatenated in the fixed order
of `corpus.list_source_files`. Writes `train.bin`, `val.bin` (little-endian uint16) and
`manifest.json` (CPython version, license, file lists, hashes, token counts) into --out, by default
`.device-carry/stdlib-corpus/`, the git-ignored folder the device run carries.

    python tools/train/build_corpus.py [--tokenizer tools/train/tokenizer.json] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import corpus
import numpy as np
from tokenizers import Tokenizer
from train_tokenizer import BOS, EOS

REPO_ROOT = Path(__file__).resolve().parents[2]


def encode_split(tok: Tokenizer, files: list[corpus.CorpusFile]) -> np.ndarray:
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encodings = tok.encode_batch([f.text for f in files])
    parts = [np.array([bos, *enc.ids, eos], dtype=np.uint16) for enc in encodings]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stdlib", type=Path, default=corpus.default_stdlib_dir(), help="CPython stdlib dir")
    parser.add_argument("--tokenizer", type=Path, default=Path(__file__).with_name("tokenizer.json"))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".device-carry" / "stdlib-corpus")
    args = parser.parse_args()

    tok = Tokenizer.from_file(str(args.tokenizer))
    if tok.get_vocab_size() > 65536:
        raise SystemExit(f"{args.tokenizer}: {tok.get_vocab_size()} tokens do not fit uint16")
    files, skipped = corpus.load_corpus(args.stdlib)
    args.out.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, object] = {
        "source": "CPython standard library *.py files",
        "python_version": corpus.python_version(),
        "stdlib_dir": str(args.stdlib),
        "license": corpus.CORPUS_LICENSE,
        "selection": corpus.__doc__.strip().split("\n\n")[1].replace("\n", " "),
        "file_list_sha256": corpus.file_list_sha256(files),
        "tokenizer_vocab_size": tok.get_vocab_size(),
        "tokenizer_sha256": hashlib.sha256(args.tokenizer.read_bytes()).hexdigest(),
        "skipped_not_utf8": skipped,
        "format": "little-endian uint16 token ids; each file is <|begin_of_text|> ids <|end_of_text|>",
        "splits": {},
    }
    for split in ("train", "val"):
        chosen = [f for f in files if f.split == split]
        ids = encode_split(tok, chosen)
        ids.astype("<u2").tofile(args.out / f"{split}.bin")
        manifest["splits"][split] = {
            "files": len(chosen),
            "chars": sum(len(f.text) for f in chosen),
            "bytes_utf8": sum(len(f.text.encode("utf-8")) for f in chosen),
            "tokens": int(ids.size),
            "tokens_sha256": hashlib.sha256(ids.astype("<u2").tobytes()).hexdigest(),
            "paths": [f.rel_path for f in chosen],
        }
        print(f"{split}: {len(chosen)} files, {ids.size} tokens")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
