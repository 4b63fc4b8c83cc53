"""Ternary BitLinear on the GPU: weight upload (`TernaryMatrix`) and the op (`TernaryLinear`).

Weights stay in the GGUF's I2_S x86 layout (2-bit codes, 128 values per 32 bytes; codes 0, 1, 2 =
-1, 0, +1): a fused matrix is its tensors' packed rows concatenated (QKV, gate+up), with one f32
scale per row because each tensor keeps its own scale. No row is permuted: the gated epilogues
read gate row i and up row N/2 + i, so `pair_rows` only checks that the halves match.

    y[t, n] = scale[n] * x_scale[t] * sum_k value[n, k] * x_q[t, k]     (see norm.py for x_q, x_scale)

Decode (one token) runs `ternary_gemv.wgsl`: ROWS rows per workgroup, 16-byte weight loads,
dot4I8Packed, subgroupAdd when present; `NormTernaryLinear` folds the input RMSNorm + quantization
into it (`ternary_gemv_norm.wgsl`, what the model uses). 2..SMALL_T_MAX rows (speculative verify
steps) take one of the paths of SMALL_T_PATH (the fused kernel with one workgroup row per token, or
for long drafts on large matrices its norm and quantization alone then the decode GEMV per row: either
way each row rounds exactly as its decode step; `ternary_gemv_rows.wgsl` holds the weights in registers
for all rows). Longer prefill runs `ternary_gemm.wgsl`,
which stages a tile of weight rows (decoded once to signed int8) and token rows in workgroup memory
and reuses each weight word TT times. Measurements: docs/performance-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import gpu
from ..formats.ggml import I2S_BLOCK, I2S_TAIL_BYTES
from .common import (
    SMALL_T_MAX,
    STEP_PARAMS_WGSL,
    KernelCache,
    StepParams,
    ceil_div,
    packed_dot_available,
    subgroups_available,
    wgsl_enables,
)
from .norm import RMSNormQuant

EPILOGUES = {"store": 0, "residual": 1, "gate_relu2": 2, "gate_silu": 3}

# Decode GEMV: accumulators (rows) per workgroup and threads per workgroup (by K).
GEMV_ROWS = 8

# Weight rows per workgroup of the 2..SMALL_T_MAX-row GEMV (`ternary_gemv_rows.wgsl`), which keeps
# them in registers for all token rows (TOK x ROWS accumulators).
ROWS_GEMV_ROWS = 8


def gemv_workgroup(k: int) -> int:
    """Threads per GEMV workgroup: enough 16-byte chunks per thread to cover a row in few passes.
    K=2560 has 40 chunks per row (64 threads), K=6912 has 108 (128 threads)."""
    chunks = k // 64
    return 32 if chunks <= 32 else 64 if chunks <= 64 else 128


# Prefill GEMM tile: TX*TY threads, each MR rows x MT tokens -> 64 rows x 32 tokens per workgroup,
# KB 128-value blocks of K staged per barrier pair (13.8 KB of workgroup memory: under WebGPU's 16 KB
# default). No tiling measured faster (docs/performance.md); `gemm_tile=` overrides it (tests, tools).
GEMM_TILE = {"TX": 16, "TY": 8, "MR": 4, "MT": 4, "KB": 1}


def gemm_workgroup_bytes(tile: dict[str, int]) -> int:
    """Workgroup memory of a GEMM tiling: staged rows and tokens, 8 * KB + 1 vec4 each."""
    rows, tokens = tile["TX"] * tile["MR"], tile["TY"] * tile["MT"]
    return (rows + tokens) * (8 * tile["KB"] + 1) * 16


class TernaryShapeError(ValueError):
    """A ternary tensor or a TernaryLinear binding has a shape the kernels cannot handle."""


def pack_ternary_rows(raw_tensors: list[tuple[np.ndarray, int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate GGUF I2_S tensors (raw bytes incl. trailer, n_rows, n_cols) by rows.

    Returns (packed codes, uint8 [sum(n_rows) * n_cols / 4], without trailers) and the per-row
    scales (float32 [sum(n_rows)]): each tensor's trailer scale repeated over its rows. The tensors
    must share n_cols (a multiple of 128, so no block spans two rows).
    """
    if not raw_tensors:
        raise TernaryShapeError("pack_ternary_rows: no tensors given")
    n_cols = raw_tensors[0][2]
    codes, scales = [], []
    for i, (raw, n_rows, cols) in enumerate(raw_tensors):
        where = f"ternary tensor #{i} ({n_rows} x {cols})"
        if cols != n_cols:
            raise TernaryShapeError(f"{where}: all fused tensors need {n_cols} columns")
        if cols <= 0 or cols % I2S_BLOCK or n_rows <= 0:
            raise TernaryShapeError(f"{where}: columns must be a positive multiple of {I2S_BLOCK}")
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim != 1:
            raise TernaryShapeError(f"{where}: raw bytes must be a 1-D uint8 array, got {raw.dtype} {raw.shape}")
        n_code_bytes = n_rows * cols // 4
        if raw.size != n_code_bytes + I2S_TAIL_BYTES:
            raise TernaryShapeError(
                f"{where}: {raw.size} bytes, expected {n_code_bytes + I2S_TAIL_BYTES} "
                f"(n/4 code bytes + {I2S_TAIL_BYTES}-byte scale trailer)"
            )
        scale = float(raw[n_code_bytes : n_code_bytes + 4].view("<f4")[0])
        if not np.isfinite(scale):
            raise TernaryShapeError(f"{where}: the scale at byte {n_code_bytes} is {scale}")
        codes.append(raw[:n_code_bytes])
        scales.append(np.full(n_rows, scale, dtype=np.float32))
    return np.concatenate(codes), np.concatenate(scales)


