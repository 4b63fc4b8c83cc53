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


@pytest.fixture(scope="module")
def tiny_path(request, tmp_path_factory) -> str:
    """A random BitNet GGUF of the module's `TINY` (random_bitnet_writer's arguments), written once."""
    from bitnet_web.convert.synthetic import random_bitnet_writer

    path = str(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    random_bitnet_writer(path, **request.module.TINY).write()
    return path


@pytest.fixture(scope="module")
def engine(request):
    """An Engine for the module, closed after it: prefill chunk `PREFILL_CHUNK` of the module (default
    32), loaded from the module's `tiny_path` when the module has a `TINY` shape."""
    from bitnet_web.engine import Engine

    engine = Engine(prefill_chunk=getattr(request.module, "PREFILL_CHUNK", 32))
    if hasattr(request.module, "TINY"):
        engine.load(request.getfixturevalue("tiny_path"))
    yield engine
    engine.close()
