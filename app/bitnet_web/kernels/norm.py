"""RMSNorm ops: `RMSNormQuant` (norm + int8 quantization feeding a BitLinear) and `RMSNorm` (f32 out).

Quantized activations, shared with `linear.TernaryLinear`:
    x_q      (max_tokens, width/4) u32: four int8 per word, value 4i+e in byte e
    x_scale  (max_tokens,) f32: 1/s with s = 127 / max(absmax(y), 1e-5), so y ~ x_q * x_scale
Rows are packed with the op's own width as stride, so one buffer sized for the widest
activation serves every width.
"""

from __future__ import annotations

from .. import gpu
from .common import STEP_PARAMS_WGSL, KernelCache, StepParams, ceil_div, subgroups_available, wgsl_enables

NORM_WORKGROUP = 256  # threads per row: 2560 wide rows give each thread 2.5 vec4 items


class NormShapeError(ValueError):
    """A norm op was built with a width or buffer that cannot hold the rows it must process."""


def _check_rows(buffer: gpu.Buffer, row_bytes: int, what: str, op: str) -> int:
    """How many rows of `row_bytes` fit in `buffer` (at least one, or a clear error)."""
    if buffer.nbytes < row_bytes:
        raise NormShapeError(
            f"{op}: {what} buffer {buffer.label!r} has {buffer.nbytes} bytes, less than one row of {row_bytes} bytes"
        )
    return buffer.nbytes // row_bytes


def _norm_constants(width: int, eps: float, op: str, mean_width: int | None = None) -> dict[str, object]:
    """Shader constants; `mean_width` (default `width`) divides the sum of squares: a row padded with
    zeros past the model's true width keeps the true width's mean."""
    if width <= 0 or width % 4:
        raise NormShapeError(f"{op}: width must be a positive multiple of 4, got {width}")
    mean_width = width if mean_width is None else mean_width
    if not 0 < mean_width <= width:
        raise NormShapeError(f"{op}: mean_width must be in 1..{width}, got {mean_width}")
    w4 = width // 4
    return {
        "STEP_PARAMS": STEP_PARAMS_WGSL,
        "W4": w4,
        "WG": NORM_WORKGROUP,
        "ITEMS": ceil_div(w4, NORM_WORKGROUP),
        "EPS": float(eps),
        "W_F": float(mean_width),
    }


