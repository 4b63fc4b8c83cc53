"""Small helpers for the GPU tests: opening a device (or skipping) and uploading numpy arrays."""

from __future__ import annotations

import numpy as np
import pytest

from bitnet_web import gpu


def open_device_or_skip(**kwargs) -> gpu.Device:
    """A WebGPU device (lavapipe in CI), or skip the test where the machine has no adapter."""
    try:
        return gpu.open_device(**kwargs)
    except gpu.GPUUnavailableError as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no WebGPU adapter: {exc}")


def upload(device: gpu.Device, array: np.ndarray, label: str, nbytes: int | None = None) -> gpu.Buffer:
    """A storage buffer holding `array` (at least `nbytes` long)."""
    array = np.ascontiguousarray(array)
    buffer = device.buffer(nbytes or array.nbytes, label=label)
    device.upload(buffer, 0, array)
    return buffer
