"""Steps chained on the GPU inside one submit (step_advance.wgsl): each step's last dispatch logs what
the host reads of it and advances StepParams, so the steps of a submit need no buffer copies between
them (a copy ends the compute pass and waits on both sides of it)."""

from __future__ import annotations

from .. import gpu
from .common import KernelCache, StepParams


class StepAdvance:
    """The end of a decode step: token_log[slot] = ids[0]; StepParams.pos += 1; StepParams.slot += 1.

    The host writes a submit's first StepParams with `StepParams.write(..., slot=0)`, records this
    after each step's token choice, and `copy_log` after the last step."""

    def __init__(self, kernels: KernelCache, ids: gpu.Buffer, step: StepParams, slots: int, label: str = "step"):
        self._build(kernels, [ids], step, slots, 1, (), {}, label)

    def _build(
        self,
        kernels: KernelCache,
        inputs: list[gpu.Buffer],
        step: StepParams,
        slots: int,
        words: int,
        defines: tuple[str, ...],
        constants: dict[str, int],
        label: str,
    ) -> None:
        device = kernels.device
        self.words = words  # logged per step
        self.log = device.buffer(4 * slots * words, gpu.STORAGE | gpu.COPY_SRC, f"{label} log")  # (slots, words) u32
        self.pipeline = kernels.pipeline("step_advance", defines=defines, SLOTS=slots, **constants)
        self.bind = device.bind_group(self.pipeline, [*inputs, step.buffer, self.log], f"{label} advance")

    def record(self, recorder: gpu.Recorder) -> None:
        recorder.dispatch(self.pipeline, self.bind, 1)

    def copy_log(self, recorder: gpu.Recorder, staging: gpu.Buffer, steps: int) -> None:
        """The words of steps 0 .. steps-1 to the start of `staging`."""
        recorder.copy(self.log, 0, staging, 0, 4 * self.words * steps)

    def release(self, device: gpu.Device) -> None:
        device.release(self.log)


class VerifyStepLog(StepAdvance):
    """The end of a speculative step (verify or draft-off) with drafts of up to `k` tokens:
    token_log[slot] = (out[0 .. k + 2), state[0]): n_emitted, the emitted tokens, the draft length;
    StepParams.slot += 1 (the next step's draft kernel sets its other fields). The host resets the
    slot with `StepParams.reset_slot()` before a submit."""

    def __init__(
        self,
        kernels: KernelCache,
        out: gpu.Buffer,
        state: gpu.Buffer,
        step: StepParams,
        k: int,
        slots: int,
        label: str = "verify step",
    ):
        self._build(kernels, [out, state], step, slots, k + 3, ("VERIFY",), {"K": k}, label)
