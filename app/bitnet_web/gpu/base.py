"""The backend-neutral part of the GPU layer: limits, buffers, errors and the Device interface.

Two backends implement `Device`: `native.py` (wgpu-py in CPython) and `browser.py` (the page's
WebGPU through Pyodide's JS FFI). Everything above this package (kernels, model, engine) talks
only to this interface, so the same model code runs in both places.

WebGPU rules enforced here rather than in every caller:
- buffer sizes and copy ranges are multiples of 4 bytes;
- a buffer larger than the device's `maxBufferSize` cannot exist and a binding larger than
  `maxStorageBufferBindingSize` cannot be bound: callers split such tensors into shards
  (`shard_rows`), and `Device.buffer` refuses them with a message naming the tensor;
- every object is created once (pipelines, bind groups, uniforms); a decode step only records
  dispatches into one compute pass and submits once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntFlag
from typing import Any, Protocol

import numpy as np


class BufferUsage(IntFlag):
    """GPUBufferUsage bits, identical in WebGPU and wgpu-py (the backends pass them on as ints)."""

    MAP_READ = 0x0001
    COPY_SRC = 0x0004
    COPY_DST = 0x0008
    UNIFORM = 0x0040
    STORAGE = 0x0080


MAP_READ, COPY_SRC, COPY_DST = BufferUsage.MAP_READ, BufferUsage.COPY_SRC, BufferUsage.COPY_DST
UNIFORM, STORAGE = BufferUsage.UNIFORM, BufferUsage.STORAGE

STORAGE_USAGE = STORAGE | COPY_DST | COPY_SRC  # kernel inputs and outputs
UNIFORM_USAGE = UNIFORM | COPY_DST  # per-step parameters
READBACK_USAGE = MAP_READ | COPY_DST  # staging buffers the host maps


class GPUError(RuntimeError):
    """Any failure of the GPU layer, with the label of the object that failed."""


class GPUUnavailableError(GPUError):
    """No adapter, or an adapter without a feature or limit the engine needs."""


class GPUOutOfMemoryError(GPUError):
    """Buffer creation refused for lack of memory or because it exceeds a device limit."""


class GPUDeviceLostError(GPUError):
    """The device was lost (driver reset, tab backgrounded, device.destroy()); reload the model."""


@dataclass(frozen=True)
class GPULimits:
    max_storage_buffer_binding_size: int
    max_buffer_size: int
    max_compute_workgroup_storage_size: int
    max_compute_invocations_per_workgroup: int
    max_compute_workgroups_per_dimension: int
    min_storage_buffer_offset_alignment: int

    @property
    def max_binding(self) -> int:
        """Largest byte range one storage binding can cover (and so one buffer we create)."""
        return min(self.max_storage_buffer_binding_size, self.max_buffer_size)


@dataclass(eq=False)
class Buffer:
    """A GPU buffer: the backend's handle plus what we need to validate uses of it."""

    handle: Any
    nbytes: int
    label: str
    usage: int


@dataclass(eq=False)
class Pipeline:
    handle: Any
    label: str
    bind_group_layout: Any = field(repr=False, default=None)
    raw: Any = field(repr=False, default=None)  # backend's C handle, for its fast dispatch path


@dataclass(eq=False)
class BindGroup:
    handle: Any
    label: str
    buffers: tuple[Buffer, ...]
    raw: Any = field(repr=False, default=None)


def align4(nbytes: int) -> int:
    return (nbytes + 3) & ~3


def shard_rows(n_rows: int, row_bytes: int, max_bytes: int, row_multiple: int = 1) -> list[tuple[int, int]]:
    """Split `n_rows` rows of `row_bytes` each into [start, stop) ranges of at most `max_bytes`.

    `row_multiple` keeps shard boundaries on multiples of a kernel's row tile so no workgroup
    straddles two shards.
    """
    rows_per_shard = max_bytes // row_bytes
    rows_per_shard -= rows_per_shard % row_multiple
    if rows_per_shard <= 0:
        raise GPUOutOfMemoryError(
            f"one row of {row_bytes} bytes (x{row_multiple}) exceeds the binding limit of {max_bytes} bytes"
        )
    return [(start, min(start + rows_per_shard, n_rows)) for start in range(0, n_rows, rows_per_shard)]


