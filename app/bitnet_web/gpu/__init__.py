"""The GPU layer: one small `Device` interface over wgpu-py (CPython) and WebGPU (Pyodide).

Only this package knows which backend it runs on.
"""

from __future__ import annotations

import sys

from .base import (
    COPY_DST,
    COPY_SRC,
    MAP_READ,
    READBACK_USAGE,
    STORAGE,
    STORAGE_USAGE,
    UNIFORM,
    UNIFORM_USAGE,
    BindGroup,
    Buffer,
    BufferUsage,
    Device,
    GPUDeviceLostError,
    GPUError,
    GPULimits,
    GPUOutOfMemoryError,
    GPUUnavailableError,
    Pipeline,
    Recorder,
    shard_rows,
)

IN_BROWSER = sys.platform == "emscripten"

__all__ = [
    "COPY_DST",
    "COPY_SRC",
    "MAP_READ",
    "READBACK_USAGE",
    "STORAGE",
    "STORAGE_USAGE",
    "UNIFORM",
    "UNIFORM_USAGE",
    "BindGroup",
    "Buffer",
    "BufferUsage",
    "Device",
    "GPUDeviceLostError",
    "GPUError",
    "GPULimits",
    "GPUOutOfMemoryError",
    "GPUUnavailableError",
    "IN_BROWSER",
    "Pipeline",
    "Recorder",
    "open_device",
    "open_device_async",
    "shard_rows",
]


def open_device(max_binding_size: int | None = None, profile: bool = False) -> Device:
    """Open the default adapter's device in CPython (wgpu-py). In the browser use `open_device_async`.

    `max_binding_size` lowers the storage-binding limit the engine plans for, so tensor sharding can
    be exercised on any device.
    """
    if IN_BROWSER:
        raise RuntimeError("in the browser the device must be opened with `await open_device_async()`")
    from .native import NativeDevice

    return NativeDevice(max_binding_size=max_binding_size, profile=profile)


async def open_device_async(max_binding_size: int | None = None) -> Device:
    if IN_BROWSER:
        from .browser import BrowserDevice

        return await BrowserDevice.open(max_binding_size=max_binding_size)
    return open_device(max_binding_size=max_binding_size)
