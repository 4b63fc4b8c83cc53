"""Browser backend (Pyodide): the page's or worker's `navigator.gpu` through Pyodide's JS FFI.

FFI costs measured in Chromium (shared/browser-notes.md) shape this file: every JS object is
created once and kept; per-dispatch work is three calls on bound methods cached per pass; numpy
data reaches `writeBuffer` as a Uint8Array view over the wasm heap (no `to_js` copy), built fresh
per call because the heap's ArrayBuffer is replaced when wasm memory grows.
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


class BrowserRecorder(Recorder):
    __slots__ = ("_device", "_encoder", "_pass", "_set_pipeline", "_set_bind_group", "_dispatch", "passes",
                 "dispatches", "_command_buffers")

    def __init__(self, device: BrowserDevice):
        self._device = device
        self._encoder = device._device.createCommandEncoder()
        self._command_buffers = None
        self._pass = None
        self.passes = 0
        self.dispatches = 0

    def _open_pass(self) -> None:
        self._pass = self._encoder.beginComputePass()
        self._set_pipeline = self._pass.setPipeline
        self._set_bind_group = self._pass.setBindGroup
        self._dispatch = self._pass.dispatchWorkgroups
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
        self._encoder.copyBufferToBuffer(src.handle, src_offset, dst.handle, dst_offset, nbytes)

    def finish(self) -> None:
        if self._command_buffers is None:
            if self._pass is not None:
                self._pass.end()
                self._pass = None
            js, _ = _js()
            self._command_buffers = js.Array.of(self._encoder.finish())

    def submit(self) -> None:
        if self._device.lost_reason is not None:
            raise GPUDeviceLostError(f"GPU device lost: {self._device.lost_reason}")
        self.finish()
        self._device._queue.submit(self._command_buffers)


class BrowserDevice(Device):
    backend = "browser"

    def __init__(self, adapter, device, max_binding_size: int | None):
        self._adapter = adapter
        self._device = device
        self._queue = device.queue
        info = getattr(adapter, "info", None)
        vendor = getattr(info, "vendor", "") if info is not None else ""
        architecture = getattr(info, "architecture", "") if info is not None else ""
        self.adapter_name = f"{vendor} / {architecture} (WebGPU)".strip()
        self.is_cpu = bool(getattr(adapter, "isFallbackAdapter", False)) or "swiftshader" in (
            f"{vendor} {architecture}".lower())
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
        self.features = frozenset(
            normalize_feature(f) for f in _WANTED_FEATURES if device.features.has(f)
        )
        self.live_buffers = 0
        self.bytes_allocated = 0
        self.lost_reason: str | None = None
        self._readback: Buffer | None = None
        self._scope_open = False
        from pyodide.ffi import create_once_callable  # noqa: PLC0415

        def _on_lost(info):
            self.lost_reason = str(getattr(info, "message", "") or getattr(info, "reason", "unknown"))

        device.lost.then(create_once_callable(_on_lost))
        self._push_scopes()

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

    def buffer(self, nbytes: int, usage: int = 0x0080 | 0x0008 | 0x0004, label: str = "") -> Buffer:
        if self.lost_reason is not None:
            raise GPUDeviceLostError(f"buffer {label!r}: the GPU device is lost; reload the model")
        size = self._check_buffer_size(nbytes, label)
        _, obj = _js()
        handle = self._device.createBuffer(obj(size=size, usage=usage, label=label))
        self.live_buffers += 1
        self.bytes_allocated += size
        return Buffer(handle, size, label, usage)

    def upload(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        data = self._check_upload(buffer, offset, data)
        self._queue.writeBuffer(buffer.handle, offset, _heap_view(data))

    def pipeline(self, wgsl: str, label: str, entry_point: str = "main") -> Pipeline:
        _, obj = _js()
        module = self._device.createShaderModule(obj(code=wgsl, label=label))
        handle = self._device.createComputePipeline(
            obj(layout="auto", compute=obj(module=module, entryPoint=entry_point), label=label)
        )
        return Pipeline(handle, label, handle.getBindGroupLayout(0))

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
        js, obj = _js()
        entries = js.Array.new()
        for i, b in enumerate(buffers):
            entries.push(obj(binding=i, resource=obj(buffer=b.handle, offset=0, size=b.nbytes)))
        handle = self._device.createBindGroup(
            obj(layout=pipeline.bind_group_layout, entries=entries, label=label or pipeline.label)
        )
        return BindGroup(handle, label or pipeline.label, tuple(buffers))

    def begin(self) -> BrowserRecorder:
        if self.lost_reason is not None:
            raise GPUDeviceLostError(f"the GPU device is lost ({self.lost_reason}); reload the model")
        return BrowserRecorder(self)

    def _readback_buffer(self, nbytes: int) -> Buffer:
        if self._readback is None or self._readback.nbytes < nbytes:
            if self._readback is not None:
                self.release(self._readback)
            self._readback = self.buffer(max(nbytes, 256), MAP_READ | COPY_DST, "readback staging")
        return self._readback

    async def read(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        nbytes = buffer.nbytes - offset if nbytes is None else nbytes
        staging = self._readback_buffer(nbytes)
        recorder = self.begin()
        recorder.copy(buffer, offset, staging, 0, nbytes)
        recorder.submit()
        return await self.read_staging(staging, nbytes)

    async def read_staging(self, staging: Buffer, nbytes: int) -> np.ndarray:
        js, _ = _js()
        try:
            await staging.handle.mapAsync(js.GPUMapMode.READ, 0, staging.nbytes)
        except Exception as exc:
            if self.lost_reason is not None:
                raise GPUDeviceLostError(f"GPU device lost: {self.lost_reason}") from exc
            raise GPUError(f"reading back {staging.label!r} failed: {exc}") from exc
        mapped = staging.handle.getMappedRange(0, nbytes)
        out = np.empty(nbytes, dtype=np.uint8)
        js.Uint8Array.new(mapped).assign_to(out)
        staging.handle.unmap()
        return out

    def release(self, buffer: Buffer) -> None:
        if buffer.handle is None:
            return
        buffer.handle.destroy()
        buffer.handle = None
        self.live_buffers -= 1
        self.bytes_allocated -= buffer.nbytes

    def destroy(self) -> None:
        if self.lost_reason is None:
            self.lost_reason = "destroyed"
        self._device.destroy()

