"""Arithmetic to keep the GPU busy (shaders/gpu_busy.wgsl): the warm-up's filler for small models."""

from __future__ import annotations

from .. import gpu
from .common import KernelCache

BUSY_ITERS = 1024  # FMA steps of each of an invocation's four chains
BUSY_WG = 256  # invocations per workgroup
# Workgroups per dispatch: 1,024 x 256 invocations fill a large GPU (H200: ~30 us a dispatch); a CPU
# adapter (tests, SwiftShader) gets a few, so a dispatch stays in milliseconds there.
BUSY_WORKGROUPS = 1024
BUSY_WORKGROUPS_CPU = 4


class GPUBusy:
    """One dispatch of gpu_busy.wgsl: ~BUSY_WORKGROUPS x BUSY_WG x BUSY_ITERS x 4 FMAs, no memory read."""

    def __init__(self, kernels: KernelCache, label: str = "gpu busy"):
        device = kernels.device
        self.workgroups = BUSY_WORKGROUPS_CPU if device.is_cpu else BUSY_WORKGROUPS
        self.sink = device.buffer(16, gpu.STORAGE_USAGE, f"{label} sink")  # (1,) f32, stays zero
        self.pipeline = kernels.pipeline("gpu_busy", ITERS=BUSY_ITERS, WG=BUSY_WG)
        self.bind = device.bind_group(self.pipeline, [self.sink], label)

    def record(self, recorder: gpu.Recorder) -> None:
        recorder.dispatch(self.pipeline, self.bind, self.workgroups)
