"""The BitNet b1.58 transformer on the GPU: run-state buffers, KV cache and the forward pass (the math).

State is split by lifetime (llama2.c): `ModelConfig` (the blueprint, config.py), `LayerWeights` (GPU
buffers uploaded once, weights.py), the run-state buffers below (allocated once for `max_tokens`
rows) and the KV cache (grows by doubling up to the context length). The GPU decode loop is in
decode.py. `forward` allocates nothing: it writes one
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

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .. import gpu
from ..formats.ggml import OUTPUT, TOKEN_EMBD
from ..formats.gguf_reader import GGUFFile
from ..kernels.attention import MAX_SPLITS, Attention, AttentionScratch
from ..kernels.common import KernelCache, StepParams
from ..kernels.embedding import Argmax, EmbeddingLookup, F16Matrix, Int8Matrix, LMHead
from ..kernels.head_screen import DIGIT_STATS, SAMPLED_KEY_SLOTS, SCREEN_MIN_HEAD_BYTES, ScreenedArgmax
from ..kernels.kv_cache import KVCache
from ..kernels.linear import NormTernaryLinear
from ..kernels.norm import RMSNorm
from ..kernels.rope import RopeKV, RopeTable
from ..kernels.sampling import GPUSampler
from ..kernels.speculative import SPECULATE_MAX
from ..kernels.step_advance import StepAdvance
from .config import ModelConfig
from .decode import MAX_STEPS_PER_SUBMIT, FirstToken, GPUDecodeLoop
from .layout import GPULayout, gpu_layout
from .warm_up import GPUWarmUp
from .weights import (
    LOGITS_ROWS,
    LayerWeights,
    ProgressCallback,
    ReadyCallback,
    check_device_limits,
    upload_weights,
)


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


class BitNetModel(GPUDecodeLoop):
    def __init__(
        self,
        device: gpu.Device,
        gguf: GGUFFile,
        config: ModelConfig,
        max_tokens: int = 64,
        int8_head: bool = False,
        kv_dtype: str = "f16",
        speculate: int = 0,
        screened_head: bool | None = None,
    ):
        self.device = device
        # drafts of this many tokens get their verify steps' ops (draft, greedy and sampled acceptance,
        # log) at load, in the upload's pipeline batch: a first speculative reply then compiles nothing
        # (0: built on first use)
        self.speculate = speculate
        self.kv_dtype = kv_dtype  # KV cache elements: "f16" (half the memory and reads) or "f32" (reference)
        self.int8_head = int8_head  # the head reads an int8 per-row-scaled copy (approximate, faster)
        # greedy decode steps pick their token through an int8 screen of the F16 head (exact, faster;
        # kernels/head_screen.py), whose int8 copy costs half the head's memory again. None: where the
        # head is large enough for it to pay and the GPU is not a CPU adapter.
        self.screened_head = False if int8_head else screened_head
        self.screened_argmax: ScreenedArgmax | None = None
        self.gguf = gguf
        self.config = config
        self.layout: GPULayout = gpu_layout(config)  # widths as padded on the GPU (model/layout.py)
        self.max_tokens = max_tokens  # rows per forward call (prefill chunk)
        self.kernels = KernelCache.of(device)  # shared with earlier models on this device
        self.cached_tokens: list[int] = []  # tokens whose K/V rows are in the cache, in order
        self.layers: list[LayerWeights] = []
        self._buffers: list[gpu.Buffer] = []
        self._marks: list[gpu.Buffer] | None = None  # see _prefill_marks
        self._first_staging: gpu.Buffer | None = None  # see _choose_first
        self._warm_up: GPUWarmUp | None = None  # see warm_up
        self.n_params = sum(info.n_elements for info in gguf.tensors.values())
        self.last_dispatches = self.last_passes = 0

    @property
    def n_cached(self) -> int:
        return len(self.cached_tokens)

    @property
    def weight_bytes_per_token(self) -> int:
        """Weight bytes a decode step must read: every tensor once (the tied embedding as the head;
        with int8_head, the int8 copy and its scales instead of the F16 head)."""
        total = sum(info.n_bytes for info in self.gguf.tensors.values())
        if self.int8_head:
            head = self.gguf.tensors[TOKEN_EMBD if self.config.tied_embeddings else OUTPUT]
            total += self.output.n_rows * (self.output.n_cols + 4) - head.n_bytes
        return total

    @property
    def decode_bytes_per_token(self) -> int:
        """Weight bytes a greedy decode step reads: weight_bytes_per_token, with a screened head's int8
        copy, scales and norms in place of the F16 head (its few rescored rows left out)."""
        total = self.weight_bytes_per_token
        if self.screened_argmax is not None:
            head = self.gguf.tensors[TOKEN_EMBD if self.config.tied_embeddings else OUTPUT]
            total += self.output.n_rows * (self.output.n_cols + 12) - head.n_bytes
        return total

    def attention_share(self, context: int) -> float:
        """KV-cache bytes a decode step's attention reads at `context` cached tokens, per weight byte
        it reads: about how much longer than a short-context step such a step takes (2B-4T on the H100:
        0.27 at 4k, measured 0.31), and how much more each further row of a verify step adds (its
        rows walk the cache separately, so that each rounds as its decode step)."""
        kv_bytes = context * self.config.n_layers * 2 * self.kv_cache.row_bytes  # K and V of every layer
        return kv_bytes / self.weight_bytes_per_token

    # Loading ---------------------------------------------------------------------------------

    async def upload(self, progress: ProgressCallback | None = None, ready: ReadyCallback | None = None) -> None:
        """Upload every weight and build the ops (pipelines and bind groups) once. `ready`: the file
        is still being read into `gguf.data` (see upload_weights). Each part's ops are built as soon
        as its weights are on the GPU, inside one pipeline batch: in a browser the kernels compile
        in parallel while the rest of the file is read and uploaded, not after it."""
        cfg, device = self.config, self.device
        check_device_limits(cfg, device.limits, self.max_tokens, self.gguf.source, self.kv_dtype)
        self._allocate_run_state()
        self.layer_ops = [None] * cfg.n_layers  # type: ignore[list-item]  # filled as layers arrive
        device.begin_pipeline_batch()
        try:
            self._build_sampling_ops()
            weights = await upload_weights(
                device,
                self.gguf,
                cfg,
                self._buffers,
                int8_head=self.int8_head,
                progress=progress,
                ready=ready,
                uploaded=self,  # each part's ops are built as it arrives (layer_uploaded, ...)
            )
            self.layers = weights.layers
            k = min(self.speculate, SPECULATE_MAX, self.logits_rows - 1)
            if k > 0:
                self._spec_sampler(k)  # and _speculation_ops(k)
        except BaseException:
            with contextlib.suppress(Exception):
                await device.end_pipeline_batch()  # nothing left compiling behind a failed load
            self.kernels.forget_unbuilt()
            raise
        try:
            await device.end_pipeline_batch()
        except BaseException:
            self.kernels.forget_unbuilt()  # a kernel that failed to compile is compiled again next time
            raise
        self._prepare_screen()
        await device.checkpoint("building kernels")
        if progress:
            progress("upload", cfg.n_layers + 2, cfg.n_layers + 2)

    def _allocate_run_state(self) -> None:
        cfg, device, rows = self.layout, self.device, self.max_tokens
        context_length, vocab_size = self.config.context_length, self.config.vocab_size

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
        # x_final's rows as two int8 digits and their scales and norms (the screened head's input: RMSNorm
        # with digits): a decode step's row, or a speculative verify step's rows
        digit_rows = min(rows, SPECULATE_MAX + 1)
        self.x_digits = buf(2 * digit_rows * cfg.dim, "final normed x digits")  # (digit_rows, 2, dim/4) u32
        self.x_digit_stats = buf(4 * DIGIT_STATS * digit_rows, "final normed x digit stats")  # (digit_rows, 4) f32
        # (logits_rows, vocab) f32: only all-logits calls need more than one row, and they run in
        # pieces of at most LOGITS_ROWS, so long prefill chunks do not need a 128k-wide row each
        self.logits_rows = min(rows, LOGITS_ROWS)
        self.logits = buf(4 * self.logits_rows * vocab_size, "logits")
        self.next_token = buf(16, "next token")  # (4,) u32: GPU argmax result
        self.kv_cache = KVCache(
            device, self.config.n_layers, cfg.n_kv_heads, cfg.head_dim, context_length, dtype=self.kv_dtype
        )
        self.rope_table = RopeTable(device, self.config.rope_dim, self.config.rope_theta, context_length)
        # Verify steps of speculative decoding (up to SPECULATE_MAX + 1 rows) take the split path like a
        # decode step, as many rows as the partials' binding holds (more take the prefill path: slower
        # at long contexts, as correct)
        split_row_bytes = cfg.n_heads * MAX_SPLITS * cfg.head_dim * 4
        split_rows = max(1, min(rows, SPECULATE_MAX + 1, device.limits.max_binding // split_row_bytes))
        self.attention_scratch = AttentionScratch(
            device, cfg.n_heads, cfg.head_dim, context_length, max_tokens_split=split_rows
        )
        self._buffers += [self.rope_table.buffer, self.attention_scratch.acc, self.attention_scratch.stats]

    def _build_ops(self) -> None:
        """(Re)build every op from the uploaded weights (upload builds them part by part instead)."""
        self._build_sampling_ops()
        self.layer_ops = [self._layer_ops(i, w) for i, w in enumerate(self.layers)]
        self.embedding_uploaded(self.token_embd, self.output)
        self.output_norm_uploaded(self.output_norm)
        self._prepare_screen()

    # The ops that read one uploaded part (upload_weights' UploadListener)

    def layer_uploaded(self, i: int, weights: LayerWeights) -> None:
        self.layer_ops[i] = self._layer_ops(i, weights)

    def embedding_uploaded(self, token_embd: F16Matrix, output: F16Matrix | Int8Matrix) -> None:
        self.token_embd, self.output = token_embd, output
        self.embed = EmbeddingLookup(self.kernels, token_embd, self.token_ids, self.x, self.step)
        self.lm_head = LMHead(self.kernels, output, self.x_final, self.logits, self.step)
        if self.screened_argmax is not None:  # rebuilt (_build_ops)
            for buffer in self.screened_argmax.buffers:
                self._buffers.remove(buffer)
            self.screened_argmax.release(self.device)
            self.screened_argmax = None
        screened = self.screened_head
        if screened is None:
            screened = not self.device.is_cpu and 2 * output.n_rows * output.n_cols >= SCREEN_MIN_HEAD_BYTES
        if screened and isinstance(output, F16Matrix) and output.n_cols % 16 == 0:
            self.screened_argmax = ScreenedArgmax(
                self.kernels,
                self.lm_head,
                output,
                self.x_final,
                self.x_digits,
                self.x_digit_stats,
                self.token_ids,
                self.config.vocab_size,
            )
            self._buffers += self.screened_argmax.buffers
            # sampled steps through the screen: one draw from its candidates, which also clears its keys
            screen = self.screened_argmax
            self.gpu_sampler.draw_from_candidates(screen.candidates, screen.keys, SAMPLED_KEY_SLOTS)
        if getattr(self, "output_norm", None) is not None:  # uploaded first: its norm now writes digits
            self._build_final_norm()

    def _prepare_screen(self) -> None:
        """Make the screened head's int8 copy (its pipelines exist once the upload's batch is built)."""
        if self.screened_argmax is not None:
            rec = self.device.begin()
            self.screened_argmax.prepare(rec)
            rec.submit()

    def output_norm_uploaded(self, norm: gpu.Buffer) -> None:
        self.output_norm = norm
        self._build_final_norm()

    def _build_final_norm(self) -> None:
        """The final norm, writing digits for the screened head where the model has one."""
        cfg = self.config
        digits = (self.x_digits, self.x_digit_stats) if self.screened_argmax is not None else None
        # norms of zero-padded rows divide by the model's true widths (model/layout.py)
        self.final_norm = RMSNorm(
            self.kernels,
            self.x,
            self.output_norm,
            self.x_final,
            self.step,
            self.layout.dim,
            cfg.norm_eps,
            mean_width=cfg.dim,
            digits=digits,
        )

    def _build_sampling_ops(self) -> None:
        k = self.kernels
        # Greedy decoding on the GPU: the argmax goes straight into token_ids[0], the next step's input.
        self.argmax = Argmax(k, self.logits, self.token_ids, self.config.vocab_size)
        self._buffers.append(self.argmax.partials)
        # Sampled decoding on the GPU likewise (top-k <= GPU_TOP_K_MAX), seeded from the host once.
        self.gpu_sampler = GPUSampler(k, self.logits, self.token_ids, self.config.vocab_size)
        self._buffers += self.gpu_sampler.buffers
        # Decode steps queued in one submit chain on the GPU: each logs its token, advances StepParams
        self.step_advance = StepAdvance(k, self.token_ids, self.step, MAX_STEPS_PER_SUBMIT)
        self._buffers.append(self.step_advance.log)

    def _layer_ops(self, i: int, w: LayerWeights) -> LayerOps:
        cfg, k, step, rows = self.config, self.kernels, self.step, self.max_tokens
        eps = cfg.norm_eps
        # norms of zero-padded rows divide by the model's true widths (model/layout.py)
        dim, q_dim, ffn_dim = cfg.dim, cfg.n_heads * cfg.head_dim, cfg.ffn_dim
        gate = "gate_relu2" if cfg.activation == "relu2" else "gate_silu"
        xq, xs = self.x_q, self.x_scale
        return LayerOps(
            qkv=NormTernaryLinear(k, self.x, w.attn_norm, eps, w.qkv, xq, xs, self.qkv, step, "store", mean_width=dim),
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
                scale=1.0 / float(np.sqrt(cfg.head_dim)),
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
                k, self.attn_out, w.attn_sub_norm, eps, w.wo, xq, xs, self.x, step, "residual", mean_width=q_dim
            ),
            gate_up=NormTernaryLinear(
                k, self.x, w.ffn_norm, eps, w.gate_up, xq, xs, self.ffn_hidden, step, gate, mean_width=dim
            ),
            down=NormTernaryLinear(
                k, self.ffn_hidden, w.ffn_sub_norm, eps, w.down, xq, xs, self.x, step, "residual", mean_width=ffn_dim
            ),
        )

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
        logits: bool = True,
        params_ready: bool = False,
        params_on_gpu: bool = False,
        live_rows: float | None = None,
    ) -> gpu.Recorder:
        """Record one forward step over `n_tokens` rows at positions pos.. (default: the next ones,
        n_cached; queued decode steps run ahead of the host's bookkeeping); `head=False` leaves out
        the final norm and LM head (a prefill chunk whose logits nobody reads), `logits=False` the LM
        head only: the final norm writes the screened head's digits instead (ScreenedArgmax records
        next). Allocates nothing.

        The step's StepParams are written here (before the submit), or, with `params_ready`, they are in
        the uniform already when the step runs (the caller wrote them before the submit, or the previous
        decode step of the submit advanced them: StepAdvance): several steps in one submit. With
        `params_on_gpu` the caller has recorded their copy into the uniform and the position is known
        only on the GPU (speculative verify steps: the caller made room in the KV cache); `pos` is then
        an upper bound of it or None (attention dispatches enough splits for any position), and the
        rows may be fewer than n_tokens, even none (a step past the reply's end leaves at once);
        `live_rows` is how many the caller expects on average (it picks the BitLinears' small-T path)."""
        if not params_on_gpu:
            pos = self.n_cached if pos is None else pos
            self.kv_cache.ensure_capacity(pos + n_tokens)
        rec = rec or self.device.begin()
        if not (params_on_gpu or params_ready):
            self.step.write(n_tokens, pos, self.kv_cache.capacity)
        n = n_tokens
        bounded = params_on_gpu  # StepParams may say fewer rows, even none: the kernels read them
        self.embed.record(rec, n)  # x = token_embd[token_ids]
        for layer in self.layer_ops:
            # x = x + W_o(sub_norm(attention(rope(W_qkv(norm(x)))))); RoPE and the KV-cache write run
            # inside the attention op (fused into its kernel for a decode step or a verify step's rows)
            layer.qkv.record(rec, n, bounded, live_rows)
            layer.attention.record(rec, n, pos)
            layer.wo.record(rec, n, bounded, live_rows)
            # x = x + W_down(sub_norm(act(W_gate(norm(x))) * W_up(norm(x))))
            layer.gate_up.record(rec, n, bounded, live_rows)
            layer.down.record(rec, n, bounded, live_rows)
        # logits = head(output_norm(x)) for the last row, or for every row
        if head:
            self.final_norm.record(rec, n, last_only=not all_logits, digits=not logits)
            if logits:
                self.lm_head.record(rec, n if all_logits else 1, bounded)
        return rec

    def _submit_rows(
        self, token_ids: list[int], all_logits: bool, then: Callable[[gpu.Recorder], None] | None = None
    ) -> None:
        """Submit one step over `token_ids` (at most max_tokens) at the next positions, with what
        `then` records after it, and count them as cached."""
        n = len(token_ids)
        if not 0 < n <= (self.logits_rows if all_logits else self.max_tokens):
            raise ValueError(f"forward takes 1..{self.max_tokens} tokens ({self.logits_rows} with all_logits), got {n}")
        if self.n_cached + n > self.config.context_length:
            raise ValueError(f"context full: {self.n_cached} + {n} tokens > {self.config.context_length}")
        self.device.upload(self.token_ids, 0, np.asarray(token_ids, dtype=np.uint32))
        recorder = self._record_step(n, all_logits)
        if then is not None:
            then(recorder)
        recorder.submit()
        self.last_dispatches, self.last_passes = recorder.dispatches, recorder.passes
        self.cached_tokens.extend(token_ids)

    async def forward(self, token_ids: list[int], all_logits: bool = False) -> np.ndarray:
        """Run `token_ids` (at most max_tokens) at the next positions; return logits of the last
        token (vocab,) or of every token (n, vocab)."""
        self._submit_rows(token_ids, all_logits)
        n = len(token_ids)
        rows = n if all_logits else 1
        raw = await self.device.read(self.logits, 0, 4 * rows * self.config.vocab_size)
        logits = raw.view(np.float32).reshape(rows, self.config.vocab_size)
        return logits if all_logits else logits[0]

    async def prefill(
        self,
        token_ids: list[int],
        chunk: int | None = None,
        all_logits: bool = False,
        progress: Callable[[int, int], None] | None = None,
        stop: Callable[[], bool] | None = None,
        choose: Argmax | GPUSampler | None = None,
    ) -> np.ndarray | FirstToken | None:
        """Run a prompt in chunks of at most `chunk` (default: max_tokens) rows; return the logits of
        its last token (vocab,), or of every token (n, vocab) with `all_logits`; or, with `choose`
        (self.argmax, or self.gpu_sampler configured for the draw), no logits: the last submit also
        chooses the next token on the GPU, as a decode step does, into token_ids[0], and the returned
        FirstToken's read is started (a decode loop given it queues its steps behind this submit).

        Without `all_logits` only the last chunk's logits are read back: every earlier chunk is
        submitted without waiting for it (queue order runs the chunks in sequence, and each chunk's
        token-id and StepParams uploads land after the previous chunk's submit), so Python records
        chunk i+1 while the GPU runs chunk i.

        `progress(tokens done, len(token_ids))` is called as the GPU finishes each chunk before the
        last, and then `stop()` is asked: True leaves the rest of the prompt out and returns None (the
        finished chunks stay cached). To know a chunk finished, it copies 4 bytes into a small mapped
        buffer that the host waits on once the next chunk is queued, so the GPU is still never idle.
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
        watched = progress is not None or stop is not None
        queued: list[tuple[gpu.Buffer, int]] = []  # (its finish mark, tokens done when it finishes)
        last = (len(token_ids) - 1) // chunk * chunk
        try:
            for i, start in enumerate(range(0, last, chunk)):
                part = token_ids[start : start + chunk]
                self.device.upload(self.token_ids, 0, np.asarray(part, dtype=np.uint32))
                rec = self._record_step(len(part), all_logits=False, head=False)
                if watched:
                    mark = self._prefill_marks()[i % 2]
                    rec.copy(self.token_ids, 0, mark, 0, 4)  # any 4 bytes the chunk has read
                    queued.append((mark, start + len(part)))
                rec.submit()
                if watched:
                    self.device.start_read(mark)  # before the next chunk's submit (gpu.Device.start_read)
                self.cached_tokens.extend(part)
                # wait for the chunk before this one (its mark is then free for the chunk after this one)
                while len(queued) > 1 or (queued and start + chunk >= last):
                    mark, done = queued.pop(0)
                    await self.device.read_staging(mark, 4)
                    if progress is not None:
                        progress(done, len(token_ids))
                    if stop is not None and stop():
                        await self._drain(queued)
                        return None
        finally:
            for mark, _ in queued:  # a failure part way: marks never read are free again
                self.device.cancel_read(mark)
        if choose is not None:
            return self._choose_first(token_ids[last:], choose)
        return await self.forward(token_ids[last:])

    def _choose_first(self, token_ids: list[int], choose: Argmax | GPUSampler) -> FirstToken:
        """Submit the prompt's last chunk with its last row's logits and `choose` (see prefill)."""
        staging = self._first_staging
        if staging is None:
            staging = self._first_staging = self.device.staging(16, "first token")
            self._buffers.append(staging)

        def choose_and_copy(rec: gpu.Recorder) -> None:
            choose.record(rec)  # logits row 0 -> token_ids[0]
            rec.copy(self.token_ids, 0, staging, 0, 4)

        self._submit_rows(token_ids, all_logits=False, then=choose_and_copy)
        self.device.start_read(staging)  # before any later submit (gpu.Device.start_read)
        return FirstToken(staging)

    def _prefill_marks(self) -> list[gpu.Buffer]:
        """Two small host-readable buffers a prefill chunk marks as finished (see prefill)."""
        marks = self._marks
        if marks is None:
            marks = self._marks = [self.device.staging(16, f"prefill mark {i}") for i in range(2)]
            self._buffers.extend(marks)
        return marks

    async def _drain(self, queued: list[tuple[gpu.Buffer, int]]) -> None:
        """Wait for queued marks so none stays mapped-pending when the next prefill copies into it."""
        while queued:
            await self.device.read_staging(queued.pop(0)[0], 4)

    async def decode(self, token: int) -> np.ndarray:
        return await self.forward([token])

    def warm_up(self) -> GPUWarmUp:
        """What raises the GPU's clocks before a reply (model/warm_up.py), built on first use."""
        if self._warm_up is None:
            self._warm_up = GPUWarmUp(self.kernels, self.output, self.step)
            self._buffers += self._warm_up.buffers
        return self._warm_up

    def release(self) -> None:
        """Free every GPU buffer of this model: weights, run state and the KV cache (whose buffers
        change as it grows, so they are released through it)."""
        kv_cache = getattr(self, "kv_cache", None)
        if kv_cache is not None:
            kv_cache.release()
        for buffer in self._buffers:
            self.device.release(buffer)
        self._buffers.clear()
        self._warm_up = None
        self.screened_argmax = None  # its buffers were in _buffers
