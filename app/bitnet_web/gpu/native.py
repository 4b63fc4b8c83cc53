"""wgpu-py backend (CPython): Vulkan/Metal/D3D12 through wgpu-native.

Used by the tests (Mesa lavapipe in CI), the CLI and the benchmarks on real GPUs.
"""

from __future__ import annotations

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

# Features the kernels use when present; none is required.
_WANTED_FEATURES = ("shader-f16", "subgroup", "timestamp-query")


def _raw_lib():
    """wgpu-native's C functions, called directly on the per-dispatch path.

    wgpu-py's pass methods wrap every call in argument handling and an error-checking shim
    (set_bind_group allocates a cffi array each time): ~9 us per dispatch measured on the H100
    host. The three C calls themselves cost ~1 us. Validation still happens inside wgpu-native and
    surfaces at submit through the device's error handler, so nothing is lost by skipping the shim.
    """
    try:
        from wgpu.backends.wgpu_native._ffi import ffi, lib

        return ffi, lib
    except Exception:  # a wgpu-py layout we do not know: use the public API
        return None, None


_FFI, _LIB = _raw_lib()


class NativeRecorder(Recorder):
    __slots__ = ("_device", "_encoder", "_pass", "_raw_pass", "_command_buffer", "passes", "dispatches")

    def __init__(self, device: NativeDevice):
        self._device = device
        self._encoder = device._device.create_command_encoder()
        self._command_buffer = None
        self._pass = None
        self._raw_pass = None
        self.passes = 0
        self.dispatches = 0

    def _open_pass(self) -> None:
        self._pass = self._encoder.begin_compute_pass()
        self._raw_pass = getattr(self._pass, "_internal", None) if _LIB is not None else None
        self.passes += 1

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        if self._pass is None:
            self._open_pass()
        raw_pass = self._raw_pass
        if raw_pass is not None and pipeline.raw is not None and bind_group.raw is not None:
            _LIB.wgpuComputePassEncoderSetPipeline(raw_pass, pipeline.raw)
            _LIB.wgpuComputePassEncoderSetBindGroup(raw_pass, 0, bind_group.raw, 0, _FFI.NULL)
            _LIB.wgpuComputePassEncoderDispatchWorkgroups(raw_pass, x, y, z)
        else:
            self._pass.set_pipeline(pipeline.handle)
            self._pass.set_bind_group(0, bind_group.handle)
            self._pass.dispatch_workgroups(x, y, z)
        self.dispatches += 1

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        self._encoder.copy_buffer_to_buffer(src.handle, src_offset, dst.handle, dst_offset, nbytes)

    def finish(self) -> None:
        if self._command_buffer is None:
            if self._pass is not None:
                self._pass.end()
                self._pass = None
            try:
                self._command_buffer = self._encoder.finish()
            except Exception as exc:  # wgpu raises its own error types; callers get ours
                raise self._device._translate(exc, "finishing a command buffer") from exc

    def submit(self) -> None:
        self.finish()
        try:
            self._device._queue.submit([self._command_buffer])
        except Exception as exc:
            raise self._device._translate(exc, "submit") from exc


class ProfilingRecorder(NativeRecorder):
    """Writes a GPU timestamp after every dispatch, so a step's time splits by kernel.

    Needs the adapter features 'timestamp-query' and 'timestamp-query-inside-passes' (wgpu-native
    only). Timestamps between dispatches include the gap before the next one, which is what a
    dependent chain pays anyway.
    """

    __slots__ = ("labels", "_query_set", "_write")

    def __init__(self, device: NativeDevice, query_set, write_timestamp):
        super().__init__(device)
        self.labels: list[str] = []
        self._query_set = query_set
        self._write = write_timestamp

    def _open_pass(self) -> None:
        super()._open_pass()
        self._raw_pass = None  # the public API path, so timestamps interleave correctly
        self._write(self._pass, self._query_set, len(self.labels))
        self.labels.append("<pass start>")

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        super().dispatch(pipeline, bind_group, x, y, z)
        self._write(self._pass, self._query_set, len(self.labels))
        self.labels.append(pipeline.label)


