"""The BitNet b1.58 transformer on the GPU: weights, run-state buffers, KV cache and the forward pass.

State is split by lifetime (llama2.c): `ModelConfig` (the blueprint), `LayerWeights` (GPU buffers
uploaded once), the run-state buffers below (allocated once for `max_tokens` rows) and the KV
cache (grows by doubling up to the context length). `forward` allocates nothing: it writes one
16-byte uniform and records the same list of dispatches every step.

Per layer (shared/ground-truth.md, `build_bitnet_158`):

    q, k, v = BitLinear_qkv(attn_norm(x)) (norm + one fused GEMV)          NormTernaryLinear 'store'
    q, k = rope(q, k); cache <- k, v                                      RopeKV
    a = attention(q, K_cache, V_cache)    (GQA, causal)                   Attention
    x = x + BitLinear_o(attn_sub_norm(a))                                 NormTernaryLinear 'residual'
    m = relu(BitLinear_gate(h))^2 * BitLinear_up(h), h = ffn_norm(x)      NormTernaryLinear 'gate_relu2'
    x = x + BitLinear_down(ffn_sub_norm(m))                               NormTernaryLinear 'residual'

Each NormTernaryLinear is one dispatch when decoding (every GEMV workgroup normalizes and quantizes
its input row itself) and RMSNormQuant + a tiled GEMM for a prefill chunk.

then logits = token_embd @ output_norm(x) (tied F16 head, sharded by rows when large).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from .. import gpu
from ..formats.ggml import GGMLType
from ..formats.gguf_reader import GGUFFile
from ..formats.quants import i2s_encode, ternarize
from ..kernels.attention import Attention, AttentionScratch
from ..kernels.common import KernelCache, StepParams
from ..kernels.embedding import Argmax, EmbeddingLookup, F16Matrix, Int8Matrix, LMHead
from ..kernels.kv_cache import KVCache
from ..kernels.linear import NormTernaryLinear, TernaryMatrix
from ..kernels.norm import RMSNorm
from ..kernels.rope import RopeKV, RopeTable
from ..kernels.sampling import GPUSampler
from ..text.sampler import SamplerSettings
from .config import ModelConfig

ProgressCallback = Callable[[str, int, int], None]


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
    if info.ggml_type in (GGMLType.TQ1_0, GGMLType.TQ2_0):
        values, scale = gguf.ternary(name)
    elif info.ggml_type in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        values, scale = ternarize(np.asarray(gguf.tensor(name), dtype=np.float32))
    else:
        raise ModelLoadError(
            f"{gguf.source}: tensor {name!r} has type {info.ggml_type.name}, which cannot be used as a ternary weight"
        )
    return i2s_encode(values, scale)[: info.n_elements // 4], float(scale)


def check_device_limits(config: ModelConfig, limits: gpu.GPULimits, max_tokens: int, source: str = "model") -> None:
    """Refuse, before anything is uploaded, a model with a buffer that one storage binding cannot hold.

    The F16 embedding and LM head are split into row shards (only one row must fit). Ternary weights,
    the run-state buffers and each layer's KV cache are bound whole: real BitNet shapes are far below
    WebGPU's 128 MiB default (2B-4T's largest ternary matrix, the fused gate/up, is 8.8 MB), so a
    model that does not fit is refused with every offending buffer named instead of being sharded.
    """
    cfg, limit = config, limits.max_binding
    qkv_rows = cfg.q_dim + 2 * cfg.kv_dim
    needs = {
        "blk.*.attn_q + attn_k + attn_v (fused ternary codes)": qkv_rows * cfg.dim // 4,
        "blk.*.attn_output (ternary codes)": cfg.dim * cfg.q_dim // 4,
        "blk.*.ffn_gate + ffn_up (fused ternary codes)": 2 * cfg.ffn_dim * cfg.dim // 4,
        "blk.*.ffn_down (ternary codes)": cfg.dim * cfg.ffn_dim // 4,
        "one row of token_embd / output (F16)": 2 * cfg.dim,
        f"logits of {min(max_tokens, LOGITS_ROWS)} tokens (f32)": 4 * min(max_tokens, LOGITS_ROWS) * cfg.vocab_size,
        f"activations of {max_tokens} tokens (f32)": 4 * max_tokens * max(qkv_rows, cfg.ffn_dim, cfg.dim),
        "one layer's K or V cache at the full context (f32)": 4 * cfg.context_length * cfg.kv_dim,
        "attention split partials (f32)": 4 * cfg.n_heads * -(-cfg.context_length // 64) * cfg.head_dim,
        "RoPE cos/sin table (f32)": 4 * cfg.context_length * cfg.rope_dim,
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
class LayerOps:
    """One layer's kernels in execution order, each bound to its weights and the run-state buffers.

    Each BitLinear carries its input RMSNorm + int8 quantization (NormTernaryLinear): one dispatch
    for a decoded token (the norm folded into the GEMV), norm + tiled GEMM for a prefill chunk.
    """

    qkv: NormTernaryLinear  # attn_norm -> W_qkv
    attention: Attention
    wo: NormTernaryLinear  # attn_sub_norm -> W_o, residual add
    gate_up: NormTernaryLinear  # ffn_norm -> W_gate, W_up, act(g) * u
    down: NormTernaryLinear  # ffn_sub_norm -> W_down, residual add


class BitNetModel:
    def __init__(
        self, device: gpu.Device, gguf: GGUFFile, config: ModelConfig, max_tokens: int = 64, int8_head: bool = False
    ):
        self.device = device
        self.int8_head = int8_head  # the head reads an int8 per-row-scaled copy (approximate, faster)
        self.gguf = gguf
        self.config = config
        self.max_tokens = max_tokens  # rows per forward call (prefill chunk)
        self.kernels = KernelCache(device)
        self.cached_tokens: list[int] = []  # tokens whose K/V rows are in the cache, in order
        self.layers: list[LayerWeights] = []
        self._buffers: list[gpu.Buffer] = []
        self.n_params = sum(info.n_elements for info in gguf.tensors.values())
        self._staging: list[gpu.Buffer] | None = None  # ring of 16-byte host-readable slots for greedy ids
        self.last_dispatches = self.last_passes = 0
        self.encode_seconds = 0.0  # time spent recording greedy steps (Python's share of a token)

    @property
    def n_cached(self) -> int:
        return len(self.cached_tokens)

    # Loading ---------------------------------------------------------------------------------

    def _f32_buffer(self, name: str, label: str) -> gpu.Buffer:
        values = np.ascontiguousarray(self.gguf.tensor(name), dtype=np.float32)
        buffer = self.device.buffer(values.nbytes, label=label)
        self.device.upload(buffer, 0, values)
        self._buffers.append(buffer)
        return buffer

    def _ternary(self, names: list[str], label: str, pair_rows: bool = False) -> TernaryMatrix:
        parts = [(ternary_rows(self.gguf, n), self.gguf.tensors[n].shape) for n in names]
        matrix = TernaryMatrix.upload(
            self.device, [(rows, scale, shape) for (rows, scale), shape in parts], label=label, pair_rows=pair_rows
        )
        self._buffers += [matrix.codes, matrix.scales]
        return matrix

    async def upload(self, progress: ProgressCallback | None = None) -> None:
        """Upload every weight, then build the ops (pipelines and bind groups) once."""
        cfg, device = self.config, self.device
        check_device_limits(cfg, device.limits, self.max_tokens, self.gguf.source)
        total = cfg.n_layers + 2
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            self.layers.append(
                LayerWeights(
                    attn_norm=self._f32_buffer(p + "attn_norm.weight", f"{p}attn_norm"),
                    qkv=self._ternary([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], f"{p}qkv"),
                    attn_sub_norm=(
                        self._f32_buffer(p + "attn_sub_norm.weight", f"{p}attn_sub_norm") if cfg.has_sub_norms else None
                    ),
                    wo=self._ternary([p + "attn_output.weight"], f"{p}attn_output"),
                    ffn_norm=self._f32_buffer(p + "ffn_norm.weight", f"{p}ffn_norm"),
                    gate_up=self._ternary([p + "ffn_gate.weight", p + "ffn_up.weight"], f"{p}gate_up", pair_rows=True),
                    ffn_sub_norm=(
                        self._f32_buffer(p + "ffn_sub_norm.weight", f"{p}ffn_sub_norm") if cfg.has_sub_norms else None
                    ),
                    down=self._ternary([p + "ffn_down.weight"], f"{p}ffn_down"),
                )
            )
            if progress:
                progress("upload", i + 1, total)
            await device.checkpoint(f"uploading layer {i}")
            await asyncio.sleep(0)  # let the page repaint its progress bar
        self.output_norm = self._f32_buffer("output_norm.weight", "output_norm")
        self.token_embd = F16Matrix.upload(device, self.gguf.tensor("token_embd.weight"), "token_embd")
        head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        if self.int8_head:
            self.output = Int8Matrix.upload(device, self.gguf.tensor(head_name), "output")
            self._buffers.append(self.output.scales)
        else:
            self.output = (
                self.token_embd
                if cfg.tied_embeddings
                else F16Matrix.upload(device, self.gguf.tensor(head_name), "output")
            )
        self._buffers += [b for _, _, b in self.token_embd.shards]
        if self.output is not self.token_embd:
            self._buffers += [b for _, _, b in self.output.shards]
        await device.checkpoint("uploading the embedding")
        self._allocate_run_state()
        self._build_ops()
        await device.checkpoint("building kernels")
        if progress:
            progress("upload", total, total)

    def _allocate_run_state(self) -> None:
        cfg, device, rows = self.config, self.device, self.max_tokens

        def buf(nbytes: int, label: str, usage: int = gpu.STORAGE_USAGE) -> gpu.Buffer:
            b = device.buffer(nbytes, usage, label)
            self._buffers.append(b)
            return b

        widest = max(cfg.dim, cfg.q_dim, cfg.ffn_dim)
        self.step = StepParams(device)
        self._buffers.append(self.step.buffer)
        self.token_ids = buf(4 * rows, "token ids")  # (rows,) u32
        self.x = buf(4 * rows * cfg.dim, "residual x")  # (rows, dim) f32
        self.x_q = buf(rows * widest, "int8 activations")  # (rows, widest/4) u32: 4 int8 per word
        self.x_scale = buf(4 * rows, "activation scales")  # (rows,) f32
        self.qkv = buf(4 * rows * (cfg.q_dim + 2 * cfg.kv_dim), "qkv")  # (rows, q_dim + 2 kv_dim) f32
        self.q = buf(4 * rows * cfg.q_dim, "rotated q")  # (rows, q_dim) f32
        self.attn_out = buf(4 * rows * cfg.q_dim, "attention out")  # (rows, q_dim) f32
        self.ffn_hidden = buf(4 * rows * cfg.ffn_dim, "ffn hidden")  # (rows, ffn_dim) f32
        self.x_final = buf(4 * rows * cfg.dim, "final normed x")  # (rows, dim) f32
        # (logits_rows, vocab) f32: only all-logits calls need more than one row, and they run in
        # pieces of at most LOGITS_ROWS, so long prefill chunks do not need a 128k-wide row each
        self.logits_rows = min(rows, LOGITS_ROWS)
        self.logits = buf(4 * self.logits_rows * cfg.vocab_size, "logits")
        self.next_token = buf(16, "next token")  # (4,) u32: GPU argmax result
        self.kv_cache = KVCache(device, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, cfg.context_length)
        self.rope_table = RopeTable(device, cfg.rope_dim, cfg.rope_theta, cfg.context_length)
        self.attention_scratch = AttentionScratch(device, cfg.n_heads, cfg.head_dim, cfg.context_length)
        self._buffers += [self.rope_table.buffer, self.attention_scratch.acc, self.attention_scratch.stats]

    def _build_ops(self) -> None:
        cfg, k, step = self.config, self.kernels, self.step
        eps, rows = cfg.norm_eps, self.max_tokens
        gate = "gate_relu2" if cfg.activation == "relu2" else "gate_silu"
        self.embed = EmbeddingLookup(k, self.token_embd, self.token_ids, self.x, step)
        self.layer_ops = []
        xq, xs = self.x_q, self.x_scale
        for i, w in enumerate(self.layers):
            self.layer_ops.append(
                LayerOps(
                    qkv=NormTernaryLinear(k, self.x, w.attn_norm, eps, w.qkv, xq, xs, self.qkv, step, "store"),
                    attention=Attention(
                        k,
                        step,
                        self.kv_cache,
                        i,
                        self.q,
                        self.attn_out,
                        n_heads=cfg.n_heads,
                        max_tokens=rows,
                        scratch=self.attention_scratch,
                        rope=RopeKV(
                            k,
                            step,
                            self.kv_cache,
                            i,
                            self.rope_table,
                            self.qkv,
                            self.q,
                            n_heads=cfg.n_heads,
                            style=cfg.rope_style,
                            max_tokens=rows,
                        ),
                    ),
                    wo=NormTernaryLinear(
                        k, self.attn_out, w.attn_sub_norm, eps, w.wo, xq, xs, self.x, step, "residual"
                    ),
                    gate_up=NormTernaryLinear(
                        k, self.x, w.ffn_norm, eps, w.gate_up, xq, xs, self.ffn_hidden, step, gate
                    ),
                    down=NormTernaryLinear(
                        k, self.ffn_hidden, w.ffn_sub_norm, eps, w.down, xq, xs, self.x, step, "residual"
                    ),
                )
            )
        self.final_norm = RMSNorm(k, self.x, self.output_norm, self.x_final, step, cfg.dim, eps)
        self.lm_head = LMHead(k, self.output, self.x_final, self.logits, step)
        # Greedy decoding on the GPU: the argmax goes straight into token_ids[0], the next step's input.
        self.argmax = Argmax(k, self.logits, self.token_ids, cfg.vocab_size)
        self._buffers.append(self.argmax.partials)
        # Sampled decoding on the GPU likewise (top-k <= GPU_TOP_K_MAX), seeded from the host once.
        self.gpu_sampler = GPUSampler(k, self.logits, self.token_ids, cfg.vocab_size)
        self._buffers += self.gpu_sampler.buffers

    # Context bookkeeping -----------------------------------------------------------------------

    def truncate(self, n: int) -> None:
        """Keep the first `n` cached tokens (their K/V rows stay valid: later rows are overwritten)."""
        del self.cached_tokens[n:]

    def reuse_prefix(self, prompt_ids: list[int]) -> int:
        """Keep the longest cached prefix of `prompt_ids`, leaving at least one token to compute
        (its logits start the reply). Returns how many tokens are reused."""
        common = 0
        for cached, new in zip(self.cached_tokens, prompt_ids, strict=False):
            if cached != new:
                break
            common += 1
        common = min(common, len(prompt_ids) - 1)
        self.truncate(common)
        return common

    # Forward -----------------------------------------------------------------------------------

    def _record_step(
        self,
        n_tokens: int,
        all_logits: bool,
        rec: gpu.Recorder | None = None,
        pos: int | None = None,
        head: bool = True,
    ) -> gpu.Recorder:
        """Record one forward step over `n_tokens` rows at positions pos.. (default: the next ones,
        n_cached; queued decode steps run ahead of the host's bookkeeping); `head=False` leaves out
        the final norm and LM head (a prefill chunk whose logits nobody reads). Allocates nothing."""
        pos = self.n_cached if pos is None else pos
        self.kv_cache.ensure_capacity(pos + n_tokens)
        self.step.write(n_tokens, pos, self.kv_cache.capacity)
        rec = rec or self.device.begin()
        n = n_tokens
        self.embed.record(rec, n)  # x = token_embd[token_ids]
        for layer in self.layer_ops:
            # x = x + W_o(sub_norm(attention(rope(W_qkv(norm(x)))))); RoPE and the KV-cache write run
            # inside the attention op (fused into its kernel when decoding one token)
            layer.qkv.record(rec, n)
            layer.attention.record(rec, n, pos)
            layer.wo.record(rec, n)
            # x = x + W_down(sub_norm(act(W_gate(norm(x))) * W_up(norm(x))))
            layer.gate_up.record(rec, n)
            layer.down.record(rec, n)
        # logits = head(output_norm(x)) for the last row, or for every row
        if head:
            self.final_norm.record(rec, n, last_only=not all_logits)
            self.lm_head.record(rec, n if all_logits else 1)
        return rec

    async def forward(self, token_ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` (at most max_tokens) at the next positions; return logits of the last
        token (vocab,) or of every token (n, vocab)."""
        n = len(token_ids)
        if not 0 < n <= (self.logits_rows if all_logits else self.max_tokens):
            raise ValueError(f"forward takes 1..{self.max_tokens} tokens ({self.logits_rows} with all_logits), got {n}")
        if self.n_cached + n > self.config.context_length:
            raise ValueError(f"context full: {self.n_cached} + {n} tokens > {self.config.context_length}")
        self.device.upload(self.token_ids, 0, np.asarray(token_ids, dtype=np.uint32))
        recorder = self._record_step(n, all_logits)
        recorder.submit()
        self.last_dispatches, self.last_passes = recorder.dispatches, recorder.passes
        self.cached_tokens.extend(token_ids)
        rows = n if all_logits else 1
        raw = await self.device.read(self.logits, 0, 4 * rows * self.config.vocab_size)
        logits = raw.view(np.float32).reshape(rows, self.config.vocab_size)
        return logits if all_logits else logits[0]

    async def prefill(self, token_ids: list[int], chunk: int | None = None, all_logits: bool = False) -> np.ndarray:
        """Run a prompt in chunks of at most `chunk` (default: max_tokens) rows; return the logits of
        its last token (vocab,), or of every token (n, vocab) with `all_logits`.

        Without `all_logits` only the last chunk's logits are read back: every earlier chunk is
        submitted without waiting for it (queue order runs the chunks in sequence, and each chunk's
        token-id and StepParams uploads land after the previous chunk's submit), so Python records
        chunk i+1 while the GPU runs chunk i.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        chunk = min(chunk or self.max_tokens, self.max_tokens)
        if all_logits:
            chunk = min(chunk, self.logits_rows)
            return np.concatenate(
                [
                    await self.forward(token_ids[start : start + chunk], all_logits=True)
                    for start in range(0, len(token_ids), chunk)
                ]
            )
        if self.n_cached + len(token_ids) > self.config.context_length:
            raise ValueError(f"context full: {self.n_cached} + {len(token_ids)} tokens > {self.config.context_length}")
        last = (len(token_ids) - 1) // chunk * chunk
        for start in range(0, last, chunk):
            part = token_ids[start : start + chunk]
            self.device.upload(self.token_ids, 0, np.asarray(part, dtype=np.uint32))
            self._record_step(len(part), all_logits=False, head=False).submit()
            self.cached_tokens.extend(part)
        return await self.forward(token_ids[last:])

    async def decode(self, token: int) -> np.ndarray:
        return await self.forward([token])

    # Decoding with the token kept on the GPU (greedy argmax or seeded sampling) ------------------

    def _record_gpu_step(self, staging: gpu.Buffer, chooser: Argmax | GPUSampler, pos: int) -> gpu.Recorder:
        """A decode step at `pos` that reads its input id from token_ids[0], writes the next id
        chosen on the GPU back there (the next step's input) and copies it to `staging` for the host."""
        rec = self._record_step(1, all_logits=False, pos=pos)
        chooser.record(rec)
        rec.copy(self.token_ids, 0, staging, 0, 4)
        return rec

    GREEDY_DEPTH = 2  # decode steps queued on the GPU at once

    def decode_greedy(self, first_token: int) -> AsyncIterator[int]:
        """Feed `first_token`, then yield greedy (argmax) tokens one by one, forever (the caller stops)."""
        return self._decode_on_gpu(first_token, self.argmax)

    def decode_sampled(
        self, first_token: int, settings: SamplerSettings, seed: int, first_draw: int, history: list[int] = ()
    ) -> AsyncIterator[int]:
        """Like decode_greedy, but each token is drawn on the GPU under `settings` (top_k at most
        GPU_TOP_K_MAX, repetition penalty over the tail of `history`, the tokens so far including
        `first_token`) with draws first_draw, first_draw + 1, ... of the stream `seed`
        (sampler.uniform): the same tokens the CPU Sampler would draw from the same logits."""
        self.gpu_sampler.configure(settings, seed, first_draw, history)
        return self._decode_on_gpu(first_token, self.gpu_sampler)

    async def _decode_on_gpu(self, first_token: int, chooser: Argmax | GPUSampler) -> AsyncIterator[int]:
        """The next token id never leaves the GPU: each step's choice is the next step's input, so
        GREEDY_DEPTH steps are queued at once and the GPU never waits for Python; only 4 bytes per
        token come back, read from a ring of staging buffers. Invariant: `cached_tokens` holds the
        inputs of the submitted steps that the host knows (step 0's is `first_token`, step j's is
        step j-1's output once read); so stopping at any yield leaves the cache consistent (steps
        already queued past a stop token just compute KV rows past `n_cached`, which later steps
        overwrite).
        """
        depth = self.GREEDY_DEPTH
        if self._staging is None or len(self._staging) != depth + 1:
            for buffer in self._staging or ():
                self._buffers.remove(buffer)
                self.device.release(buffer)
            self._staging = [self.device.staging(16, f"next token {i}") for i in range(depth + 1)]
            self._buffers.extend(self._staging)
        ring = len(self._staging)
        context = self.config.context_length
        start = self.n_cached  # step j runs at position start + j
        self.device.upload(self.token_ids, 0, np.asarray([first_token], dtype=np.uint32))
        submitted = 0  # steps submitted; step j writes its output token to staging[j % ring]

        def launch() -> None:
            nonlocal submitted
            encode_start = time.perf_counter()
            rec = self._record_gpu_step(self._staging[submitted % ring], chooser, start + submitted)
            rec.finish()
            self.encode_seconds += time.perf_counter() - encode_start
            rec.submit()
            self.last_dispatches, self.last_passes = rec.dispatches, rec.passes
            submitted += 1

        launch()
        self.cached_tokens.append(first_token)
        while submitted < depth and start + submitted < context:
            launch()  # its input is the previous step's output, still on the GPU
        read = 0
        while True:
            raw = await self.device.read_staging(self._staging[read % ring], 4)
            token = int(raw.view(np.uint32)[0])
            read += 1
            if submitted > read:
                self.cached_tokens.append(token)  # it is already the input of a queued step
            yield token
            if start + submitted >= context:
                if submitted == read:  # the context is full: nothing queued consumes `token`
                    return
            elif submitted == read:  # nothing queued (GREEDY_DEPTH 1): `token` is the next step's input
                self.cached_tokens.append(token)
                launch()
            else:
                launch()

    async def decode_greedy_benchmark(self, n_tokens: int) -> dict:
        """Decode `n_tokens` greedily from the current context; wall and Python CPU time per token."""
        first = self.cached_tokens[-1] if self.cached_tokens else 0
        self.truncate(self.n_cached - 1 if self.cached_tokens else 0)
        stream = self.decode_greedy(first)
        await stream.__anext__()  # warm: first step
        self.encode_seconds = 0.0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(n_tokens):
            await stream.__anext__()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        await stream.aclose()
        return {
            "tok_per_s": n_tokens / wall,
            "ms_per_token": 1e3 * wall / n_tokens,
            "cpu_ms_per_token": 1e3 * cpu / n_tokens,
            "encode_ms_per_token": 1e3 * self.encode_seconds / n_tokens,
            "dispatches_per_token": self.last_dispatches,
            "passes_per_token": self.last_passes,
        }

    def profile_decode_step(self, sampled: bool = False) -> list[tuple[str, float]]:
        """GPU microseconds per dispatch of one decode step, greedy or (after decode_sampled set the
        sampler up) sampled (NativeDevice(profile=True) only). The step is not kept: the cache is
        left as it was."""
        rec = self._record_step(1, all_logits=False, rec=self.device.begin_profiled())
        (self.gpu_sampler if sampled else self.argmax).record(rec)
        rec.submit()
        return self.device.read_profile(rec)

    @property
    def bytes_read_per_token(self) -> int:
        """Weight bytes a decode step must read: every tensor once (the tied embedding as the head;
        with int8_head, the int8 copy and its scales instead of the F16 head)."""
        total = sum(info.n_bytes for info in self.gguf.tensors.values())
        if self.int8_head:
            head = self.gguf.tensors["token_embd.weight" if self.config.tied_embeddings else "output.weight"]
            total += self.output.n_rows * (self.output.n_cols + 4) - head.n_bytes
        return total

    def release(self) -> None:
        """Free every GPU buffer of this model: weights, run state and the KV cache (whose buffers
        change as it grows, so they are released through it)."""
        kv_cache = getattr(self, "kv_cache", None)
        if kv_cache is not None:
            kv_cache.release()
        for buffer in self._buffers:
            self.device.release(buffer)
        self._buffers.clear()
