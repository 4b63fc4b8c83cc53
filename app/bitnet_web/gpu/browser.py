"""Browser backend (Pyodide): the page's or worker's `navigator.gpu` through Pyodide's JS FFI.

FFI costs measured in Chromium (shared/browser-notes.md) shape this file: every JS object is
created once and kept; per-dispatch work is three calls on bound methods cached per pass; numpy
data reaches `writeBuffer` as a Uint8Array view over the wasm heap (no `to_js` copy), built fresh
per call because the heap's ArrayBuffer is replaced when wasm memory grows.
"""

from __future__ import annotations

import contextlib

import numpy as np

from .base import (
    STORAGE_USAGE,
    BindGroup,
    Buffer,
    Device,
    GPUDeviceLostError,
    GPUError,
    GPULimits,
    GPUOutOfMemoryError,
    GPUUnavailableError,
    Pipeline,
    Recorder,
    normalize_feature,
)

_WANTED_FEATURES = ("shader-f16", "subgroups", "timestamp-query")
_WANTED_LIMITS = (
    "maxStorageBufferBindingSize",
    "maxBufferSize",
    "maxComputeWorkgroupStorageSize",
    "maxComputeInvocationsPerWorkgroup",
    "maxStorageBuffersPerShaderStage",
)


def _js():
    import js  # noqa: PLC0415 - only importable under Pyodide
    from pyodide.ffi import to_js  # noqa: PLC0415

    def obj(**fields):
        return to_js(fields, dict_converter=js.Object.fromEntries)

    return js, obj


def _heap_view(array: np.ndarray):
    """A Uint8Array over the wasm heap bytes of a C-contiguous numpy array (no copy)."""
    import js  # noqa: PLC0415
    import pyodide_js  # noqa: PLC0415

    pointer = array.__array_interface__["data"][0]
    return js.Uint8Array.new(pyodide_js._module.HEAPU8.buffer, pointer, array.nbytes)


# Recording: a step's commands are collected as Python tuples and encoded in one call into
# static/gpu-replay.js (`bitnetGpuReplay.encode`), from a JS array built once per distinct command
# list ("program"). A decode step repeats the previous steps' list exactly (same pipelines, bind
# groups, workgroup counts and copies), so after the first steps encoding it costs one FFI call
# instead of three per dispatch. Any change (a bind group rebuilt after KV-cache growth, another
# split count, another staging buffer) gives a different list and so a program of its own: a
# program is found by comparing the whole list, never by a key that could go stale.
_DISPATCH = 0  # command kinds, as static/gpu-replay.js numbers them
_COPY = 1
# distinct command lists kept per device: decode cycles through 3 staging buffers, each with programs
# for the direct and split attention paths and a shorter last submit, beside prefill's programs
_PROGRAMS_KEPT = 64


def _replay_helper():
    """`bitnetGpuReplay` from static/gpu-replay.js when this page or worker loaded it, else None."""
    import js  # noqa: PLC0415

    helper = getattr(js, "bitnetGpuReplay", None)
    if helper is None or getattr(helper, "version", None) != 1:
        return None
    return helper


class RecordedPrograms:
    """The command lists already encoded on one device, each with its JS program (most recent first).

    Entries hold the handles they name, so a list that compares equal (identity of every pipeline,
    bind group and buffer handle, equality of every count and offset) names the same GPU objects.
    `enabled` False (always, when no JS helper is loaded) encodes every step with per-command FFI
    calls instead (benchmarks and tests compare the two).
    """

    def __init__(self, helper, capacity: int = _PROGRAMS_KEPT):
        self.helper = helper
        # bound once: each attribute read on a JS object is an FFI call
        self.encode = helper.encode if helper is not None else None
        self.submit = helper.submit if helper is not None else None
        self._enabled = helper is not None
        self.capacity = capacity
        self.entries: list[tuple[list[tuple], object, int]] = []  # (commands, JS program, passes)
        self.reused = 0  # steps encoded from a program built earlier
        self.built = 0  # programs built (first sight of a command list)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value) and self.helper is not None

    def program(self, commands: list[tuple]) -> tuple[object, int]:
        """(JS program, compute passes) for `commands`, built on first sight."""
        entries = self.entries
        last = commands[-1] if commands else None
        for i, entry in enumerate(entries):
            known = entry[0]
            # lists that differ mostly differ at the end (the staging buffer of a submit's one copy): checked
            # first, so a miss does not compare thousands of equal commands before it
            if len(known) == len(commands) and (not known or known[-1] == last) and known == commands:
                if i:
                    entries.insert(0, entries.pop(i))
                self.reused += 1
                return entry[1], entry[2]
        from pyodide.ffi import to_js  # noqa: PLC0415

        _require_handles(commands)
        program = to_js([value for command in commands for value in command])
        entries.insert(0, (list(commands), program, _count_passes(commands)))  # a copy no recorder can extend
        del entries[self.capacity :]
        self.built += 1
        return program, entries[0][2]

    def clear(self) -> None:
        self.entries.clear()


