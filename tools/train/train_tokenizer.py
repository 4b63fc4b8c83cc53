"""Train the byte-level BPE vocabulary of the bundled model with Hugging Face `tokenizers`.

The pre-tokenizer is the Llama 3 one (regex Split, then ByteLevel without its own regex), so the
vocabulary behaves like a `gpt2`-type GGUF tokenizer with the Llama 3 pattern. Special tokens take ids
0, 1, 2. Trained on the training split only.

    python tools/train/train_tokenizer.py [--vocab-size 4096] [--out tools/train/tokenizer.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import corpus
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, EOT]


def new_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stdlib", type=Path, default=corpus.default_stdlib_dir(), help="CPython stdlib dir")
    parser.add_argument("--vocab-size", type=int, default=4096, help="including the 3 special tokens")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("tokenizer.json"))
    args = parser.parse_args()

    files, _ = corpus.load_corpus(args.stdlib)
    tok = train_tokenizer([f.text for f in files if f.split == "train"], args.vocab_size)
    if tok.get_vocab_size() != args.vocab_size:
        raise SystemExit(f"trained vocabulary has {tok.get_vocab_size()} tokens, asked for {args.vocab_size}")
    tok.save(str(args.out))
    print(f"wrote {args.out}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