class Recorder(Protocol):
    """Records one step's work: dispatches go into a single compute pass, copies end it.

    Backends subclass this protocol; the model builds its dispatch list once and calls `dispatch` in a
    tight loop, so the per-dispatch path must stay a few attribute-free calls.
    """

    def dispatch(self, pipeline: Pipeline, bind_group: BindGroup, x: int, y: int = 1, z: int = 1) -> None:
        raise NotImplementedError

    def copy(self, src: Buffer, src_offset: int, dst: Buffer, dst_offset: int, nbytes: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        """Close the command buffer now (its validation and resource tracking cost CPU time), so a
        later `submit` is only the queue call: the decode loop finishes step n+1 while step n runs."""
        raise NotImplementedError

    def submit(self) -> None:
        """Finish if needed, then queue the commands."""
        raise NotImplementedError


class Device(Protocol):
    """One logical GPU device. Created by `gpu.open_device()` / `await gpu.open_device_async()`.

    A protocol: the backends subclass it (and share its validation helpers and defaults); code above
    the GPU layer only relies on these members.
    """

    backend: str  # 'wgpu-native' or 'browser'
    adapter_name: str
    limits: GPULimits
    features: frozenset[str]  # normalized names: 'shader-f16', 'subgroups', 'timestamp-query', ...
    live_buffers: int
    bytes_allocated: int
    lost_reason: str | None = None  # None while usable; why it stopped being usable otherwise
    is_cpu: bool = False  # a software adapter (lavapipe, SwiftShader): kernels pick CPU-friendly variants
    # The smallest subgroup the adapter may run a kernel with, where it says (a browser's adapter.info);
    # None where unknown (wgpu-native reports a range that does not describe the GPU).
    subgroup_min_size: int | None = None
    # (decode steps per submit, submits in flight) for the model's GPU decode loop: what hides the
    # host's per-readback cost on this backend (docs/performance.md, "Chromium on an H100")
    decode_batching: tuple[int, int] = (1, 2)

    def buffer(self, nbytes: int, usage: int = STORAGE_USAGE, label: str = "") -> Buffer:
        raise NotImplementedError

    def upload(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        """Copy a C-contiguous numpy array (any dtype) into `buffer` at byte `offset`."""
        raise NotImplementedError

    def pipeline(self, wgsl: str, label: str, entry_point: str = "main") -> Pipeline:
        raise NotImplementedError

    def bind_group(self, pipeline: Pipeline, buffers: list[Buffer], label: str = "") -> BindGroup:
        """Bind `buffers` to @binding(0..n-1) of @group(0), each bound whole."""
        raise NotImplementedError

    def begin_pipeline_batch(self) -> None:
        """Pipelines made until `end_pipeline_batch` may be compiled together, in the background: their
        bind groups can be made at once, but nothing may be recorded with them before the batch ends.
        (Here: compiled one by one as they are made; the browser compiles a batch in parallel.)"""

    async def end_pipeline_batch(self) -> None:
        """Wait until every pipeline of the batch is compiled; raises GPUError naming one that failed."""

    def begin(self) -> Recorder:
        raise NotImplementedError

    async def read(self, buffer: Buffer, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
        """Copy `nbytes` of `buffer` back to the host as a uint8 array (waits for queued work)."""
        raise NotImplementedError

    def staging(self, nbytes: int, label: str) -> Buffer:
        """A small host-readable buffer: a step copies results into it, `read_staging` maps it.

        Keeping two and alternating lets the host read step n's result while step n+1 runs.
        """
        return self.buffer(nbytes, READBACK_USAGE, label)

    async def read_staging(self, staging: Buffer, nbytes: int) -> np.ndarray:
        """Wait for the work that last wrote `staging`, then copy its first `nbytes` out."""
        raise NotImplementedError

    def start_read(self, staging: Buffer) -> None:
        """Ask for `staging` to be read back now, right after the submit that writes it, before any
        later submit: a browser maps a buffer only once all work submitted before the request is done
        (WebGPU's queue timeline), so a request made after the next submit would wait for that one
        too, and the GPU would idle while the host catches up. `read_staging` then waits for it;
        `cancel_read` drops one nobody will wait for. (Here: nothing; read_staging maps.)"""

    def cancel_read(self, staging: Buffer) -> None:
        """Drop a read started by `start_read` that will not be awaited (a reply stopped early), so the
        buffer can be written again."""

    def release(self, buffer: Buffer) -> None:
        """Destroy `buffer` now (not at garbage collection) and account for it; releasing twice is a no-op."""
        if buffer.handle is None:
            return
        buffer.handle.destroy()
        buffer.handle = None
        self.live_buffers -= 1
        self.bytes_allocated -= buffer.nbytes

    async def checkpoint(self, what: str) -> None:
        """Raise any error the device reported since the last checkpoint (browser error scopes)."""

    def destroy(self) -> None:
        raise NotImplementedError

    # Shared helpers ----------------------------------------------------------------------------

    _readback: Buffer | None = None

    def _tracked(self, handle: Any, size: int, label: str, usage: int) -> Buffer:
        # The counterpart of `release`: every backend buffer is counted here.
        self.live_buffers += 1
        self.bytes_allocated += size
        return Buffer(handle, size, label, usage)

    def _readback_buffer(self, nbytes: int) -> Buffer:
        # One staging buffer for `read`, grown on demand: per-token reads create nothing.
        if self._readback is None or self._readback.nbytes < nbytes:
            if self._readback is not None:
                self.release(self._readback)
            self._readback = self.buffer(max(nbytes, 256), READBACK_USAGE, "readback staging")
        return self._readback

    def _check_buffer_size(self, nbytes: int, label: str) -> int:
        if nbytes <= 0:
            raise GPUError(f"buffer {label!r}: size must be positive, got {nbytes}")
        size = align4(nbytes)
        limit = self.limits.max_binding
        if size > limit:
            raise GPUOutOfMemoryError(
                f"buffer {label!r} needs {size} bytes but this device binds at most {limit} bytes "
                f"(maxStorageBufferBindingSize / maxBufferSize): it must be split into shards"
            )
        return size

    @staticmethod
    def _check_upload(buffer: Buffer, offset: int, data: np.ndarray) -> np.ndarray:
        data = np.ascontiguousarray(data)
        if offset % 4 or data.nbytes % 4:
            raise GPUError(f"upload to {buffer.label!r}: offset {offset} and size {data.nbytes} must be multiples of 4")
        if offset + data.nbytes > buffer.nbytes:
            raise GPUError(
                f"upload to {buffer.label!r}: {data.nbytes} bytes at offset {offset} overrun its {buffer.nbytes} bytes"
            )
        return data


def normalize_feature(name: str) -> str:
    # wgpu-py says 'subgroup', the browser 'subgroups'; keep the browser's spelling.
    return {"subgroup": "subgroups"}.get(name, name)
