"""Deliberately wrong copies of a good GGUF, for the tests that must notice them (sensitivity tests).

Each defect is one a converter could plausibly make: ternary codes negated (-1 <-> +1 swapped),
Q/K rows in the other RoPE order, a norm written as all ones.
"""

from __future__ import annotations

import os

import numpy as np

from bitnet_web.convert.hf_checkpoint import permute_for_interleaved_rope
from bitnet_web.formats.ggml import GGMLType, GGUFValueType, Keys
from bitnet_web.formats.gguf_reader import open_gguf
from bitnet_web.formats.gguf_writer import GGUFWriter, Typed


def unpermute_from_interleaved_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The inverse of permute_for_interleaved_rope: interleaved pairs -> rotate-half (NEOX) order."""
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def write_wrong_copy(
    good_path: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    swap_codes: bool = False,
    permute_qk: bool = False,
    ones_norm: str | None = None,
) -> None:
    """Copy `good_path` to `out_path` with the chosen defects:

    swap_codes   every ternary value negated;
    permute_qk   Q/K rows in the other RoPE order (interleaved for the NEOX archs, what llama-arch
                 converters do; NEOX order for llama);
    ones_norm    this norm tensor (e.g. 'blk.0.attn_sub_norm.weight') written as all ones.
    """
    good = open_gguf(str(good_path))
    arch = good.architecture
    heads = {
        "attn_q": good.get(Keys.arch(Keys.HEAD_COUNT, arch)),
        "attn_k": good.get(Keys.arch(Keys.HEAD_COUNT_KV, arch)),
    }
    writer = GGUFWriter(str(out_path), alignment=good.alignment)
    for key, value in good.metadata.items():
        if key == Keys.ALIGNMENT and key in writer.metadata:
            continue
        writer.add(key, Typed(GGUFValueType.STRING, [], True) if isinstance(value, list) and not value else value)
    for name, info in good.tensors.items():
        kind = name.split(".")[-2]
        data: object = good.tensor_bytes(name).tobytes()
        if info.ggml_type == GGMLType.I2_S and (swap_codes or (permute_qk and kind in heads)):
            values, scale = good.ternary(name)
            if swap_codes:
                values = -values
            if permute_qk and kind in heads:
                reorder = unpermute_from_interleaved_rope if arch == "llama" else permute_for_interleaved_rope
                values = reorder(values, int(heads[kind]))
            data = (values, scale)
        elif name == ones_norm:
            data = np.ones(info.shape, dtype=np.float32)
        writer.add_tensor(name, info.shape, info.ggml_type, data)
    writer.write()