def recorded_programs(device: BrowserDevice) -> RecordedPrograms:
    """The device's program cache (created with the device's first recorder)."""
    programs = device.__dict__.get("_recorded_programs")
    if programs is None:
        programs = device._recorded_programs = RecordedPrograms(_replay_helper())
    return programs


def _count_passes(commands: list[tuple]) -> int:
    passes, in_pass = 0, False
    for command in commands:
        if command[0] == _DISPATCH:
            passes += not in_pass
            in_pass = True
        else:
            in_pass = False
    return passes


class _FinishedCommands:
    """A finished recorder's command list: recording into it is a caller bug, reported at once."""

    def append(self, command: tuple) -> None:
        raise GPUError("this recorder is finished (its commands are encoded): record the next step with device.begin()")


_FINISHED = _FinishedCommands()


def _require_handles(commands: list[tuple]) -> None:
    """Refuse a command list naming an object that does not exist yet: a dispatch recorded with a
    pipeline (or its bind group) still compiling in a batch. Checked once per distinct list."""
    for command in commands:
        if command[0] == _DISPATCH and (command[1] is None or command[2] is None):
            raise GPUError("a dispatch of a pipeline still compiling was recorded (before end_pipeline_batch)")


def _encode_directly(gpu_device, commands: list[tuple], query_set=None):
    """Encode `commands` with one FFI call per WebGPU call (no JS helper, or replay disabled). With a
    timestamp `query_set`: dispatch i in a compute pass of its own that writes timestamps 2i and 2i + 1
    at its start and end (BrowserProfilingRecorder)."""
    _require_handles(commands)
    encoder = gpu_device.createCommandEncoder()
    compute_pass = None
    timed = 0
    for command in commands:
        if command[0] == _DISPATCH:
            if compute_pass is None:
                if query_set is None:
                    compute_pass = encoder.beginComputePass()
                else:
                    _, obj = _js()
                    writes = obj(querySet=query_set, beginningOfPassWriteIndex=timed, endOfPassWriteIndex=timed + 1)
                    compute_pass = encoder.beginComputePass(obj(timestampWrites=writes))
                    timed += 2
                set_pipeline, set_bind_group = compute_pass.setPipeline, compute_pass.setBindGroup
                dispatch = compute_pass.dispatchWorkgroups
            _, pipeline, bind_group, x, y, z = command
            set_pipeline(pipeline)
            set_bind_group(0, bind_group)
            dispatch(x, y, z)
            if query_set is not None:
                compute_pass.end()
                compute_pass = None
        else:
            if compute_pass is not None:
                compute_pass.end()
                compute_pass = None
            _, src, src_offset, dst, dst_offset, nbytes = command
            encoder.copyBufferToBuffer(src, src_offset, dst, dst_offset, nbytes)
    if compute_pass is not None:
        compute_pass.end()
    return encoder.finish()


