"""The model's weights on the GPU: ternary rows in the kernels' layout, device-limit checks, the upload.

Read-only after `upload_weights` (llama2.c's TransformerWeights). Ternary matrices are fused where
the kernels read them together (q/k/v, gate/up); norms are f32 vectors; the embedding and LM head
are F16 row shards (or an int8 per-row-scaled head copy, `int8_head`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .. import gpu
from ..formats.ggml import OUTPUT, OUTPUT_NORM, TOKEN_EMBD, GGMLType, block_prefix, block_tensor
from ..formats.gguf_reader import GGUFFile
from ..formats.quants import i2s_encode, ternarize
from ..kernels.embedding import F16Matrix, Int8Matrix
from ..kernels.kv_cache import KV_DTYPES
from ..kernels.linear import TernaryMatrix
from .config import FLOAT_TYPES, TERNARY_TYPES, ModelConfig
from .layout import gather, gather_index, gpu_layout

ProgressCallback = Callable[[str, int, int], None]
ReadyCallback = Callable[[int], Awaitable[None]]  # `await ready(n)`: the file's first n bytes are loaded

LOGITS_ROWS = 64  # rows of the logits buffer: all-logits calls run in pieces of this many tokens


class ModelLoadError(RuntimeError):
    """A tensor the model needs cannot be used (its type or contents), named in the message."""


def ternary_rows(gguf: GGUFFile, name: str) -> tuple[np.ndarray, float]:
    """The packed 2-bit codes of a ternary tensor in the engine's GPU layout (I2_S, x86) and its scale.

    I2_S tensors come back as a view of the file's bytes (no copy, no expansion); TQ1_0/TQ2_0 and
    float master weights are converted once here, at load.
    """
    info = gguf.tensors[name]
    if info.ggml_type == GGMLType.I2_S:
        raw = gguf.tensor_bytes(name)
        return raw[: info.n_elements // 4], gguf.i2s_scale(name)
    values, scale = ternary_values(gguf, name)
    return i2s_encode(values, scale)[: info.n_elements // 4], float(scale)


def ternary_values(gguf: GGUFFile, name: str) -> tuple[np.ndarray, float]:
    """A ternary weight's values (-1, 0, +1; int8, the tensor's shape) and scale: decoded from
    I2_S / TQ1_0 / TQ2_0, or ternarized from float master weights."""
    ggml_type = gguf.tensors[name].ggml_type
    if ggml_type in TERNARY_TYPES:
        return gguf.ternary(name)
    if ggml_type in FLOAT_TYPES:
        return ternarize(np.asarray(gguf.tensor(name), dtype=np.float32))
    raise ModelLoadError(
        f"{gguf.source}: tensor {name!r} has type {ggml_type.name}, which cannot be used as a ternary weight"
    )


def check_device_limits(
    config: ModelConfig, limits: gpu.GPULimits, max_tokens: int, source: str = "model", kv_dtype: str = "f16"
) -> None:
    """Refuse, before anything is uploaded, a model with a buffer that one storage binding cannot hold.

    The F16 embedding and LM head are split into row shards (only one row must fit). Ternary weights,
    the run-state buffers and each layer's KV cache are bound whole: real BitNet shapes are far below
    WebGPU's 128 MiB default (2B-4T's largest ternary matrix, the fused gate/up, is 8.8 MB), so a
    model that does not fit is refused with every offending buffer named instead of being sharded.
    Sizes are as laid out on the GPU, padding included (model/layout.py).
    """
    cfg, limit = gpu_layout(config), limits.max_binding
    qkv_rows = cfg.q_dim + 2 * cfg.kv_dim
    context_length, vocab_size, rope_dim = config.context_length, config.vocab_size, config.rope_dim
    kv_item = np.dtype(KV_DTYPES[kv_dtype]).itemsize
    needs = {
        "blk.*.attn_q + attn_k + attn_v (fused ternary codes)": qkv_rows * cfg.dim // 4,
        "blk.*.attn_output (ternary codes)": cfg.dim * cfg.q_dim // 4,
        "blk.*.ffn_gate + ffn_up (fused ternary codes)": 2 * cfg.ffn_dim * cfg.dim // 4,
        "blk.*.ffn_down (ternary codes)": cfg.dim * cfg.ffn_dim // 4,
        "one row of token_embd / output (F16)": 2 * cfg.dim,
        f"logits of {min(max_tokens, LOGITS_ROWS)} tokens (f32)": 4 * min(max_tokens, LOGITS_ROWS) * vocab_size,
        f"activations of {max_tokens} tokens (f32)": 4 * max_tokens * max(qkv_rows, cfg.ffn_dim, cfg.dim),
        f"one layer's K or V cache at the full context ({kv_dtype})": kv_item * context_length * cfg.kv_dim,
        "attention split partials (f32)": 4 * cfg.n_heads * -(-context_length // 64) * cfg.head_dim,
        "RoPE cos/sin table (f32)": 4 * context_length * rope_dim,
    }
    over = [f"{what} {nbytes} bytes" for what, nbytes in needs.items() if nbytes > limit]
    if over:
        raise gpu.GPUOutOfMemoryError(
            f"{source}: this device binds at most {limit} bytes per buffer (maxStorageBufferBindingSize / "
            f"maxBufferSize) but the model needs {'; '.join(over)}. Only the embedding and LM head are split "
            "into shards; use a device with a larger limit"
        )


@dataclass
class LayerWeights:
    attn_norm: gpu.Buffer  # (dim,) f32
    qkv: TernaryMatrix  # (q_dim + 2 * kv_dim, dim) ternary, per-row scales
    attn_sub_norm: gpu.Buffer | None  # (q_dim,) f32
    wo: TernaryMatrix  # (dim, q_dim)
    ffn_norm: gpu.Buffer  # (dim,) f32
    gate_up: TernaryMatrix  # (2 * ffn_dim, dim): gate and up rows, paired for the fused epilogue
    ffn_sub_norm: gpu.Buffer | None  # (ffn_dim,) f32
    down: TernaryMatrix  # (dim, ffn_dim)


@dataclass
class ModelWeights:
    layers: list[LayerWeights]
    output_norm: gpu.Buffer  # (dim,) f32
    token_embd: F16Matrix  # (vocab, dim) f16, row shards
    output: F16Matrix | Int8Matrix  # the LM head (vocab, dim): token_embd itself when tied


class UploadListener(Protocol):
    """Hears of each part of the model as soon as its buffers are on the GPU (upload_weights)."""

    def layer_uploaded(self, i: int, weights: LayerWeights) -> None: ...

    def embedding_uploaded(self, token_embd: F16Matrix, output: F16Matrix | Int8Matrix) -> None: ...

    def output_norm_uploaded(self, norm: gpu.Buffer) -> None: ...


async def upload_weights(
    device: gpu.Device,
    gguf: GGUFFile,
    config: ModelConfig,
    buffers: list[gpu.Buffer],
    *,
    int8_head: bool = False,
    progress: ProgressCallback | None = None,
    ready: ReadyCallback | None = None,
    uploaded: UploadListener | None = None,
) -> ModelWeights:
    """Upload every weight tensor. Each buffer is appended to `buffers` as soon as it exists, so the
    caller can free everything after a failure part way. Progress: ("upload", k, n_layers + 2) after
    each layer and after the embedding (k = 1 .. n_layers + 1; the caller reports the last step).
    Tensors are laid out as `gpu_layout(config)` says: padded / repeated where the kernels need it.

    Parts (a layer, the embedding and head, the output norm) go in the order their bytes lie in the
    file, so a file still being read (`ready`: `await ready(n)` returns once the file's first n
    bytes are in `gguf.data`) is uploaded while the rest of it arrives. `uploaded` hears of each part
    once its buffers exist (the model builds its ops then: their kernels compile during the upload)."""
    cfg, layout = config, gpu_layout(config)

    def index(axis: str) -> np.ndarray | None:
        return gather_index(cfg, layout, axis)

    def f32(name: str, label: str, axis: str = "dim") -> gpu.Buffer:
        """A norm weight laid out along `axis`."""
        values = np.ascontiguousarray(gather(np.asarray(gguf.tensor(name), dtype=np.float32), index(axis)))
        buffer = device.buffer(values.nbytes, label=label)
        device.upload(buffer, 0, values)
        buffers.append(buffer)
        return buffer

    def ternary_part(name: str, rows_axis: str, cols_axis: str) -> tuple[np.ndarray, float, tuple[int, int]]:
        """(packed codes, scale, shape) as laid out on the GPU: the file's own bytes where the layout
        changes nothing, else decoded, padded / repeated and packed again."""
        rows, cols = index(rows_axis), index(cols_axis)
        shape = tuple(int(d) for d in gguf.tensors[name].shape)
        if rows is None and cols is None:
            codes, scale = ternary_rows(gguf, name)
            return codes, scale, shape
        values, scale = ternary_values(gguf, name)
        values = gather(np.asarray(values, dtype=np.int8).reshape(shape), rows, cols)
        return i2s_encode(values, float(scale))[: values.size // 4], float(scale), values.shape

    def ternary(parts: list[tuple[str, str, str]], label: str, pair_rows: bool = False) -> TernaryMatrix:
        """Tensors given as (name, rows axis, columns axis), concatenated by rows."""
        laid_out = [ternary_part(*part) for part in parts]
        matrix = TernaryMatrix.upload(device, laid_out, label=label, pair_rows=pair_rows)
        buffers.extend([matrix.codes, matrix.scales])
        return matrix

    def layer(i: int) -> LayerWeights:
        p = block_prefix(i)  # GPU buffer labels: "blk.{i}.qkv", ...

        def t(short: str) -> str:
            return block_tensor(i, short)

        return LayerWeights(
            attn_norm=f32(t("attn_norm"), f"{p}attn_norm"),
            qkv=ternary([(t("attn_q"), "q", "dim"), (t("attn_k"), "kv", "dim"), (t("attn_v"), "kv", "dim")], f"{p}qkv"),
            attn_sub_norm=(f32(t("attn_sub_norm"), f"{p}attn_sub_norm", "q") if cfg.has_sub_norms else None),
            wo=ternary([(t("attn_output"), "dim", "q")], f"{p}attn_output"),
            ffn_norm=f32(t("ffn_norm"), f"{p}ffn_norm"),
            gate_up=ternary(
                [(t("ffn_gate"), "ffn", "dim"), (t("ffn_up"), "ffn", "dim")], f"{p}gate_up", pair_rows=True
            ),
            ffn_sub_norm=(f32(t("ffn_sub_norm"), f"{p}ffn_sub_norm", "ffn") if cfg.has_sub_norms else None),
            down=ternary([(t("ffn_down"), "dim", "ffn")], f"{p}ffn_down"),
        )

    def embedding(name: str) -> np.ndarray:  # columns padded to the GPU's hidden width
        cols = index("dim")
        return gguf.tensor(name) if cols is None else gather(np.asarray(gguf.tensor(name)), None, cols)

    head_name = TOKEN_EMBD if cfg.tied_embeddings else OUTPUT
    embeddings: dict[str, F16Matrix | Int8Matrix] = {}

    def embedding_and_head() -> None:
        token_embd = F16Matrix.upload(device, embedding(TOKEN_EMBD), "token_embd")
        buffers.extend(b for _, _, b in token_embd.shards)
        if int8_head:
            output = Int8Matrix.upload(device, embedding(head_name), "output")
            buffers.append(output.scales)
        else:
            output = token_embd if cfg.tied_embeddings else F16Matrix.upload(device, embedding(head_name), "output")
        if output is not token_embd:
            buffers.extend(b for _, _, b in output.shards)
        embeddings.update(token_embd=token_embd, output=output)

    def end(names: list[str]) -> int:
        """Where the last of these tensors' bytes end in the file (a missing one: 0, so it fails at once)."""
        return max((gguf.tensors[n].offset + gguf.tensors[n].n_bytes for n in names if n in gguf.tensors), default=0)

    layers: dict[int, LayerWeights] = {}
    norms: dict[str, gpu.Buffer] = {}
    parts = [
        (end([n for n in gguf.tensors if n.startswith(block_prefix(i))]), f"layer {i}", i) for i in range(cfg.n_layers)
    ]
    parts.append((end([TOKEN_EMBD, head_name]), "the embedding", "embedding"))
    parts.append((end([OUTPUT_NORM]), "the output norm", "output_norm"))
    total, done = cfg.n_layers + 2, 0
    for nbytes, what, part in sorted(parts, key=lambda p: p[0]):  # stable: file order, then model order
        if ready is not None:
            await ready(nbytes)
        if part == "output_norm":
            norms[OUTPUT_NORM] = f32(OUTPUT_NORM, "output_norm")
            if uploaded:
                uploaded.output_norm_uploaded(norms[OUTPUT_NORM])
            continue  # a small vector: no progress step of its own
        if part == "embedding":
            embedding_and_head()
            if uploaded:
                uploaded.embedding_uploaded(embeddings["token_embd"], embeddings["output"])
        else:
            layers[part] = layer(part)
            if uploaded:
                uploaded.layer_uploaded(part, layers[part])
        done += 1
        if progress:
            progress("upload", done, total)
        await device.checkpoint(f"uploading {what}")
        await asyncio.sleep(0)  # let the page repaint its progress bar
    return ModelWeights(
        [layers[i] for i in range(cfg.n_layers)], norms[OUTPUT_NORM], embeddings["token_embd"], embeddings["output"]
    )