@dataclass
class TernaryMatrix:
    """A (possibly fused) ternary weight matrix on the GPU.

    codes:  (n_rows, n_cols/4) bytes of I2_S codes, read as vec4<u32> (16 bytes = 64 values)
    scales: (n_rows,) f32 per-row weight scale
    """

    codes: gpu.Buffer
    scales: gpu.Buffer
    n_rows: int
    n_cols: int
    part_rows: tuple[int, ...]  # rows of each fused tensor, in order
    paired: bool  # gate rows [0, n/2) + up rows [n/2, n) for the gated epilogues
    label: str

    @classmethod
    def upload(
        cls,
        device: gpu.Device,
        parts: list[tuple[np.ndarray, float, tuple[int, int]]],
        label: str,
        pair_rows: bool = False,
    ) -> TernaryMatrix:
        """Upload tensors given as (packed codes uint8 [n*k/4] without trailer, scale, shape (n, k)),
        concatenated by rows. `pair_rows`: exactly two tensors of one shape (gate, then up)."""
        if not parts:
            raise TernaryShapeError(f"{label}: no tensors given")
        n_cols = int(parts[0][2][1])
        part_rows = []
        for i, (codes, _, shape) in enumerate(parts):
            n, k = (int(d) for d in shape)
            if k != n_cols or k <= 0 or k % I2S_BLOCK or n <= 0:
                raise TernaryShapeError(
                    f"{label}: tensor #{i} has shape {shape}; fused tensors need the same "
                    f"column count, a positive multiple of {I2S_BLOCK}"
                )
            if np.asarray(codes).size != n * k // 4:
                raise TernaryShapeError(
                    f"{label}: tensor #{i} {shape} has {np.asarray(codes).size} code bytes, expected {n * k // 4}"
                )
            part_rows.append(n)
        if pair_rows and (len(parts) != 2 or part_rows[0] != part_rows[1]):
            raise TernaryShapeError(
                f"{label}: pair_rows needs two tensors of equal shape (gate, up), got rows {part_rows}"
            )
        n_rows = sum(part_rows)
        codes_buf = device.buffer(n_rows * n_cols // 4, label=f"{label} codes")
        offset = 0
        for codes, _, _ in parts:
            codes = np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)
            device.upload(codes_buf, offset, codes)
            offset += codes.size
        scales = np.concatenate(
            [np.full(n, s, dtype=np.float32) for n, (_, s, _) in zip(part_rows, parts, strict=True)]
        )
        scales_buf = device.buffer(scales.nbytes, label=f"{label} scales")
        device.upload(scales_buf, 0, scales)
        return cls(codes_buf, scales_buf, n_rows, n_cols, tuple(part_rows), pair_rows, label)

    @classmethod
    def from_i2s(
        cls, device: gpu.Device, raw_tensors: list[tuple[np.ndarray, int, int]], label: str, pair_rows: bool = False
    ) -> TernaryMatrix:
        """Upload GGUF I2_S tensors given as (raw bytes incl. trailer, n_rows, n_cols)."""
        codes, scales = pack_ternary_rows(raw_tensors)
        parts, offset = [], 0
        for _, n, k in raw_tensors:
            parts.append((codes[offset : offset + n * k // 4], float(scales[offset * 4 // k]), (n, k)))
            offset += n * k // 4
        return cls.upload(device, parts, label, pair_rows)

    def release(self, device: gpu.Device) -> None:
        device.release(self.codes)
        device.release(self.scales)


class TernaryLinear:
    """out (T, N or N/2) <- epilogue(W_ternary @ x_q), see the module docstring.

    Epilogues: 'store' (out = y), 'residual' (out += y), 'gate_relu2' / 'gate_silu'
    (out[:, i] = act(y[:, i]) * y[:, N/2 + i], for a `pair_rows` matrix).
    `record(recorder, n_tokens)`: the GEMV for one token, the tiled GEMM for more; for n_tokens > 1
    the GEMM bounds rows by StepParams.n_tokens, which must equal n_tokens.
    """

    def __init__(
        self,
        kernels: KernelCache,
        weights: TernaryMatrix,
        x_q: gpu.Buffer,
        x_scale: gpu.Buffer,
        out: gpu.Buffer,
        step: StepParams,
        epilogue: str = "store",
        label: str | None = None,
        use_dot4: bool | None = None,
        gemv_rows: int = GEMV_ROWS,
        gemv_workgroup_size: int | None = None,
        gemm_tile: dict[str, int] | None = None,
        rows_gemv_rows: int = ROWS_GEMV_ROWS,
    ):
        label = label or f"{weights.label} {epilogue}"
        op = f"TernaryLinear {label!r}"
        if epilogue not in EPILOGUES:
            raise TernaryShapeError(f"{op}: unknown epilogue {epilogue!r}; expected one of {sorted(EPILOGUES)}")
        gated = EPILOGUES[epilogue] >= 2
        n, k = weights.n_rows, weights.n_cols
        if gated and not weights.paired:
            raise TernaryShapeError(f"{op}: epilogue {epilogue!r} needs a gate/up matrix uploaded with pair_rows=True")
        if gemv_rows % 2 or gemv_rows <= 0:
            raise TernaryShapeError(f"{op}: gemv_rows must be a positive even number, got {gemv_rows}")
        out_w = n // 2 if gated else n
        self.n_rows, self.n_cols, self.out_width, self.epilogue = n, k, out_w, epilogue
        self.max_tokens = min(x_q.nbytes // k, x_scale.nbytes // 4, out.nbytes // (4 * out_w))
        if self.max_tokens < 1:
            raise TernaryShapeError(
                f"{op}: buffers too small for one token: x_q {x_q.nbytes} bytes (needs {k}), "
                f"x_scale {x_scale.nbytes} (needs 4), out {out.nbytes} (needs {4 * out_w})"
            )
        device = kernels.device
        limit = device.limits.max_compute_workgroups_per_dimension
        subgroups = subgroups_available(device)
        enables = wgsl_enables(device, subgroups=subgroups)
        if use_dot4 is None:
            use_dot4 = packed_dot_available(device)
        dot = ("DOT4",) if use_dot4 else ()

        wg = gemv_workgroup_size or gemv_workgroup(k)
        if wg > device.limits.max_compute_invocations_per_workgroup:
            raise TernaryShapeError(
                f"{op}: {wg} threads per workgroup, over the device's "
                f"{device.limits.max_compute_invocations_per_workgroup}"
            )
        if wg < gemv_rows:
            raise TernaryShapeError(
                f"{op}: the GEMV workgroup ({wg} threads) must have at least gemv_rows ({gemv_rows}) threads"
            )
        outs = gemv_rows // 2 if gated else gemv_rows
        self.gemv_groups = ceil_div(out_w, outs)
        self.gemv = kernels.pipeline(
            "ternary_gemv",
            enables=enables,
            defines=dot + (("SUBGROUPS",) if subgroups else ()),
            K=k,
            N=n,
            ROWS=gemv_rows,
            WG=wg,
            ITERS=ceil_div(k // 64, wg),
            EPILOGUE=EPILOGUES[epilogue],
        )
        self.gemv_bind = device.bind_group(
            self.gemv, [weights.codes, weights.scales, x_q, x_scale, out], f"{label} gemv"
        )
        # ternary_gemv_rows: one pipeline per row count, built on first use (KernelCache shares it by shape)
        if rows_gemv_rows % 2 or rows_gemv_rows <= 0 or wg < rows_gemv_rows:
            raise TernaryShapeError(
                f"{op}: rows_gemv_rows must be a positive even number <= {wg} threads, got {rows_gemv_rows}"
            )
        self._rows_constants = dict(
            enables=enables,
            defines=dot + (("SUBGROUPS",) if subgroups else ()),
            K=k,
            N=n,
            ROWS=rows_gemv_rows,
            WG=wg,
            ITERS=ceil_div(k // 64, wg),
            EPILOGUE=EPILOGUES[epilogue],
        )
        self._rows_buffers = [weights.codes, weights.scales, x_q, x_scale, out]
        self._rows: dict[int, tuple[gpu.Pipeline, gpu.BindGroup]] = {}
        self.rows_groups = ceil_div(out_w, rows_gemv_rows // 2 if gated else rows_gemv_rows)
        self._kernels, self._label = kernels, label
        self._gemv_rows, self._step = gemv_rows, step
        self._gemv_bounded: tuple[gpu.Pipeline, gpu.BindGroup] | None = None

        tile = {**GEMM_TILE, **(gemm_tile or {})}
        rt, tt, kb = tile["TX"] * tile["MR"], tile["TY"] * tile["MT"], tile["KB"]
        if tile["MR"] % 2:
            raise TernaryShapeError(f"{op}: GEMM tile MR must be even (gate/up pairs), got {tile['MR']}")
        if kb <= 0 or (k // I2S_BLOCK) % kb:
            raise TernaryShapeError(f"{op}: GEMM tile KB={kb} must divide the {k // I2S_BLOCK} blocks of K={k}")
        room = device.limits.max_compute_workgroup_storage_size
        gemm_bytes = gemm_workgroup_bytes(tile)
        if gemm_bytes > room or tile["TX"] * tile["TY"] > device.limits.max_compute_invocations_per_workgroup:
            raise TernaryShapeError(
                f"{op}: GEMM tile {tile} needs {gemm_bytes} bytes of workgroup memory and "
                f"{tile['TX'] * tile['TY']} threads, over this device's limits"
            )
        self.gemm_groups = ceil_div(out_w, rt // 2 if gated else rt)
        self.gemm_token_tile = tt
        threads = tile["TX"] * tile["TY"]
        self.gemm = kernels.pipeline(
            "ternary_gemm",
            defines=dot,
            STEP_PARAMS=STEP_PARAMS_WGSL,
            K=k,
            N=n,
            EPILOGUE=EPILOGUES[epilogue],
            MRH=tile["MR"] // 2,
            SV=8 * kb,
            W_ITEMS=ceil_div(rt * 2 * kb, threads),
            X_ITEMS=ceil_div(tt * 8 * kb, threads),
            **tile,
        )
        self.gemm_bind = device.bind_group(
            self.gemm, [step.buffer, weights.codes, weights.scales, x_q, x_scale, out], f"{label} gemm"
        )
        if max(self.gemv_groups, self.gemm_groups) > limit:
            raise TernaryShapeError(
                f"{op}: {n} rows need {self.gemv_groups} workgroups, over the device limit of {limit} per dimension"
            )

    def record(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        if n_tokens == 1:
            recorder.dispatch(self.gemv, self.gemv_bind, self.gemv_groups)
        else:
            recorder.dispatch(self.gemm, self.gemm_bind, self.gemm_groups, ceil_div(n_tokens, self.gemm_token_tile))

    def record_gemv(self, recorder: gpu.Recorder, n_tokens: int, bounded: bool = False) -> None:
        """The GEMV for each of `n_tokens` rows independently; `bounded`: rows from StepParams.n_tokens
        on leave at once (a verify step's rows past its draft)."""
        pipeline, bind = self.gemv_bounded() if bounded else (self.gemv, self.gemv_bind)
        recorder.dispatch(pipeline, bind, self.gemv_groups, n_tokens)

    def gemv_bounded(self) -> tuple[gpu.Pipeline, gpu.BindGroup]:
        """The GEMV that reads StepParams.n_tokens (built on first use)."""
        if self._gemv_bounded is None:
            constants = self._rows_constants
            pipeline = self._kernels.pipeline(
                "ternary_gemv",
                **{**constants, "ROWS": self._gemv_rows, "defines": constants["defines"] + ("BOUNDED",)},
                STEP_PARAMS=STEP_PARAMS_WGSL,
            )
            bind = self._kernels.device.bind_group(
                pipeline, [*self._rows_buffers, self._step.buffer], f"{self._label} gemv (bounded)"
            )
            self._gemv_bounded = (pipeline, bind)
        return self._gemv_bounded

    def record_rows(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        """`ternary_gemv_rows`: all `n_tokens` rows (1..SMALL_T_MAX) in each workgroup, every weight
        read once for all of them."""
        if not 1 <= n_tokens <= min(SMALL_T_MAX, self.max_tokens):
            raise TernaryShapeError(
                f"TernaryLinear {self._label!r}: record_rows takes 1..{min(SMALL_T_MAX, self.max_tokens)} rows, "
                f"got {n_tokens}"
            )
        found = self._rows.get(n_tokens)
        if found is None:
            pipeline = self._kernels.pipeline("ternary_gemv_rows", TOK=n_tokens, **self._rows_constants)
            bind = self._kernels.device.bind_group(pipeline, self._rows_buffers, f"{self._label} rows T={n_tokens}")
            found = self._rows[n_tokens] = (pipeline, bind)
        recorder.dispatch(found[0], found[1], self.rows_groups)


# Fused GEMV with its input norm: weight rows per row group, for one token row (decode) and for the 2..
# SMALL_T_MAX rows of a verify step alike. Every workgroup redoes the norm of its input row (reading it
# from L2): more rows per workgroup amortize that, fewer spread the dot products over more workgroups.
# Whole 2B-4T steps were fastest with 8 for matrices of up to NORM_GEMV_SMALL_WEIGHTS weights (qkv, wo)
# and 16 for larger ones (gate_up, down): verify steps on the H100 (session 13), decode steps on the
# H200 (2.8% shorter than with 8, session 27; 32 was slower; `tools/bench_kernels.py --gemv-sweep`,
# docs/performance.md). The row count leaves the norm's arithmetic alone (it depends on the row groups
# and threads only), so a verify row still computes bit for bit what its decode step does.
NORM_GEMV_ROWS = 8
NORM_GEMV_LARGE_ROWS = 16
NORM_GEMV_SMALL_WEIGHTS = 10_000_000


def norm_gemv_rows(n_rows: int, n_cols: int) -> int:
    """Weight rows per row group of the fused GEMV for an n_rows x n_cols matrix."""
    return NORM_GEMV_ROWS if n_rows * n_cols <= NORM_GEMV_SMALL_WEIGHTS else NORM_GEMV_LARGE_ROWS


# How NormTernaryLinear runs 2..SMALL_T_MAX rows (a speculative verify step) on a GPU; read when an
# op is built. "fused": the fused decode kernel with one workgroup row per token (every workgroup
# normalizes its row again). "split": the same kernel's norm and quantization alone, once per row
# (QUANT_ONLY), then the plain GEMV per row. "rows": RMSNormQuant once, then ternary_gemv_rows (each
# weight read once for all rows; benchmarks only: its norm rounds differently from a decode step's).
# Fused and split compute every row bit for bit as its decode step (split's quantization is the fused
# kernel's own code, and ternary_gemv.wgsl scales the exact integer sums by the same factors in the
# same order), which speculative greedy output needs to equal plain decoding. Split's rows cost less
# (no norm per workgroup) but its norm dispatches cost a step ~0.4 ms on 2B-4T whatever the draft, so
# "auto" takes it only for matrices of at least SPLIT_MIN_WEIGHTS weights (a small model's steps are
# dispatch-bound; split, 2B-4T's 6.5M-weight wo costs verify steps of 4-5 rows 1-3% more and of 7 rows
# the same: docs/performance.md "Session 23") when the rows expected live (all rows of a forward pass;
# for a verify step, its caller's estimate of draft + 1) are at least SPLIT_MIN_LIVE_ROWS of the device's
# backend: where the two cost the same on 2B-4T (docs/performance.md "Session 17";
# `tools/bench_kernels.py --verify-steps --paths ... [--padded K]`). In Chromium every dispatch costs
# the page more, so the split path pays from 7 rows there (H200: verify steps of 4 rows 1.74-1.84 decode
# steps fused against 2.40-2.53 split, of 7 rows 2.76-2.87 against 2.65-2.72; docs/performance.md
# "Session 18"; the bench page's `smallt=`).
SMALL_T_PATHS = ("auto", "fused", "split", "rows")
SMALL_T_PATH = "auto"
SPLIT_MIN_LIVE_ROWS = {"wgpu-native": 3.8, "browser": 6.5}
SPLIT_MIN_WEIGHTS = 8_000_000


def split_min_live_rows(device: gpu.Device) -> float:
    """The rows a verify step must be expected to keep for "auto" to take the split path on `device`."""
    return SPLIT_MIN_LIVE_ROWS.get(device.backend, SPLIT_MIN_LIVE_ROWS["wgpu-native"])


def norm_gemv_row_groups(n_rows: int, group_threads: int = 64) -> int:
    """Row groups per fused workgroup (H100, run 23: 2 for qkv / wo / down, 4 for the 13824-row gate_up;
    one group was 13-40% slower); 4 for row groups of 32 threads, so a workgroup keeps 128."""
    return 4 if n_rows >= 8192 or group_threads <= 32 else 2


def norm_gemv_group_threads(n_cols: int) -> int:
    """Threads per row group of the fused GEMV: one per 16-byte chunk of a weight row (n_cols / 64), in
    whole subgroups of 32, at least 64 for rows of more than 2048 values. Shorter rows take 32: the
    bundled model (rows of 512 and 1536) used 8 or 24 of 64 threads; with 32 in four row groups its
    whole steps were 9% shorter and verify steps of 7 rows 17% (H200, docs/performance.md "Session 15").
    A device whose subgroups are wider than 32 sums per thread instead (correct, slower)."""
    chunks = n_cols // 64
    return 32 if chunks <= 32 else max(64, ceil_div(chunks, 32) * 32)


class NormTernaryLinear:
    """RMSNorm(x) (or quantize-only with `norm_weight=None`) -> BitLinear -> epilogue, as one op.

    Decode (n_tokens == 1): one dispatch of `ternary_gemv_norm.wgsl`, in which every workgroup
    normalizes and quantizes the input row itself (no rmsnorm_quant dispatch, no x_q round trip).
    2..SMALL_T_MAX rows (a speculative verify step): SMALL_T_PATH, by default this same kernel with
    one workgroup row per token, or for long drafts on large matrices the kernel's norm and
    quantization once per row (QUANT_ONLY) and the decode GEMV per row: bit for bit what each row's
    decode step computes either way. The workgroups sharing weight rows run close together, so each
    weight comes from memory once and the other rows' reads mostly hit L2 (docs/performance.md).
    Longer prefill: `RMSNormQuant` into x_q / x_scale, then the tiled GEMM, as the two ops would.
    Constructor arguments are those of RMSNormQuant and TernaryLinear together; `rows` weight rows
    per row group for one token row and `verify_rows` for more (both by default `norm_gemv_rows`),
    `row_groups` (1, 2 or 4; default by size) groups per workgroup, `workgroup_size`
    threads per group, `mean_width` the true width of zero-padded input rows (see RMSNormQuant).
    """

    def __init__(
        self,
        kernels: KernelCache,
        x: gpu.Buffer,
        norm_weight: gpu.Buffer | None,
        eps: float,
        weights: TernaryMatrix,
        x_q: gpu.Buffer,
        x_scale: gpu.Buffer,
        out: gpu.Buffer,
        step: StepParams,
        epilogue: str = "store",
        label: str | None = None,
        use_dot4: bool | None = None,
        rows: int | None = None,
        workgroup_size: int | None = None,
        row_groups: int | None = None,
        mean_width: int | None = None,
        verify_rows: int | None = None,
    ):
        label = label or f"{weights.label} {epilogue} (normed input)"
        op = f"NormTernaryLinear {label!r}"
        k = weights.n_cols
        mean_width = k if mean_width is None else mean_width
        chunks = k // 64
        gw = workgroup_size or norm_gemv_group_threads(k)
        row_groups = row_groups or norm_gemv_row_groups(weights.n_rows, gw)
        self.norm = RMSNormQuant(kernels, x, norm_weight, x_q, x_scale, step, k, eps, f"{label} norm", mean_width)
        self.linear = TernaryLinear(kernels, weights, x_q, x_scale, out, step, epilogue, label, use_dot4=use_dot4)
        if x.nbytes < 4 * k:
            raise TernaryShapeError(f"{op}: x ({x.nbytes} bytes) holds less than one row of {k} f32")
        default_rows = norm_gemv_rows(weights.n_rows, k)
        rows, verify_rows = rows or default_rows, verify_rows or default_rows
        for r in (rows, verify_rows):
            if gw < chunks or gw < r or r % 2 or r <= 0 or row_groups not in (1, 2, 4):
                raise TernaryShapeError(
                    f"{op}: needs an even rows ({r}) <= threads per row group ({gw}), at least "
                    f"K/64 = {chunks} threads per row group and row_groups in 1, 2, 4 (got "
                    f"{row_groups})"
                )
        if gw & (gw - 1) and not subgroups_available(kernels.device):
            gw = 1 << (gw - 1).bit_length()  # the tree reduction without subgroups needs a power of two
        wg = gw * row_groups
        limits = kernels.device.limits
        # two reduction slots per thread, accumulators, two flags, the shared quantized row
        workgroup_bytes = 8 * wg + 4 * max(rows, verify_rows) * row_groups + 8 + (k if row_groups > 1 else 0)
        too_big = workgroup_bytes > limits.max_compute_workgroup_storage_size
        if wg > limits.max_compute_invocations_per_workgroup or too_big:
            raise TernaryShapeError(
                f"{op}: K={k} needs {wg} threads and {workgroup_bytes} bytes of workgroup "
                f"memory per workgroup, over this device's limits "
                f"({limits.max_compute_invocations_per_workgroup} threads, "
                f"{limits.max_compute_workgroup_storage_size} bytes): use RMSNormQuant + "
                f"TernaryLinear"
            )
        device = kernels.device
        subgroups = subgroups_available(device)
        if use_dot4 is None:
            use_dot4 = packed_dot_available(device)
        defines = (
            (("DOT4",) if use_dot4 else ())
            + (("SUBGROUPS",) if subgroups else ())
            + (("NORMALIZE", "HAS_WEIGHT") if norm_weight is not None else ())
            + (("SHARED_ROW",) if row_groups > 1 else ())
        )
        gated = EPILOGUES[epilogue] >= 2
        self.rows, self.verify_rows = rows, verify_rows
        self._fused_constants = dict(
            STEP_PARAMS=STEP_PARAMS_WGSL,
            enables=wgsl_enables(device, subgroups=subgroups),
            defines=defines,
            K=k,
            N=weights.n_rows,
            GROUPS=row_groups,
            GW=gw,
            SVEC=4 // row_groups,
            EPILOGUE=EPILOGUES[epilogue],
            EPS=float(eps),
            K_F=float(mean_width),
        )
        self._fused_buffers = [weights.codes, weights.scales, x]
        self._fused_buffers += ([norm_weight] if norm_weight is not None else []) + [out]
        self.step = step
        self._x_q, self._x_scale = x_q, x_scale  # the split path writes them
        self._quant: tuple[gpu.Pipeline, gpu.BindGroup] | None = None  # the split path's QUANT_ONLY kernel
        self._fused_label, self._kernels, self._outs_per_row = label, kernels, (2 if gated else 1)
        # (rows per group, bounded) -> (pipeline, bind group, workgroups)
        self._fused: dict[tuple[int, bool], tuple[gpu.Pipeline, gpu.BindGroup, int]] = {}
        self.groups = self._fused_kernel(rows)[2]  # workgroups of a decode step
        # CPU adapters (lavapipe, SwiftShader) run the fused kernel's per-workgroup norm 2-3x slower
        # than the separate norm dispatch (measured on lavapipe: 1.2 vs 2.8-4.2 tok/s on the bundled
        # model); GPUs gain from fusing (docs/performance-notes.md).
        self.fuse_decode = not device.is_cpu
        if self.fuse_decode:  # compiled with the others, not at the first verify step (elsewhere: on first use)
            self._fused_kernel(verify_rows, bounded=True)
            self._fused_kernel(rows, bounded=True)  # speculative draft-off steps
        self.small_max = min(SMALL_T_MAX, self.linear.max_tokens, x.nbytes // (4 * k))
        if SMALL_T_PATH not in SMALL_T_PATHS:
            raise ValueError(f"SMALL_T_PATH is {SMALL_T_PATH!r}; expected one of {SMALL_T_PATHS}")
        self.small_t_path = SMALL_T_PATH
        self.split_pays = weights.n_rows * weights.n_cols >= SPLIT_MIN_WEIGHTS
        self.split_min_live = split_min_live_rows(device)
        if self.fuse_decode and (SMALL_T_PATH == "split" or SMALL_T_PATH == "auto" and self.split_pays):
            self._split_kernels()  # compiled at load, not at the first verify step

    def record(
        self, recorder: gpu.Recorder, n_tokens: int, bounded: bool = False, live_rows: float | None = None
    ) -> None:
        """`bounded`: a one-row step whose StepParams are written on the GPU (a speculative draft-off
        step), which may say 0 rows: the fused kernel then reads n_tokens and leaves at once (more
        rows always do). `live_rows`: how many of the rows the caller expects StepParams to keep (a
        verify step's draft + 1, on average; default all), which picks the "auto" path."""
        small = 1 < n_tokens <= self.small_max and self.fuse_decode
        path = self.small_t_path
        if path == "auto":
            live = n_tokens if live_rows is None else live_rows
            path = "split" if self.split_pays and live >= self.split_min_live else "fused"
        if small and path == "rows":
            self.record_rows(recorder, n_tokens)
        elif small and path == "split":
            self.record_split(recorder, n_tokens)
        elif n_tokens <= self.small_max and self.fuse_decode:
            self.record_fused(recorder, n_tokens, bounded)
        else:
            self.norm.record(recorder, n_tokens)
            self.linear.record(recorder, n_tokens)

    def record_split(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        """The "split" small-T path: the fused kernel's norm and quantization of each row into
        x_q / x_scale (QUANT_ONLY), then the plain GEMV per row; rows from StepParams.n_tokens on
        leave at once in both."""
        pipeline, bind = self._split_kernels()
        recorder.dispatch(pipeline, bind, 1, n_tokens)
        self.linear.record_gemv(recorder, n_tokens, bounded=True)

    def _split_kernels(self) -> tuple[gpu.Pipeline, gpu.BindGroup]:
        """The split path's QUANT_ONLY kernel, built with its bounded GEMV on first use."""
        if self._quant is None:
            constants = dict(self._fused_constants)
            constants["defines"] += ("QUANT_ONLY", "BOUNDED")
            pipeline = self._kernels.pipeline("ternary_gemv_norm", ROWS=self.rows, **constants)
            buffers = [*self._fused_buffers[2:-1], self._x_q, self._x_scale, self.step.buffer]
            bind = self._kernels.device.bind_group(pipeline, buffers, f"{self._fused_label} norm + quantization")
            self._quant = (pipeline, bind)
            self.linear.gemv_bounded()
        return self._quant

    def record_rows(self, recorder: gpu.Recorder, n_tokens: int) -> None:
        """RMSNormQuant over the rows (StepParams.n_tokens must equal n_tokens), then
        ternary_gemv_rows over all of them: the "rows" small-T path."""
        self.norm.record(recorder, n_tokens)
        self.linear.record_rows(recorder, n_tokens)

    def _fused_kernel(self, rows: int, bounded: bool = False) -> tuple[gpu.Pipeline, gpu.BindGroup, int]:
        """The fused kernel with `rows` weight rows per row group: pipeline, bind group, workgroups.
        `bounded`: token rows from StepParams.n_tokens on exit at once (the verify steps' kernel: their
        draft kernel sets n_tokens to the rows the draft fills, the step dispatches all k + 1)."""
        found = self._fused.get((rows, bounded))
        if found is None:
            constants = dict(self._fused_constants)
            buffers = self._fused_buffers
            if bounded:
                constants["defines"] += ("BOUNDED",)
                buffers = [*buffers, self.step.buffer]
            pipeline = self._kernels.pipeline("ternary_gemv_norm", ROWS=rows, **constants)
            label = f"{self._fused_label} fused ({rows} rows{', bounded' if bounded else ''})"
            bind = self._kernels.device.bind_group(pipeline, buffers, label)
            total = rows * constants["GROUPS"] // self._outs_per_row  # outputs per workgroup
            found = self._fused[(rows, bounded)] = (pipeline, bind, ceil_div(self.linear.out_width, total))
        return found

    def record_fused(self, recorder: gpu.Recorder, n_tokens: int, bounded: bool = False) -> None:
        """The fused kernel for each of `n_tokens` rows (what record() runs for up to SMALL_T_MAX rows
        on a GPU; tests and benchmarks call it on any adapter): `rows` weight rows per row group for one
        token row; for more, `verify_rows` and rows from StepParams.n_tokens on skipped (the same
        arithmetic per row either way; `bounded` skips them for one row too)."""
        verify = n_tokens > 1
        pipeline, bind, groups = self._fused_kernel(
            self.verify_rows if verify else self.rows, bounded=verify or bounded
        )
        recorder.dispatch(pipeline, bind, groups, n_tokens)