class NativeDevice(Device):
    backend = "wgpu-native"

    def __init__(
        self, max_binding_size: int | None = None, power_preference: str = "high-performance", profile: bool = False
    ):
        try:
            import wgpu
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise GPUUnavailableError("the 'wgpu' package is not installed: pip install 'bitnet-web[gpu]'") from exc
        self._wgpu = wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference=power_preference)
        if adapter is None:
            raise GPUUnavailableError(
                "no WebGPU adapter found: install a Vulkan driver (on Debian: mesa-vulkan-drivers for a CPU "
                "fallback) or use a machine with a GPU"
            )
        info = adapter.info
        self.adapter_name = f"{info.get('device', '?')} ({info.get('backend_type', '?')})"
        self.is_cpu = info.get("adapter_type") == "CPU"
        # Decode steps chain on the GPU within a submit (no copies between them), so 4 a submit beat one
        # (H200: Engine.generate 786-795 tok/s against 690-784; docs/performance.md "Session 19"). A CPU
        # adapter takes seconds per step: steps queued past a stop would cost that much each.
        self.decode_batching = (1, 2) if self.is_cpu else (4, 2)
        features = [f for f in _WANTED_FEATURES if f in adapter.features]
        self.profiling = profile and {"timestamp-query", "timestamp-query-inside-passes"} <= set(adapter.features)
        if self.profiling:
            features.append("timestamp-query-inside-passes")
        limits = adapter.limits
        wanted_limits = {
            "max-storage-buffer-binding-size": limits["max-storage-buffer-binding-size"],
            "max-buffer-size": limits["max-buffer-size"],
            "max-compute-workgroup-storage-size": limits["max-compute-workgroup-storage-size"],
            "max-compute-invocations-per-workgroup": limits["max-compute-invocations-per-workgroup"],
            "max-storage-buffers-per-shader-stage": limits["max-storage-buffers-per-shader-stage"],
        }
        try:
            self._device = adapter.request_device_sync(required_features=features, required_limits=wanted_limits)
        except Exception as exc:
            raise GPUUnavailableError(f"could not open a device on {self.adapter_name}: {exc}") from exc
        self._queue = self._device.queue
        binding = limits["max-storage-buffer-binding-size"]
        if max_binding_size is not None:
            binding = min(binding, max_binding_size)
        self.limits = GPULimits(
            max_storage_buffer_binding_size=binding,
            max_buffer_size=limits["max-buffer-size"],
            max_compute_workgroup_storage_size=limits["max-compute-workgroup-storage-size"],
            max_compute_invocations_per_workgroup=limits["max-compute-invocations-per-workgroup"],
            max_compute_workgroups_per_dimension=limits["max-compute-workgroups-per-dimension"],
            min_storage_buffer_offset_alignment=limits["min-storage-buffer-offset-alignment"],
        )
        self.features = frozenset(normalize_feature(f) for f in features)
        self.live_buffers = 0
        self.bytes_allocated = 0
        self._readback: Buffer | None = None
        # Mapping state for `_read_staging_raw`: one callback, created once, records the status
        # (0 while pending, then the WGPUMapAsyncStatus).
        self._map_done = [0]
        if _FFI is not None:
            done = self._map_done

            @_FFI.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
            def _on_mapped(status, message, userdata1, userdata2):
                done[0] = int(status)

            self._map_callback = _on_mapped
        self.lost_reason: str | None = None  # set once the device is destroyed or lost

    def _translate(self, exc: Exception, what: str) -> GPUError:
        text = str(exc)
        if self.lost_reason or "lost" in text.lower() or "destroyed" in text.lower():
            return GPUDeviceLostError(f"GPU device lost during {what}: {text}")
        if "memory" in text.lower():
            return GPUOutOfMemoryError(f"{what}: out of GPU memory: {text}")
        return GPUError(f"{what}: {text}")

    def buffer(self, nbytes: int, usage: int = STORAGE_USAGE, label: str = "") -> Buffer:
        if self.lost_reason:
            raise GPUDeviceLostError(f"buffer {label!r}: the GPU device is gone; reload the model")
        size = self._check_buffer_size(nbytes, label)
        try:
            handle = self._device.create_buffer(size=size, usage=int(usage), label=label)
        except Exception as exc:
            raise self._translate(exc, f"creating buffer {label!r} ({size} bytes)") from exc
        return self._tracked(handle, size, label, usage)

    def upload(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        data = self._check_upload(buffer, offset, data)
        try:
            self._queue.write_buffer(buffer.handle, offset, data)
        except Exception as exc:
            raise self._translate(exc, f"upload to {buffer.label!r}") from exc

    def pipeline(self, wgsl: str, label: str, entry_point: str = "main") -> Pipeline:
        try:
            module = self._device.create_shader_module(code=wgsl, label=label)
            handle = self._device.create_compute_pipeline(
                layout="auto", compute={"module": module, "entry_point": entry_point}, label=label
            )
        except Exception as exc:
            raise GPUError(f"compiling kernel {label!r} failed:\n{exc}") from exc
        return Pipeline(handle, label, handle.get_bind_group_layout(0), raw=getattr(handle, "_internal", None))

    def bind_group(self, pipeline: Pipeline, buffers: list[Buffer], label: str = "") -> BindGroup:
        entries = [
            {"binding": i, "resource": {"buffer": b.handle, "offset": 0, "size": b.nbytes}}
            for i, b in enumerate(buffers)
        ]
        try:
            handle = self._device.create_bind_group(
                layout=pipeline.bind_group_layout, entries=entries, label=label or pipeline.label
            )
        except Exception as exc:
            raise GPUError(f"binding {[b.label for b in buffers]} to kernel {pipeline.label!r} failed: {exc}") from exc
        return BindGroup(handle, label or pipeline.label, tuple(buffers), raw=getattr(handle, "_internal", None))

    def begin(self) -> NativeRecorder:
        if self.lost_reason:
            raise GPUDeviceLostError("the GPU device is gone; reload the model")
        return NativeRecorder(self)

    MAX_PROFILED_DISPATCHES = 2048

    def begin_profiled(self) -> ProfilingRecorder:
        """A recorder that timestamps every dispatch; read the result with `read_profile`."""
        if not self.profiling:
            raise GPUUnavailableError(
                "profiling needs NativeDevice(profile=True) on an adapter with timestamp-query-inside-passes"
            )
        from wgpu.backends.wgpu_native.extras import write_timestamp

        if not hasattr(self, "_query_set"):
            n = self.MAX_PROFILED_DISPATCHES
            self._query_set = self._device.create_query_set(type="timestamp", count=n)
            self._query_buffer = self.buffer(8 * n, 0x0200 | 0x0004, "timestamps")  # QUERY_RESOLVE | COPY_SRC
        return ProfilingRecorder(self, self._query_set, write_timestamp)

    def read_profile(self, recorder: ProfilingRecorder) -> list[tuple[str, float]]:
        """(label, microseconds) per dispatch of a submitted profiled recorder."""
        n = len(recorder.labels)
        encoder = self._device.create_command_encoder()
        encoder.resolve_query_set(self._query_set, 0, n, self._query_buffer.handle, 0)
        self._queue.submit([encoder.finish()])
        ticks = self.read_sync(self._query_buffer, 0, 8 * n).view(np.uint64).astype(np.float64)
        return [(label, (ticks[i] - ticks[i - 1]) / 1e3) for i, label in enumerate(recorder.labels) if i > 0]

    async def read_profile_async(self, recorder: ProfilingRecorder) -> list[tuple[str, float]]:
        """`read_profile`, as the browser device offers it."""
        return self.read_profile(recorder)

    async def read(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        return self.read_sync(buffer, offset, nbytes)

    def read_sync(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        staging = self._readback_buffer(nbytes)
        recorder = self.begin()
        recorder.copy(buffer, offset, staging, 0, nbytes)
        recorder.submit()
        if _LIB is not None:
            return self._read_staging_raw(staging, nbytes)
        return self._read_staging_sync(staging, nbytes)

    def _read_staging_sync(self, staging: Buffer, nbytes: int) -> np.ndarray:
        try:
            staging.handle.map_sync(self._wgpu.MapMode.READ, 0, staging.nbytes)
            data = np.frombuffer(staging.handle.read_mapped(0, nbytes), dtype=np.uint8).copy()
            staging.handle.unmap()
        except Exception as exc:
            raise self._translate(exc, f"reading back {staging.label!r}") from exc
        return data

    async def read_staging(self, staging: Buffer, nbytes: int) -> np.ndarray:
        if _LIB is None:
            return self._read_staging_sync(staging, nbytes)
        return self._read_staging_raw(staging, nbytes)

    def _read_staging_raw(self, staging: Buffer, nbytes: int) -> np.ndarray:
        """Map `staging` with a non-blocking poll loop, returning as soon as the submission that
        wrote it is done.

        wgpu-py's own mapping waits through a thread that polls with `wait=True`, which blocks
        until *every* submitted command buffer has finished: with decode steps queued ahead it
        would wait for the newest one and starve the GPU. Polling without waiting returns when
        this buffer's writer has finished, while later steps keep the GPU busy. Only the staging
        buffers of this device are mapped this way (never through wgpu-py's map methods).
        """
        done = self._map_done
        done[0] = 0
        info = _FFI.new("WGPUBufferMapCallbackInfo *")
        info.mode = _LIB.WGPUCallbackMode_AllowProcessEvents
        info.callback = self._map_callback
        _LIB.wgpuBufferMapAsync(staging.handle._internal, _LIB.WGPUMapMode_Read, 0, staging.nbytes, info[0])
        device = self._device._internal
        while not done[0]:
            _LIB.wgpuDevicePoll(device, False, _FFI.NULL)
        if done[0] != _LIB.WGPUMapAsyncStatus_Success:
            raise self._translate(GPUError(f"map status {done[0]}"), f"reading back {staging.label!r}")
        pointer = _LIB.wgpuBufferGetConstMappedRange(staging.handle._internal, 0, staging.nbytes)
        data = np.frombuffer(_FFI.buffer(pointer, nbytes), dtype=np.uint8).copy()
        _LIB.wgpuBufferUnmap(staging.handle._internal)
        return data

    def destroy(self) -> None:
        if self.lost_reason is None:
            self.lost_reason = "destroyed"
            self._device.destroy()
