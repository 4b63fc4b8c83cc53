"""Convert a Hugging Face BitNet checkpoint folder to a GGUF file with I2_S weights (numpy only, no torch).

The checkpoint is read by `hf_checkpoint.build_gguf_writer`, the same code path that loads a checkpoint
into memory for the engine (see hf_checkpoint's docstring for the supported models, weight layouts and
tokenizers); this module only writes the result to disk. Output: architecture bitnet-b1.58 (relu2
checkpoints), bitnet (silu) or llama, metadata keys as the 2B-4T file, F32 norms, F16 (or `embed_type`)
embedding, tied head unless lm_head.weight exists and tie_word_embeddings is false.

Deliberately WRONG files for sensitivity tests (each option documented in `convert`).
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
    swap_codes: bool = False,
    permute_qk: bool = False,
    ones_norm: str | None = None,
    name: str | None = None,
    allow_lossy_ternarization: bool = False,
) -> dict[str, object]:
    """Convert `hf_dir` to a GGUF file at `out_path`; returns a small summary dict.

    embed_type: 'F16' (like the 2B-4T file), 'F32' or 'BF16' for token_embd (and output.weight).
    arch: override the architecture (default: bitnet-b1.58 for relu2, bitnet for silu, llama for llama).
    allow_lossy_ternarization: accept an ordinary (non-BitNet) Llama checkpoint (lossy, see hf_checkpoint).
    Deliberately wrong files, for sensitivity tests:
      swap_codes   every ternary value negated (2-bit codes -1 <-> +1 swapped);
      permute_qk   Q/K rows in the other RoPE order (interleaved for the NEOX archs, what llama-arch
                   converters do; NEOX order for llama);
      ones_norm    a GGUF norm tensor name (e.g. 'blk.0.attn_sub_norm.weight') written as all ones.
    """
    files = CheckpointFiles.from_folder(hf_dir) if os.path.isdir(hf_dir) else None
    if files is None:
        raise ConvertError(f"{os.path.join(os.fspath(hf_dir), 'config.json')}: cannot read (no such folder)")
    writer, summary = build_gguf_writer(
        files,
        str(out_path),
        embed_type=embed_type,
        arch=arch,
        swap_codes=swap_codes,
        permute_qk=permute_qk,
        ones_norm=ones_norm,
        name=name,
        allow_lossy_ternarization=allow_lossy_ternarization,
    )
    summary["bytes"] = writer.write()
    return summary
