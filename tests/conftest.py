"""Set-up and fixtures shared by the CPython tests: XDG_RUNTIME_DIR, the GPU device and kernel cache."""

from __future__ import annotations

import os

import pytest

# Mesa's Vulkan loader (lavapipe) wants a runtime directory; set before anything loads wgpu.
# Subprocesses (the CLI tests) inherit it.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

from gpu_helpers import open_device_or_skip  # noqa: E402

from bitnet_web.kernels.common import KernelCache  # noqa: E402


@pytest.fixture(scope="module")
def device():
    dev = open_device_or_skip()
    yield dev
    dev.destroy()


@pytest.fixture(scope="module")
def kernels(device) -> KernelCache:
    return KernelCache(device)