class BrowserRecorder(Recorder):
    """Collects a step's commands; `finish` encodes them (one FFI call when the JS helper is loaded)."""

    __slots__ = ("_device", "_commands", "_programs", "_command_buffer", "passes", "dispatches")

    def __init__(self, device: BrowserDevice):
        self._device = device
        self._programs = recorded_programs(device)
        self._commands: list[tuple] = []
        self._command_buffer = None
        self.passes = 0
        self.dispatches = 0

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        # (a handle still None, a pipeline of an unfinished batch, is refused when the list is encoded)
        self._commands.append((_DISPATCH, pipeline.handle, bind_group.handle, x, y, z))
        self.dispatches += 1

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        for buffer in (src, dst):
            if buffer.handle is None:
                raise GPUError(f"copy {src.label!r} -> {dst.label!r}: buffer {buffer.label!r} was released")
        self._commands.append((_COPY, src.handle, src_offset, dst.handle, dst_offset, nbytes))

    def finish(self) -> None:
        if self._command_buffer is not None:
            return
        programs = self._programs
        gpu_device = self._device._device
        if programs.enabled:
            program, self.passes = programs.program(self._commands)
            self._command_buffer = programs.encode(gpu_device, program)
        else:
            self.passes = _count_passes(self._commands)
            self._command_buffer = _encode_directly(gpu_device, self._commands)
        self._commands = _FINISHED

    def submit(self) -> None:
        if self._device.lost_reason is not None:
            raise GPUDeviceLostError(f"GPU device lost: {self._device.lost_reason}")
        self.finish()
        programs = self._programs
        if programs.enabled:
            programs.submit(self._device._queue, self._command_buffer)
        else:
            js, _ = _js()
            self._device._queue.submit(js.Array.of(self._command_buffer))


class BrowserProfilingRecorder(BrowserRecorder):
    """Each dispatch in a compute pass of its own whose beginning and end write timestamps (core
    'timestamp-query': no timestamps inside passes needed), so a step's GPU time splits by kernel;
    encoded directly, never replayed. Read with `BrowserDevice.read_profile_async`. The passes separate
    the dispatches as a step never does, so the sum is each kernel's own time, not the step's."""

    __slots__ = ("labels",)

    def __init__(self, device: BrowserDevice):
        super().__init__(device)
        self.labels: list[str] = []

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        if len(self.labels) >= self._device.MAX_PROFILED_DISPATCHES:
            raise GPUError(f"a profiled recording holds at most {self._device.MAX_PROFILED_DISPATCHES} dispatches")
        super().dispatch(pipeline, bind_group, x, y, z)
        self.labels.append(pipeline.label)

    def finish(self) -> None:
        if self._command_buffer is not None:
            return
        self.passes = self.dispatches
        self._command_buffer = _encode_directly(self._device._device, self._commands, self._device._profile_queries())
        self._commands = _FINISHED


