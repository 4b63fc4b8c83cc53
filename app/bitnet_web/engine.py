"""The engine: a loaded model plus its tokenizer, chat template and sampler, as one object.

    engine = Engine()
    engine.load("model.gguf", progress=print)          # CPython; in the browser: await load_async(bytes)
    for piece in engine.generate("Once upon a time", SamplerSettings(temperature=0)):
        print(piece, end="")

Generation is an async generator underneath (the browser can only read GPU results by awaiting);
the synchronous methods drive it with a private event loop in CPython.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import gpu
from .formats.gguf_reader import GGUFFile, open_gguf
from .kernels.speculative import SPECULATE_GPU, SPECULATE_MAX
from .model.config import ModelConfig, config_from_gguf
from .model.forward import BitNetModel
from .model.speculation import SpeculationPolicy
from .model.weights import ReadyCallback
from .text.chat import ChatTemplate, render_tokens
from .text.sampler import Sampler, SamplerSettings
from .text.stops import StopMatcher
from .text.tokenizer import StreamDecoder, Tokenizer

ProgressCallback = Callable[[str, int, int], None]

SPECULATE_DEFAULT = -1  # `speculate` left to the engine: Engine.speculate_for
# How long a warm-up keeps the GPU busy: ~300 ms bring an idle H200 back to full clocks (model/warm_up.py)
WARM_UP_S = 0.3


class EngineError(RuntimeError):
    """A request the engine cannot serve (no model loaded, context full, bad token ids...)."""


def _device_lost(device: gpu.Device) -> bool:
    """True if the device is known to be gone (browser: its `lost` promise fired; native: destroyed)."""
    return device.lost_reason is not None


@dataclass
class GenerationStats:
    n_prompt_tokens: int = 0
    n_reused_tokens: int = 0  # prompt tokens whose KV entries were already cached
    n_generated: int = 0
    ttft_s: float = 0.0  # request start to first generated token
    decode_tok_per_s: float = 0.0
    prefill_tok_per_s: float = 0.0
    context_used: int = 0
    stop_reason: str = ""  # 'eos', 'stop_string', 'max_tokens', 'context_full', 'aborted'
    n_dropped_messages: int = 0  # chat: oldest messages left out to fit the context (fit_chat_to_context)
    token_choice: str = ""  # 'gpu_argmax', 'gpu_sample' (every token chosen on the GPU) or 'cpu_sample'
    speculate: int = 0  # largest draft of the verify steps (0: no speculative decoding in this reply)
    draft_proposed: int = 0  # tokens drafted by prompt lookup in the verify steps whose output was used
    draft_accepted: int = 0  # of those, tokens the model agreed with (each saved a forward pass)
    verify_steps: int = 0  # forward passes that verified a draft (each emits 1 + its accepted tokens)
    plain_steps: int = 0  # tokens of plain decode steps in a speculative reply (SpeculationPolicy, context end)
    launched_steps: int = 0  # steps of a speculative reply submitted to the GPU, used or queued past its end
    # verify steps per draft length 0..speculate (a draft is as long as its match: speculation.draft_length)
    draft_length_counts: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def fit_chat_to_context(
    messages: Sequence[dict], count_tokens: Callable[[list[dict]], int], budget: int, limit: int | None = None
) -> list[dict]:
    """The chat context policy: which messages to render so that the prompt takes <= `budget` tokens.

    A conversation that fits is kept whole. Otherwise the oldest turns (a turn is a user message and
    the replies after it) are dropped; the leading system message(s) and the latest turn never are.
    Cuts fall only at turn starts where the dropped history first reaches a multiple of half the
    budget, counted on the history itself, so the same cut is chosen turn after turn and the KV
    cache of the kept conversation is reused until the history has grown by another half budget.
    If the system prompt and the latest turn alone exceed `budget` they are still used when they take
    at most `limit` tokens (the reply then has less room); beyond that, EngineError.

    `count_tokens(messages)` is the prompt length of `messages` rendered on their own (BOS and
    generation prompt included). It is called once per turn (callers should cache it: the history is
    the same every request) and on the conversation finally kept (its exact count decides), never on
    the whole history, so a long session costs O(turns) per request, not O(history tokens).
    """
    messages = list(messages)
    n_system = 0
    while n_system < len(messages) and messages[n_system].get("role") == "system":
        n_system += 1
    system, rest = messages[:n_system], messages[n_system:]
    if not rest:
        return messages
    starts = [0] + [i for i in range(1, len(rest)) if rest[i].get("role") == "user"]
    bounds = list(zip(starts, starts[1:] + [len(rest)], strict=True))
    overhead = count_tokens([])  # BOS + generation prompt
    sizes = [count_tokens(rest[a:b]) - overhead for a, b in bounds]
    suffix = [0] * (len(sizes) + 1)  # estimated tokens of turns j..end
    for j in range(len(sizes) - 1, -1, -1):
        suffix[j] = suffix[j + 1] + sizes[j]
    base = count_tokens(system)
    # Candidate first kept turns: all of them, then the first turn at or past each multiple of half the
    # budget of dropped history, then only the latest turn.
    step, dropped, candidates = max(1, budget // 2), 0, [0]
    for j in range(len(sizes) - 1):
        dropped += sizes[j]
        if dropped >= step * len(candidates):
            candidates.append(j + 1)
    if candidates[-1] != len(sizes) - 1:
        candidates.append(len(sizes) - 1)
    for j in candidates:
        if base + suffix[j] > budget and j != candidates[-1]:
            continue  # estimated too long: skip the render
        kept = system + rest[bounds[j][0] :]
        n = count_tokens(kept)
        if n <= budget or (j == candidates[-1] and n <= (budget if limit is None else limit)):
            return kept
    raise EngineError(
        f"the system prompt and the latest message need {n} tokens, more than the "
        f"{budget if limit is None else limit} the context leaves for them: shorten the message or start "
        "a new chat"
    )


class Engine:
    def __init__(
        self,
        max_binding_size: int | None = None,
        prefill_chunk: int = 512,
        gpu_sampling: bool = True,
        int8_head: bool = False,
        screened_head: bool | None = None,
    ):
        self.max_binding_size = max_binding_size  # lower the binding limit (tests shard with it)
        self.prefill_chunk = prefill_chunk
        # Draw sampled tokens on the GPU when the settings allow (sampler.Sampler.gpu_supported);
        # False reads logits back and samples on the CPU (same seeded stream, same tokens).
        self.gpu_sampling = gpu_sampling
        # An approximation for speed: the LM head reads an int8 per-row-scaled copy (kernels Int8Matrix).
        self.int8_head = int8_head
        # Greedy decode steps pick their token through an int8 screen of the F16 head: the same token,
        # fewer bytes read (kernels/head_screen.py). None: where the head is large and the GPU real.
        self.screened_head = screened_head
        # Builds the policy of a speculative reply from its draft size: plain decode steps where
        # drafts are not accepted often enough to pay (model/speculation.py). None: every step that
        # fits verifies a draft (benchmarks of a fixed k, tests of the verify steps alone).
        self.speculation_policy: Callable[[int], SpeculationPolicy] | None = self._backend_policy
        self.device: gpu.Device | None = None
        self.gguf: GGUFFile | None = None
        self.config: ModelConfig | None = None
        self.tokenizer: Tokenizer | None = None
        self.template: ChatTemplate | None = None
        self.model: BitNetModel | None = None
        self.name = ""
        self.generated_tokens: list[int] = []
        self.chat_dropped_messages = 0  # set by encode_chat (the context policy)
        self._turn_tokens: tuple[Tokenizer | None, dict] = (None, {})  # encode_chat's token counts per turn
        self.last_stats = GenerationStats()
        # Called as (prompt tokens done, prompt tokens to compute) each time the GPU finishes a
        # prefill chunk before the last (the browser shows it); abort() then ends the prefill there.
        self.on_prefill: Callable[[int, int], None] | None = None
        self._abort = False
        self._requests = 0  # replies and forward passes started: a warm-up stops when it changes
        self._device_was_lost = False  # set when a GPU call reported the device gone (for the message)
        self._loop: asyncio.AbstractEventLoop | None = None  # runs the sync wrappers (generate, load, logits)
        self._runner: concurrent.futures.ThreadPoolExecutor | None = None  # see _run

    # Loading ---------------------------------------------------------------------------------

    def load(
        self,
        source: str | Path | GGUFFile,
        progress: ProgressCallback | None = None,
        *,
        allow_lossy_ternarization: bool = False,
    ) -> None:
        """Load a GGUF from a path or URL (CPython). A URL is downloaded once into the user cache.

        A folder path or a Hugging Face folder URL (.../ORG/REPO, .../resolve/main/) is a safetensors
        checkpoint, converted in memory by hf_checkpoint (`allow_lossy_ternarization`: see there)."""
        from .convert import hf_checkpoint

        if isinstance(source, GGUFFile):
            gguf, name = source, "model"
        elif hf_checkpoint.is_checkpoint_location(source):
            gguf = hf_checkpoint.load(source, progress=progress, allow_lossy_ternarization=allow_lossy_ternarization)
            name = str(gguf.metadata.get("general.name") or "model")
        else:
            path = Path(source)
            if str(source).startswith(("http://", "https://")):
                from .sources import download_to_cache

                path = download_to_cache(str(source), progress=progress)
            gguf, name = open_gguf(path), path.name
        self._run(self._load(gguf, name, progress))

    async def load_async(
        self,
        data: np.ndarray | GGUFFile,
        name: str = "model",
        progress: ProgressCallback | None = None,
        *,
        ready: ReadyCallback | None = None,
    ) -> None:
        """Load a GGUF held in memory (the browser passes the downloaded file as a uint8 array).

        `ready`: the file is still arriving in `data` (a GGUFFile whose header is parsed): `await
        ready(n)` returns once its first n bytes are there, or raises why they never will be. Each
        part is uploaded as soon as its bytes are in, and the whole-file checks run at the end."""
        gguf = data if isinstance(data, GGUFFile) else GGUFFile.from_buffer(np.asarray(data, dtype=np.uint8))
        await self._load(gguf, name, progress, ready)

    async def _load(
        self, gguf: GGUFFile, name: str, progress: ProgressCallback | None, ready: ReadyCallback | None = None
    ) -> None:
        self.unload()
        if progress:
            progress("parse", 0, 1)
        config = config_from_gguf(gguf)
        if ready is None:
            gguf.validate_tensors()  # every I2_S scale readable and finite before anything reaches the GPU
        tokenizer = Tokenizer.from_gguf(gguf.metadata)
        template = ChatTemplate.from_gguf(gguf.metadata)
        if progress:
            progress("parse", 1, 1)
        reusing_device = self.device is not None and not _device_lost(self.device)
        if not reusing_device:
            self.device = await gpu.open_device_async(max_binding_size=self.max_binding_size)
        try:
            model = await self._upload(gguf, config, progress, ready)
        except gpu.GPUDeviceLostError:
            if not reusing_device:
                self.device = None
                raise
            # The kept device died since its last use (wgpu-native reports a loss only when a call
            # fails): retry once on a fresh device.
            self.device = await gpu.open_device_async(max_binding_size=self.max_binding_size)
            try:
                model = await self._upload(gguf, config, progress, ready)
            except gpu.GPUDeviceLostError:
                self.device = None
                raise
        self.gguf, self.config, self.tokenizer, self.template, self.model = gguf, config, tokenizer, template, model
        self.name = name
        self._device_was_lost = False

    async def _upload(
        self, gguf: GGUFFile, config: ModelConfig, progress: ProgressCallback | None, ready: ReadyCallback | None
    ) -> BitNetModel:
        model = BitNetModel(
            self.device,
            gguf,
            config,
            max_tokens=self.prefill_chunk,
            int8_head=self.int8_head,
            screened_head=self.screened_head,
            speculate=self.speculate_for(),  # the default replies' draft size: its ops are built at load
        )
        try:
            await model.upload(progress, ready)
            if ready is not None:  # the checks of the whole file, now that all of it is in
                await ready(len(gguf.data))
                gguf.validate_tensors()
        except BaseException:
            # Nothing half-uploaded stays on the device; releasing on a lost device may itself fail.
            with contextlib.suppress(Exception):
                model.release()
            raise
        return model

    def _forget_lost_device(self) -> None:
        """The device is gone: drop it and the model on it, so the next load opens a fresh one."""
        with contextlib.suppress(Exception):
            self.unload()
        self.model = self.gguf = self.config = self.tokenizer = self.template = None
        self.device = None
        self._device_was_lost = True

    def unload(self) -> None:
        if self.model is not None:
            self.model.release()
        self.model = self.gguf = self.config = self.tokenizer = self.template = None

    @property
    def info(self) -> dict:
        if self.config is None:
            return {}
        cfg = self.config
        metadata = self.gguf.metadata
        return {
            "name": self.name,
            "arch": cfg.arch,
            "n_params": self.model.n_params if self.model else 0,
            "file_size": int(self.gguf.total_size or len(self.gguf.data)),
            "context_length": cfg.context_length,
            "vocab_size": cfg.vocab_size,
            "dim": cfg.dim,
            "n_layers": cfg.n_layers,
            "template_kind": self.template.kind,
            "description": str(metadata.get("general.description", metadata.get("general.name", ""))),
            "device": self.device.adapter_name if self.device else "",
            "context_used": self.model.n_cached if self.model else 0,
            "int8_head": bool(self.model and self.model.int8_head),  # approximate head (see Engine)
            "screened_head": bool(self.model and self.model.screened_argmax),  # exact (see Engine)
        }

    # Generation ------------------------------------------------------------------------------

    def speculate_for(self, speculate: int = SPECULATE_DEFAULT) -> int:
        """The draft size a request with `speculate` runs with: itself when 0..SPECULATE_MAX; for
        SPECULATE_DEFAULT, SPECULATE_GPU on a hardware GPU and 0 on a software adapter (lavapipe,
        SwiftShader), where a verify row costs as much as a decode step and drafting never pays."""
        rows = self.model.logits_rows if self.model is not None else SPECULATE_MAX + 1  # verify rows it can run
        if speculate == SPECULATE_DEFAULT:
            return 0 if self.device is not None and self.device.is_cpu else min(SPECULATE_GPU, rows - 1)
        if not isinstance(speculate, int) or not 0 <= speculate <= SPECULATE_MAX:
            raise EngineError(f"speculate takes 0 (off) to {SPECULATE_MAX} drafted tokens, got {speculate!r}")
        if speculate + 1 > rows:
            raise EngineError(
                f"speculate={speculate} verifies {speculate + 1} rows per step, but this engine's prefill_chunk "
                f"is {rows}: lower speculate or raise prefill_chunk"
            )
        return speculate

    def _backend_policy(self, k: int) -> SpeculationPolicy:
        backend = self.device.backend if self.device is not None else ""
        if self.model is None:
            return SpeculationPolicy.for_backend(k, backend)
        model = self.model
        steps, in_flight = model.decode_batching()
        share = model.attention_share(model.n_cached)  # the reply's start: its prompt is cached
        return SpeculationPolicy.for_backend(k, backend, model.config.dim, steps * in_flight, share)

    def _speculation_policy(self, k: int) -> SpeculationPolicy | None:
        return None if self.speculation_policy is None else self.speculation_policy(k)

    def abort(self) -> None:
        """Stop the running generation after the token being computed."""
        self._abort = True

    def reset(self) -> None:
        """Forget the cached context (the next request recomputes its whole prompt)."""
        if self.model is not None:
            self.model.truncate(0)

    def _require_model(self) -> BitNetModel:
        if self.model is None:
            if self._device_was_lost:
                raise EngineError("no model is loaded: the GPU device was lost, load the model again")
            raise EngineError("no model is loaded")
        return self.model

    def encode_prompt(self, prompt: str, add_bos: bool = True) -> list[int]:
        self._require_model()
        if not prompt:
            raise EngineError("the prompt is empty: give some text")
        return self.tokenizer.encode(prompt, add_bos=add_bos and self.tokenizer.add_bos)

    def encode_chat(self, messages: Sequence[dict], max_tokens: int = 256) -> list[int]:
        """Prompt tokens for a chat, with the oldest turns dropped when the conversation plus room for
        the reply (`max_tokens`, at most half the context) exceeds the context: see fit_chat_to_context.
        `self.chat_dropped_messages` says how many messages were left out."""
        self._require_model()
        messages = list(messages)
        self.template.parts(messages)  # validates every message first (errors name its index)
        context = self.config.context_length
        budget = context - min(max(1, max_tokens), context // 2)
        if self._turn_tokens[0] is not self.tokenizer or len(self._turn_tokens[1]) > 8192:
            self._turn_tokens = (self.tokenizer, {})
        cache = self._turn_tokens[1]

        def count(msgs: list[dict]) -> int:
            if len(msgs) > 8:  # the conversation finally kept: counted once per request, not cached
                return len(render_tokens(self.tokenizer, self.template, msgs, add_generation_prompt=True))
            key = (self.template.kind, *((m["role"], m["content"]) for m in msgs))
            n = cache.get(key)
            if n is None:
                n = cache[key] = len(render_tokens(self.tokenizer, self.template, msgs, add_generation_prompt=True))
            return n

        kept = fit_chat_to_context(messages, count, budget, limit=context - 1)
        self.chat_dropped_messages = len(messages) - len(kept)
        return render_tokens(self.tokenizer, self.template, kept, add_generation_prompt=True)

    async def generate_tokens_async(
        self,
        prompt_ids: Sequence[int],
        settings: SamplerSettings,
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        speculate: int = SPECULATE_DEFAULT,
    ) -> AsyncIterator[str]:
        """Prefill `prompt_ids` (reusing the cached prefix), then sample up to `max_tokens` tokens,
        yielding text as soon as it is complete UTF-8 and not part of a stop string.
        `speculate`: see `generate`."""
        steps = self._generate(prompt_ids, settings, max_tokens, stop_strings, self.speculate_for(speculate))
        async with contextlib.aclosing(steps) as pieces:
            try:
                async for piece in pieces:
                    yield piece
            except gpu.GPUDeviceLostError:
                self._forget_lost_device()
                raise

    async def _generate(
        self,
        prompt_ids: Sequence[int],
        settings: SamplerSettings,
        max_tokens: int,
        stop_strings: Sequence[str],
        speculate: int = 0,
    ) -> AsyncIterator[str]:
        model = self._require_model()
        tokenizer = self.tokenizer
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise EngineError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"token ids out of range 0..{self.config.vocab_size - 1}: {bad[:10]}")
        context = self.config.context_length
        if len(prompt_ids) >= context:
            raise EngineError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context holds {context}: "
                "shorten it or start a new chat"
            )
        self._abort = False
        self._requests += 1
        stats = GenerationStats(n_prompt_tokens=len(prompt_ids))
        self.last_stats = stats
        self.generated_tokens = []
        if max_tokens <= 0:
            return
        sampler = Sampler(settings)
        decoder = StreamDecoder(tokenizer)
        stopper = StopMatcher(list(stop_strings) + list(self.template.stop_strings if self.template else ()))
        start = time.perf_counter()

        reused = model.reuse_prefix(prompt_ids)
        stats.n_reused_tokens = reused
        history = list(prompt_ids)
        tokens = self._token_source(model, prompt_ids[reused:], sampler, settings, history, max_tokens, speculate)
        decode_start = None
        stats.stop_reason = "max_tokens"
        try:
            async for token in tokens:
                if stats.n_generated == 0:
                    stats.ttft_s = time.perf_counter() - start
                    stats.prefill_tok_per_s = (len(prompt_ids) - reused) / max(stats.ttft_s, 1e-9)
                    decode_start = time.perf_counter()
                if token in tokenizer.stop_ids:
                    stats.stop_reason = "eos"
                    break
                history.append(token)
                self.generated_tokens.append(token)
                stats.n_generated += 1
                text, stopped = stopper.push(decoder.push(token))
                if text:
                    yield text
                if stopped:
                    stats.stop_reason = "stop_string"
                    break
                if self._abort:
                    stats.stop_reason = "aborted"
                    break
                if stats.n_generated >= max_tokens:
                    break
            else:  # the token source ran out: every cache row is used, or abort() came during prefill
                stats.stop_reason = "aborted" if self._abort else "context_full"
        finally:
            await tokens.aclose()
        if stats.stop_reason != "stop_string":
            tail, _ = stopper.push(decoder.flush())
            tail += stopper.flush()
            if stopper.stopped:  # held-back text held a stop string after all
                stats.stop_reason = "stop_string"
            if tail:
                yield tail
        if decode_start is not None and stats.n_generated > 1:
            stats.decode_tok_per_s = (stats.n_generated - 1) / max(time.perf_counter() - decode_start, 1e-9)
        stats.context_used = model.n_cached
        self._abort = False

    async def _token_source(
        self,
        model: BitNetModel,
        new_ids: list[int],
        sampler: Sampler,
        settings: SamplerSettings,
        history: list[int],
        max_tokens: int,
        speculate: int = 0,
    ) -> AsyncIterator[int]:
        """Tokens of the reply, one per step. Where the GPU chooses each token (argmax, or a seeded
        draw: sampler.Sampler.gpu_supported) it chooses the first one too, in the prompt's last submit,
        and the decode steps queue behind it with no host round trip; only 4 bytes come back per token.
        Other settings read logits back and sample on the CPU. `history` (the caller appends each
        yielded token) is what the repetition penalty looks at; the caller takes at most
        `max_tokens`, so the GPU loop queues no step past them. `speculate` > 0: steps decoded on the
        GPU verify prompt-lookup drafts of up to that many tokens (model/decode.py)."""
        stats = self.last_stats
        greedy = settings.temperature == 0 and settings.repetition_penalty == 1.0
        gpu_sampled = not greedy and self.gpu_sampling and sampler.gpu_supported()
        if not (greedy or gpu_sampled):
            stats.token_choice = "cpu_sample"
            logits = await model.prefill(new_ids, progress=self.on_prefill, stop=lambda: self._abort)
            if logits is None:  # abort() while the prompt was read: no token
                return
            token = sampler.sample(logits, history)
            yield token
            while model.n_cached < model.config.context_length:  # else this token cannot be fed back
                logits = await model.decode(token)
                token = sampler.sample(logits, history)
                yield token
            return
        stops, limit = self.tokenizer.stop_ids, max_tokens - 1
        if greedy:
            chooser, stats.token_choice = model.argmax, "gpu_argmax"
        else:  # the first token takes the CPU sampler's next draw (draw 0 of its seed's stream)
            chooser, stats.token_choice = model.gpu_sampler, "gpu_sample"
            model.gpu_sampler.configure(settings, sampler.seed, sampler.draws, history)
        first = await model.prefill(new_ids, progress=self.on_prefill, stop=lambda: self._abort, choose=chooser)
        if first is None:  # abort() while the prompt was read: no token
            return
        on_gpu = None
        try:
            policy = self._speculation_policy(speculate) if speculate > 0 else None
            if greedy and speculate > 0:
                on_gpu = model.decode_speculative(first, speculate, limit, policy=policy, stop_ids=stops)
            elif greedy:
                on_gpu = model.decode_greedy(first, limit, stops)
            elif speculate > 0:  # the draws after the first token's
                args = (settings, sampler.seed, sampler.draws + 1, history, limit, policy, stops)
                on_gpu = model.decode_speculative_sampled(first, speculate, *args)
            else:
                on_gpu = model.decode_sampled(first, settings, sampler.seed, sampler.draws + 1, history, limit, stops)
            stats.speculate = speculate
            async for token in on_gpu:  # the first token first
                yield token
        finally:
            if on_gpu is not None:
                await on_gpu.aclose()
            first.discard(model.device)  # a loop that never read it
            if stats.speculate:
                stats.draft_proposed, stats.draft_accepted = model.draft_proposed, model.draft_accepted
                stats.verify_steps, stats.plain_steps = model.verify_steps, model.plain_steps
                stats.launched_steps = model.launched_steps
                stats.draft_length_counts = list(model.draft_length_counts)

    async def complete_async(
        self,
        prompt: str,
        settings: SamplerSettings,
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        speculate: int = SPECULATE_DEFAULT,
    ) -> AsyncIterator[str]:
        ids = self.encode_prompt(prompt)
        async for piece in self.generate_tokens_async(ids, settings, max_tokens, stop_strings, speculate):
            yield piece

    async def chat_async(
        self,
        messages: Sequence[dict],
        settings: SamplerSettings,
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        speculate: int = SPECULATE_DEFAULT,
    ) -> AsyncIterator[str]:
        ids = self.encode_chat(messages, max_tokens)
        dropped = self.chat_dropped_messages
        async for piece in self._chat_stream(ids, dropped, settings, max_tokens, stop_strings, speculate):
            yield piece

    async def _chat_stream(
        self,
        ids: list[int],
        n_dropped: int,
        settings: SamplerSettings,
        max_tokens: int,
        stop_strings: Sequence[str],
        speculate: int = SPECULATE_DEFAULT,
    ) -> AsyncIterator[str]:
        try:
            async for piece in self.generate_tokens_async(ids, settings, max_tokens, stop_strings, speculate):
                yield piece
        finally:
            self.last_stats.n_dropped_messages = n_dropped

    async def logits_async(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 logits [n_tokens, vocab] for every position of exactly these ids (no BOS added)."""
        model = self._require_model()
        ids = [int(t) for t in token_ids]
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise EngineError(f"token ids out of range 0..{self.config.vocab_size - 1}: {bad[:10]}")
        if len(ids) > self.config.context_length:
            raise EngineError(f"{len(ids)} tokens exceed the context length {self.config.context_length}")
        if not ids:
            raise EngineError("no token ids given")
        self._requests += 1
        model.truncate(0)
        try:
            return await model.prefill(ids, chunk=self.prefill_chunk, all_logits=True)
        except gpu.GPUDeviceLostError:
            self._forget_lost_device()
            raise

    def stop_warm_up(self) -> None:
        """End a running warm-up after its current submit (before a load replaces the model)."""
        self._requests += 1

    async def warm_up_async(self, seconds: float = WARM_UP_S) -> dict:
        """Keep the GPU busy for about `seconds`, so that its clocks are up when the next reply starts
        (the chat page calls it while the person types; model/warm_up.py says why). Ends early when a
        reply or a forward pass starts; touches nothing they read. Returns the loop's figures:
        {"seconds", "submits", "heads", "stopped"}."""
        model = self._require_model()
        started = self._requests

        def reply_started() -> bool:
            return self._requests != started or self.model is not model

        try:
            stats = await model.warm_up().run_async(seconds, reply_started)
        except gpu.GPUDeviceLostError:
            self._forget_lost_device()
            raise
        return stats.as_dict()

    # Synchronous wrappers (CPython) ----------------------------------------------------------------

    def _run(self, coroutine):
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._loop.run_until_complete(coroutine)
        # Called from code that a running event loop drives (Jupyter, an async web app): that loop
        # cannot be re-entered, so the engine's own loop runs the coroutine on a helper thread
        # while this thread waits (the calling loop is blocked meanwhile, as any sync call blocks it).
        if self._runner is None:
            self._runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bitnet-engine")
        return self._runner.submit(self._loop.run_until_complete, coroutine).result()

    def _iterate(self, agen: AsyncIterator[str]) -> Iterator[str]:
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def generate(
        self,
        prompt: str | None = None,
        settings: SamplerSettings | None = None,
        *,
        tokens: Sequence[int] | None = None,
        messages: Sequence[dict] | None = None,
        max_tokens: int = 256,
        stop_strings: Sequence[str] = (),
        speculate: int = SPECULATE_DEFAULT,
    ) -> Iterator[str]:
        """Stream text for a plain prompt, exact token ids (no BOS added) or chat messages.

        `speculate`: speculative decoding with drafts of up to that many tokens, found by prompt lookup
        (the n-gram ending the text so far, matched earlier in the prompt or reply: model/speculation.py)
        and verified on the GPU in one forward pass of draft + 1 rows. Greedy output is greedy decoding's
        token for token; sampled output (settings the GPU samples: sampler.Sampler.gpu_supported) keeps
        a drafted token with probability p(token), else draws from p without it, so its distribution is
        plain sampling's (a seed gives other tokens than without drafts, the same ones run after run).
        Replies that copy from their input (code with repeated structure, summaries, edits) come several
        tokens per pass; where the reply stops repeating, `speculation_policy` switches to plain decode
        steps until it repeats again. 0 turns it off; the default is `speculate_for`'s choice.
        CPU-sampled settings are decoded one token per step. `last_stats` reports draft_proposed /
        draft_accepted, verify_steps and plain_steps."""
        settings = settings or SamplerSettings()
        if messages is not None:
            ids = self.encode_chat(messages, max_tokens)
            stream = self._chat_stream(ids, self.chat_dropped_messages, settings, max_tokens, stop_strings, speculate)
            return self._iterate(stream)
        if tokens is not None:
            ids = list(tokens)
        elif prompt is not None:
            ids = self.encode_prompt(prompt)
        else:
            raise EngineError("give a prompt, token ids or chat messages")
        return self._iterate(self.generate_tokens_async(ids, settings, max_tokens, stop_strings, speculate))

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return self._run(self.logits_async(token_ids))

    def warm_up(self, seconds: float = WARM_UP_S) -> dict:
        return self._run(self.warm_up_async(seconds))

    def close(self) -> None:
        self.unload()
        if self._runner is not None:
            self._runner.shutdown()
            self._runner = None
        if self._loop is not None:
            self._loop.close()
            self._loop = None