class RMSNormQuant:
    """x (T, width) f32 [-> RMSNorm with `weight`] -> x_q (T, width/4) u32 + x_scale (T,) f32.

    `weight=None` quantizes without normalizing (models without sub-norms). `mean_width`: the
    model's true width when rows are zero-padded to `width` (the mean of squares is over it).
    Dispatch: one workgroup per token row.
    """

    def __init__(
        self,
        kernels: KernelCache,
        x: gpu.Buffer,
        weight: gpu.Buffer | None,
        x_q: gpu.Buffer,
        x_scale: gpu.Buffer,
        step: StepParams,
        width: int,
        eps: float,
        label: str = "rmsnorm_quant",
        mean_width: int | None = None,
    ):
        op = f"RMSNormQuant {label!r}"
        constants = _norm_constants(width, eps, op, mean_width)
        self.width = width
        self.max_tokens = min(
            _check_rows(x, 4 * width, "x", op),
            _check_rows(x_q, width, "x_q", op),
            _check_rows(x_scale, 4, "x_scale", op),
        )
        if weight is not None and weight.nbytes < 4 * width:
            raise NormShapeError(
                f"{op}: norm weight {weight.label!r} has {weight.nbytes} bytes, expected {4 * width} ({width} f32)"
            )
        device = kernels.device
        subgroups = subgroups_available(device)
        defines = (("SUBGROUPS",) if subgroups else ()) + (("NORMALIZE", "HAS_WEIGHT") if weight is not None else ())
        self.pipeline = kernels.pipeline(
            "rmsnorm_quant", enables=wgsl_enables(device, subgroups=subgroups), defines=defines, **constants
        )
        buffers = [step.buffer, x] + ([weight] if weight is not None else []) + [x_q, x_scale]
        self.bind_group = device.bind_group(self.pipeline, buffers, label)

    def record(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        recorder.dispatch(self.pipeline, self.bind_group, n_tokens)


class RMSNorm:
    """x (T, width) f32 -> y (T, width) f32 = x / rms(x) * weight.

    `mean_width` as in RMSNormQuant. `record(..., last_only=True)` normalizes only row n_tokens-1 (read
    from StepParams) into row 0 of `y`, which is what the LM head needs when only the next token's logits are wanted.
    `digits=(digits, stats)`: buffers for the normed rows as two int8 digits ([rows, 2, width/4] u32)
    and their scales and norms ([rows, 4] f32), written by `record(..., digits=True)`: for the last row
    into row 0 with `last_only` (a decode step), else for every row (a verify step's; as many rows as
    the buffers hold). The screened head's input (kernels/head_screen.py; shaders/rmsnorm.wgsl DIGITS).
    """

    def __init__(
        self,
        kernels: KernelCache,
        x: gpu.Buffer,
        weight: gpu.Buffer,
        y: gpu.Buffer,
        step: StepParams,
        width: int,
        eps: float,
        label: str = "rmsnorm",
        mean_width: int | None = None,
        digits: tuple[gpu.Buffer, gpu.Buffer] | None = None,
    ):
        op = f"RMSNorm {label!r}"
        constants = _norm_constants(width, eps, op, mean_width)
        self.width = width
        self.max_tokens = min(_check_rows(x, 4 * width, "x", op), _check_rows(y, 4 * width, "y", op))
        if weight.nbytes < 4 * width:
            raise NormShapeError(
                f"{op}: norm weight {weight.label!r} has {weight.nbytes} bytes, expected {4 * width} ({width} f32)"
            )
        device = kernels.device
        subgroups = subgroups_available(device)
        enables = wgsl_enables(device, subgroups=subgroups)
        base = ("SUBGROUPS",) if subgroups else ()
        buffers = [step.buffer, x, weight, y]
        self.pipeline_all = kernels.pipeline("rmsnorm", enables=enables, defines=base, **constants)
        self.pipeline_last = kernels.pipeline("rmsnorm", enables=enables, defines=base + ("LAST_ONLY",), **constants)
        self.bind_group_all = device.bind_group(self.pipeline_all, buffers, label)
        self.bind_group_last = device.bind_group(self.pipeline_last, buffers, label + " (last row)")
        self.digits_op: tuple[gpu.Pipeline, gpu.BindGroup] | None = None
        self.digits_all_op: tuple[gpu.Pipeline, gpu.BindGroup] | None = None
        self.digit_rows = 0
        if digits is not None:
            self.digit_rows = min(digits[0].nbytes // (2 * width), digits[1].nbytes // 16)
            if self.digit_rows < 1:
                raise NormShapeError(
                    f"{op}: digit buffers of {digits[0].nbytes} and {digits[1].nbytes} bytes, expected "
                    f"at least {2 * width} and 16"
                )
            for rows, ops in (("LAST_ONLY",), "digits_op"), ((), "digits_all_op"):
                with_digits = kernels.pipeline(
                    "rmsnorm", enables=enables, defines=base + rows + ("DIGITS",), **constants
                )
                bind = device.bind_group(
                    with_digits, buffers + list(digits), f"{label} (digits{', last row' * bool(rows)})"
                )
                setattr(self, ops, (with_digits, bind))

    def record(self, recorder: gpu.Recorder, n_tokens: int, last_only: bool = False, digits: bool = False) -> None:
        if digits:
            if self.digits_op is None:
                raise ValueError(f"{self.pipeline_last.label}: digits need digit buffers")
            if last_only:
                recorder.dispatch(*self.digits_op, 1)
                return
            if n_tokens > self.digit_rows:
                raise ValueError(
                    f"{self.pipeline_all.label}: digits for {n_tokens} rows, buffers for {self.digit_rows}"
                )
            recorder.dispatch(*self.digits_all_op, n_tokens)
        elif last_only:
            recorder.dispatch(self.pipeline_last, self.bind_group_last, 1)
        else:
            recorder.dispatch(self.pipeline_all, self.bind_group_all, n_tokens)