class BrowserDevice(Device):
    backend = "browser"

    def __init__(self, adapter, device, max_binding_size: int | None):
        self._adapter = adapter
        self._device = device
        self._queue = device.queue
        self._pipeline_batch: list[tuple[Pipeline, object]] | None = None  # (pipeline, its promise)
        self._pending_maps: dict[Buffer, object] = {}  # start_read's mapAsync promises, by staging buffer
        self._ignore_rejection = None  # a JS callback made on first use (start_read)
        self._bind_group_batch: list[tuple[BindGroup, Pipeline]] = []  # made when the batch ends
        info = getattr(adapter, "info", None)
        vendor = getattr(info, "vendor", "") if info is not None else ""
        architecture = getattr(info, "architecture", "") if info is not None else ""
        self.adapter_name = f"{vendor} / {architecture} (WebGPU)".strip()
        self.is_cpu = bool(getattr(adapter, "isFallbackAdapter", False)) or "swiftshader" in (
            f"{vendor} {architecture}".lower()
        )
        # Each await of a readback costs the page ~0.6 ms and more (Pyodide's event-loop hop plus the
        # GPU process's round trip; docs/performance.md): 16 decode steps per submit and 2 submits
        # queued keep a real GPU busy. A CPU adapter takes seconds per step: steps queued past a stop
        # would cost that much each, so it keeps one step per submit.
        self.decode_batching = (1, 2) if self.is_cpu else (16, 2)
        min_size = getattr(info, "subgroupMinSize", None) if info is not None else None
        self.subgroup_min_size = int(min_size) if isinstance(min_size, (int, float)) and min_size >= 1 else None
        limits = device.limits
        binding = int(limits.maxStorageBufferBindingSize)
        if max_binding_size is not None:
            binding = min(binding, max_binding_size)
        self.limits = GPULimits(
            max_storage_buffer_binding_size=binding,
            max_buffer_size=int(limits.maxBufferSize),
            max_compute_workgroup_storage_size=int(limits.maxComputeWorkgroupStorageSize),
            max_compute_invocations_per_workgroup=int(limits.maxComputeInvocationsPerWorkgroup),
            max_compute_workgroups_per_dimension=int(limits.maxComputeWorkgroupsPerDimension),
            min_storage_buffer_offset_alignment=int(limits.minStorageBufferOffsetAlignment),
        )
        self.features = frozenset(normalize_feature(f) for f in _WANTED_FEATURES if device.features.has(f))
        self.live_buffers = 0
        self.bytes_allocated = 0
        self.lost_reason: str | None = None
        self._readback: Buffer | None = None
        self._scope_open = False
        self._destroying = False  # set by destroy(): a loss we caused is not reported to listeners
        self._lost_listeners: list = []
        from pyodide.ffi import create_once_callable  # noqa: PLC0415

        def _on_lost(info):
            self.lost_reason = str(getattr(info, "message", "") or getattr(info, "reason", "unknown"))
            if not self._destroying:
                for listener in self._lost_listeners:
                    listener(self.lost_reason)

        # Settles once `_on_lost` has run (the once-callable is freed by that single call).
        self._lost_settled = device.lost.then(create_once_callable(_on_lost))
        self._push_scopes()

    def add_lost_listener(self, listener) -> None:
        """Call `listener(reason)` when the device is lost by something other than `destroy()`
        (a driver reset, the GPU process crashing, the browser reclaiming it): the worker tells the
        page at once, even when no request is running. Adding the same listener again is a no-op."""
        if listener not in self._lost_listeners:
            self._lost_listeners.append(listener)

    async def _lost_during(self, what: str, exc: Exception) -> GPUDeviceLostError | None:
        """After a GPU call failed: the device-lost error if the device is gone, else None.

        A destroyed or reset device rejects pending mapAsync calls (AbortError / OperationError)
        in a task that can run before the task resolving `device.lost`, so `lost_reason` may still
        be None here: wait (at most 1 s, only on this failure path) for `lost` to settle first."""
        if self.lost_reason is None:
            import js  # noqa: PLC0415
            from pyodide.ffi import create_once_callable  # noqa: PLC0415

            def start_timer(resolve, reject):
                js.setTimeout(resolve, 1000)

            await js.Promise.race(js.Array.of(self._lost_settled, js.Promise.new(create_once_callable(start_timer))))
        if self.lost_reason is None:
            return None
        return GPUDeviceLostError(f"GPU device lost during {what}: {self.lost_reason}")

    @classmethod
    async def open(cls, max_binding_size: int | None = None, power_preference: str = "high-performance"):
        js, obj = _js()
        gpu = getattr(js.navigator, "gpu", None)
        if gpu is None:
            raise GPUUnavailableError(
                "this browser has no WebGPU (navigator.gpu is missing): use a current Chrome or Edge on a "
                "desktop, served over https or from localhost; on Linux start Chrome with "
                "--enable-unsafe-webgpu --enable-features=Vulkan"
            )
        adapter = await gpu.requestAdapter(obj(powerPreference=power_preference))
        if adapter is None:
            raise GPUUnavailableError(
                "WebGPU is present but no GPU adapter is available (blocklisted driver or disabled GPU): check "
                "chrome://gpu, update the graphics driver, or enable chrome://flags/#enable-unsafe-webgpu"
            )
        features = [f for f in _WANTED_FEATURES if adapter.features.has(f)]
        limits = {name: getattr(adapter.limits, name) for name in _WANTED_LIMITS}
        try:
            device = await adapter.requestDevice(obj(requiredFeatures=features, requiredLimits=limits))
        except Exception as exc:
            raise GPUUnavailableError(f"the GPU adapter refused to open a device: {exc}") from exc
        return cls(adapter, device, max_binding_size)

    # Error scopes: one pair is open at all times; `checkpoint` pops it (raising what it caught)
    # and opens the next, so long phases like the weight upload pay for one await, not one per call.
    def _push_scopes(self) -> None:
        self._device.pushErrorScope("out-of-memory")
        self._device.pushErrorScope("validation")
        self._scope_open = True

    async def checkpoint(self, what: str) -> None:
        validation = await self._device.popErrorScope()
        out_of_memory = await self._device.popErrorScope()
        self._push_scopes()
        if self.lost_reason is not None:
            raise GPUDeviceLostError(f"GPU device lost during {what}: {self.lost_reason}")
        if out_of_memory is not None:
            raise GPUOutOfMemoryError(f"{what}: out of GPU memory: {out_of_memory.message}")
        if validation is not None:
            raise GPUError(f"{what}: {validation.message}")

    def buffer(self, nbytes: int, usage: int = STORAGE_USAGE, label: str = "") -> Buffer:
        if self.lost_reason is not None:
            raise GPUDeviceLostError(f"buffer {label!r}: the GPU device is lost; reload the model")
        size = self._check_buffer_size(nbytes, label)
        _, obj = _js()
        handle = self._device.createBuffer(obj(size=size, usage=int(usage), label=label))
        return self._tracked(handle, size, label, usage)

    def upload(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        data = self._check_upload(buffer, offset, data)
        self._queue.writeBuffer(buffer.handle, offset, _heap_view(data))

    def pipeline(self, wgsl: str, label: str, entry_point: str = "main") -> Pipeline:
        _, obj = _js()
        module = self._device.createShaderModule(obj(code=wgsl, label=label))
        descriptor = obj(layout="auto", compute=obj(module=module, entryPoint=entry_point), label=label)
        if self._pipeline_batch is not None:
            pipeline = Pipeline(None, label)  # its handle and layout arrive at end_pipeline_batch
            self._pipeline_batch.append((pipeline, self._device.createComputePipelineAsync(descriptor)))
            return pipeline
        handle = self._device.createComputePipeline(descriptor)
        return Pipeline(handle, label, handle.getBindGroupLayout(0))

    def begin_pipeline_batch(self) -> None:
        """Pipelines made until `end_pipeline_batch` are created with createComputePipelineAsync, all
        at once: Chromium compiles them on its worker threads in parallel instead of one after the
        other on the GPU process's main thread (docs/performance.md, "Session 8"). Bind groups of
        those pipelines are made when their layout is known, at the end of the batch."""
        if self._pipeline_batch is None:
            self._pipeline_batch, self._bind_group_batch = [], []

    async def end_pipeline_batch(self) -> None:
        pipelines, self._pipeline_batch = self._pipeline_batch or [], None
        groups, self._bind_group_batch = self._bind_group_batch, []
        failed = None
        for pipeline, promise in pipelines:  # all were started: waiting in order costs the slowest one
            try:
                handle = await promise
            except Exception as exc:
                failed = failed or GPUError(f"creating pipeline {pipeline.label!r} failed: {exc}")
                continue
            pipeline.handle, pipeline.bind_group_layout = handle, handle.getBindGroupLayout(0)
        if failed is not None:
            raise failed
        for group, pipeline in groups:
            group.handle = self._make_bind_group(pipeline, group.buffers, group.label)

    async def pipeline_checked(self, wgsl: str, label: str, entry_point: str = "main") -> Pipeline:
        """Compile and wait for the result, so a WGSL error names its kernel."""
        _, obj = _js()
        module = self._device.createShaderModule(obj(code=wgsl, label=label))
        info = await module.getCompilationInfo()
        errors = [m for m in info.messages if m.type == "error"]
        if errors:
            text = "\n".join(f"line {m.lineNum}:{m.linePos}: {m.message}" for m in errors)
            raise GPUError(f"compiling kernel {label!r} failed:\n{text}")
        try:
            handle = await self._device.createComputePipelineAsync(
                obj(layout="auto", compute=obj(module=module, entryPoint=entry_point), label=label)
            )
        except Exception as exc:
            raise GPUError(f"creating pipeline {label!r} failed: {exc}") from exc
        return Pipeline(handle, label, handle.getBindGroupLayout(0))

    def bind_group(self, pipeline: Pipeline, buffers: list[Buffer], label: str = "") -> BindGroup:
        label = label or pipeline.label
        if pipeline.handle is None and self._pipeline_batch is not None:  # made at end_pipeline_batch
            group = BindGroup(None, label, tuple(buffers))
            self._bind_group_batch.append((group, pipeline))
            return group
        return BindGroup(self._make_bind_group(pipeline, buffers, label), label, tuple(buffers))

    def _make_bind_group(self, pipeline: Pipeline, buffers: tuple[Buffer, ...] | list[Buffer], label: str):
        js, obj = _js()
        entries = js.Array.new()
        for i, b in enumerate(buffers):
            entries.push(obj(binding=i, resource=obj(buffer=b.handle, offset=0, size=b.nbytes)))
        return self._device.createBindGroup(obj(layout=pipeline.bind_group_layout, entries=entries, label=label))

    MAX_PROFILED_DISPATCHES = 2048

    @property
    def profiling(self) -> bool:
        """Whether `begin_profiled` works here (the device has 'timestamp-query')."""
        return "timestamp-query" in self.features

    def begin_profiled(self) -> BrowserProfilingRecorder:
        """A recorder that times every dispatch on the GPU; read the result with `read_profile_async`."""
        if not self.profiling:
            raise GPUUnavailableError("profiling needs the 'timestamp-query' feature, which this adapter lacks")
        return BrowserProfilingRecorder(self)

    def _profile_queries(self):
        """The timestamp query set of profiled recordings (two per dispatch), made on first use."""
        if getattr(self, "_query_set", None) is None:
            _, obj = _js()
            n = 2 * self.MAX_PROFILED_DISPATCHES
            self._query_set = self._device.createQuerySet(obj(type="timestamp", count=n))
            self._query_resolve = self.buffer(8 * n, 0x0200 | 0x0004, "timestamps")  # QUERY_RESOLVE | COPY_SRC
        return self._query_set

    async def read_profile_async(self, recorder: BrowserProfilingRecorder) -> list[tuple[str, float]]:
        """(label, GPU microseconds) per dispatch of a submitted profiled recorder: each kernel's own time."""
        n = 2 * len(recorder.labels)
        if n == 0:
            return []
        encoder = self._device.createCommandEncoder()
        encoder.resolveQuerySet(self._query_set, 0, n, self._query_resolve.handle, 0)
        js, _ = _js()
        self._queue.submit(js.Array.of(encoder.finish()))
        ns = (await self.read(self._query_resolve, 0, 8 * n)).view(np.uint64).astype(np.float64)
        return [(label, (ns[2 * i + 1] - ns[2 * i]) / 1e3) for i, label in enumerate(recorder.labels)]

    def begin(self) -> BrowserRecorder:
        if self.lost_reason is not None:
            raise GPUDeviceLostError(f"the GPU device is lost ({self.lost_reason}); reload the model")
        return BrowserRecorder(self)

    async def read(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        staging = self._readback_buffer(nbytes)
        recorder = self.begin()
        recorder.copy(buffer, offset, staging, 0, nbytes)
        recorder.submit()
        return await self.read_staging(staging, nbytes)

    def start_read(self, staging: Buffer) -> None:
        js, _ = _js()
        promise = staging.handle.mapAsync(js.GPUMapMode.READ, 0, staging.nbytes)
        if self._ignore_rejection is None:
            from pyodide.ffi import create_proxy  # noqa: PLC0415

            self._ignore_rejection = create_proxy(lambda *_: None)
        # A cancelled read rejects its promise (AbortError): handled here, never an uncaught rejection;
        # read_staging still sees a real failure, as it awaits the promise itself.
        promise.catch(self._ignore_rejection)
        self._pending_maps[staging] = promise

    def release(self, buffer: Buffer) -> None:
        self._pending_maps.pop(buffer, None)  # destroying it rejects the map (handled in start_read)
        super().release(buffer)

    def cancel_read(self, staging: Buffer) -> None:
        if self._pending_maps.pop(staging, None) is not None and staging.handle is not None:
            with contextlib.suppress(Exception):  # a lost device has nothing left to unmap
                staging.handle.unmap()

    async def read_staging(self, staging: Buffer, nbytes: int) -> np.ndarray:
        js, _ = _js()
        started = self._pending_maps.pop(staging, None)
        try:
            await (started if started is not None else staging.handle.mapAsync(js.GPUMapMode.READ, 0, staging.nbytes))
        except Exception as exc:
            lost = await self._lost_during(f"reading back {staging.label!r}", exc)
            if lost is not None:
                raise lost from exc
            raise GPUError(f"reading back {staging.label!r} failed: {exc}") from exc
        mapped = staging.handle.getMappedRange(0, nbytes)
        out = np.empty(nbytes, dtype=np.uint8)
        js.Uint8Array.new(mapped).assign_to(out)
        staging.handle.unmap()
        return out

    def destroy(self) -> None:
        self._destroying = True
        if self.lost_reason is None:
            self.lost_reason = "destroyed"
        self._device.destroy()
