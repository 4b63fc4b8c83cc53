"""Convert a Hugging Face BitNet checkpoint folder to a GGUF file with I2_S weights (numpy only, no torch).

The checkpoint is read by `hf_checkpoint.build_gguf_writer`, the same code path that loads a checkpoint
into memory for the engine (see hf_checkpoint's docstring for the supported models, weight layouts and
tokenizers); this module only writes the result to disk. Output: architecture bitnet-b1.58 (relu2
checkpoints), bitnet (silu) or llama, metadata keys as the 2B-4T file, F32 norms, F16 (or `embed_type`)
embedding, tied head unless lm_head.weight exists and tie_word_embeddings is false.
"""

from __future__ import annotations

import os

from .hf_checkpoint import (  # noqa: F401  (re-exported: the converter's historical names)
    CheckpointFiles,
    ConvertError,
    LossyTernarizationError,
    build_gguf_writer,
    permute_for_interleaved_rope,
    tokenizer_metadata,
    unpack_hf_ternary,
)


def convert(
    hf_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    embed_type: str = "F16",
    arch: str | None = None,
    name: str | None = None,
    allow_lossy_ternarization: bool = False,
) -> dict[str, object]:
    """Convert `hf_dir` to a GGUF file at `out_path`; returns a small summary dict.

    embed_type: 'F16' (like the 2B-4T file), 'F32' or 'BF16' for token_embd (and output.weight).
    arch: override the architecture (default: bitnet-b1.58 for relu2, bitnet for silu, llama for llama).
    allow_lossy_ternarization: accept an ordinary (non-BitNet) Llama checkpoint (lossy, see hf_checkpoint).
    """
    files = CheckpointFiles.from_folder(hf_dir) if os.path.isdir(hf_dir) else None
    if files is None:
        raise ConvertError(f"{os.path.join(os.fspath(hf_dir), 'config.json')}: cannot read (no such folder)")
    writer, summary = build_gguf_writer(
        files,
        str(out_path),
        embed_type=embed_type,
        arch=arch,
        name=name,
        allow_lossy_ternarization=allow_lossy_ternarization,
    )
    summary["bytes"] = writer.write()
    return summary
