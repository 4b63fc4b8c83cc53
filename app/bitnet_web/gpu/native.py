"""wgpu-py backend (CPython): Vulkan/Metal/D3D12 through wgpu-native.

Used by the tests (Mesa lavapipe in CI), the CLI and the benchmarks on real GPUs.
"""

from __future__ import annotations

import numpy as np

from .base import (
    COPY_DST,
    MAP_READ,
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


class NativeRecorder(Recorder):
    __slots__ = ("_device", "_encoder", "_pass", "_set_pipeline", "_set_bind_group", "_dispatch", "passes",
                 "dispatches")

    def __init__(self, device: NativeDevice):
        self._device = device
        self._encoder = device._device.create_command_encoder()
        self._pass = None
        self.passes = 0
        self.dispatches = 0

    def _open_pass(self) -> None:
        self._pass = self._encoder.begin_compute_pass()
        self._set_pipeline = self._pass.set_pipeline
        self._set_bind_group = self._pass.set_bind_group
        self._dispatch = self._pass.dispatch_workgroups
        self.passes += 1

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        if self._pass is None:
            self._open_pass()
        self._set_pipeline(pipeline.handle)
        self._set_bind_group(0, bind_group.handle)
        self._dispatch(x, y, z)
        self.dispatches += 1

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        self._encoder.copy_buffer_to_buffer(src.handle, src_offset, dst.handle, dst_offset, nbytes)

    def submit(self) -> None:
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        try:
            self._device._queue.submit([self._encoder.finish()])
        except Exception as exc:  # wgpu raises its own error types; callers get ours
            raise self._device._translate(exc, "submit") from exc


class NativeDevice(Device):
    backend = "wgpu-native"

    def __init__(self, max_binding_size: int | None = None, power_preference: str = "high-performance"):
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
        features = [f for f in _WANTED_FEATURES if f in adapter.features]
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
        self._destroyed = False

    def _translate(self, exc: Exception, what: str) -> GPUError:
        text = str(exc)
        if self._destroyed or "lost" in text.lower() or "destroyed" in text.lower():
            return GPUDeviceLostError(f"GPU device lost during {what}: {text}")
        if "memory" in text.lower():
            return GPUOutOfMemoryError(f"{what}: out of GPU memory: {text}")
        return GPUError(f"{what}: {text}")

    def buffer(self, nbytes: int, usage: int = 0x0080 | 0x0008 | 0x0004, label: str = "") -> Buffer:
        if self._destroyed:
            raise GPUDeviceLostError(f"buffer {label!r}: the GPU device is gone; reload the model")
        size = self._check_buffer_size(nbytes, label)
        try:
            handle = self._device.create_buffer(size=size, usage=usage, label=label)
        except Exception as exc:
            raise self._translate(exc, f"creating buffer {label!r} ({size} bytes)") from exc
        self.live_buffers += 1
        self.bytes_allocated += size
        return Buffer(handle, size, label, usage)

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
        return Pipeline(handle, label, handle.get_bind_group_layout(0))

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
            raise GPUError(
                f"binding {[b.label for b in buffers]} to kernel {pipeline.label!r} failed: {exc}"
            ) from exc
        return BindGroup(handle, label or pipeline.label, tuple(buffers))

    def begin(self) -> NativeRecorder:
        if self._destroyed:
            raise GPUDeviceLostError("the GPU device is gone; reload the model")
        return NativeRecorder(self)

    def _readback_buffer(self, nbytes: int) -> Buffer:
        # One staging buffer, grown on demand: per-token reads create nothing.
        if self._readback is None or self._readback.nbytes < nbytes:
            if self._readback is not None:
                self.release(self._readback)
            self._readback = self.buffer(max(nbytes, 256), MAP_READ | COPY_DST, "readback staging")
        return self._readback

    async def read(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        return self.read_sync(buffer, offset, nbytes)

    def read_sync(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        staging = self._readback_buffer(nbytes)
        recorder = self.begin()
        recorder.copy(buffer, offset, staging, 0, nbytes)
        recorder.submit()
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
        return self._read_staging_sync(staging, nbytes)

    def release(self, buffer: Buffer) -> None:
        if buffer.handle is None:
            return
        buffer.handle.destroy()
        buffer.handle = None
        self.live_buffers -= 1
        self.bytes_allocated -= buffer.nbytes

    def destroy(self) -> None:
        if not self._destroyed:
            self._destroyed = True
            self._device.destroy()
