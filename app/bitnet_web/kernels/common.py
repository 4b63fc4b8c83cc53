"""What every kernel op shares: shader loading with injected constants, a pipeline cache, and the
per-step parameter block.

WGSL sources live in the repository's top-level `shaders/` (in the browser build, next to the
package). Tile and workgroup sizes are chosen in Python and substituted into `${NAME}`
placeholders, so one number is never written in two places. Code shared by several kernels lives in
snippets (`shaders/_NAME.wgsl`, a leading underscore: not a kernel of its own), pulled in by a line
`//#include _NAME`. `python -m bitnet_web.kernels.show KERNEL [DEFINE ...] [NAME=VALUE ...]` prints a
kernel as the compiler gets it.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path
from string import Template

import numpy as np

from .. import gpu

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


@functools.cache
def shader_dir() -> Path:
    candidates = (_PACKAGE_DIR / "shaders", _PACKAGE_DIR.parent.parent / "shaders")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"WGSL shaders not found; looked in {', '.join(map(str, candidates))}")


@functools.cache
def _shader_source(name: str) -> str:
    """shaders/<name>.wgsl with every `//#include SNIPPET` line replaced by shaders/SNIPPET.wgsl (nestable)."""
    return _expand_includes(name, ())


def _expand_includes(name: str, chain: tuple[str, ...]) -> str:
    if name in chain:
        raise ValueError(f"{name}.wgsl: //#include cycle {' -> '.join(chain + (name,))}")
    path = shader_dir() / f"{name}.wgsl"
    if not path.is_file():
        where = f" (included from {chain[-1]}.wgsl)" if chain else ""
        raise FileNotFoundError(f"WGSL shader {path} not found{where}")
    out = []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        marker = line.strip()
        if marker.startswith("//#include"):
            parts = marker.split()
            if len(parts) != 2:
                raise ValueError(f"{name}.wgsl: expected '//#include NAME', got {marker!r}")
            out.append(_expand_includes(parts[1], chain + (name,)).rstrip("\n") + "\n")
        else:
            out.append(line)
    return "".join(out)


def expanded_source(name: str, defines: tuple[str, ...] = (), **constants: object) -> str:
    """The kernel's text after includes, `//#if` selection and `//#for` unrolling, with the given
    constants filled in and any others left as `${NAME}` (for reading, not compiling)."""
    values = {k: _wgsl_literal(v) for k, v in constants.items()}
    source = unroll_loops(select_blocks(_shader_source(name), defines, name), constants, name)
    return Template(source).safe_substitute(values)


def load_shader(name: str, enables: tuple[str, ...] = (), defines: tuple[str, ...] = (), **constants: object) -> str:
    """The text of shaders/<name>.wgsl with `${NAME}` placeholders filled from `constants`.

    `enables` become `enable X;` lines at the top (e.g. 'f16', 'subgroups'); they must come
    before any other declaration, so they are prepended here rather than written in the file.
    `defines` select between `//#if NAME` / `//#if !NAME` / `//#else` / `//#endif` blocks (see
    `select_blocks`), for variants that differ in signatures (e.g. subgroup builtins).
    `//#for VAR in COUNT` ... `//#endfor` blocks are unrolled (see `unroll_loops`).
    Unfilled placeholders are an error, so a missing constant never reaches the compiler.
    """
    values = {k: _wgsl_literal(v) for k, v in constants.items()}
    source = unroll_loops(select_blocks(_shader_source(name), defines, name), constants, name)
    body = Template(source).substitute(values)
    header = "".join(f"enable {e};\n" for e in enables)
    return header + body


def select_blocks(source: str, defines: tuple[str, ...] | frozenset[str], name: str = "shader") -> str:
    """Keep the lines of `source` whose enclosing `//#if` conditions hold for `defines`.

    Markers sit alone on their line: `//#if NAME`, `//#if !NAME`, `//#else`, `//#endif` (nestable).
    Blocks are removed before placeholders are filled, so a dropped block needs no constants.
    Sources without markers come back unchanged.
    """
    if "//#" not in source:
        return source
    kept: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (this block's condition, all enclosing blocks active)
    active = True
    for number, line in enumerate(source.splitlines(keepends=True), start=1):
        marker = line.strip()
        if marker.startswith("//#if "):
            word = marker[len("//#if ") :].strip()
            condition = (word[1:] not in defines) if word.startswith("!") else (word in defines)
            stack.append((condition, active))
            active = active and condition
        elif marker == "//#else":
            if not stack:
                raise ValueError(f"{name}.wgsl line {number}: //#else without //#if")
            condition, outer = stack[-1]
            stack[-1] = (not condition, outer)
            active = outer and not condition
        elif marker == "//#endif":
            if not stack:
                raise ValueError(f"{name}.wgsl line {number}: //#endif without //#if")
            _, active = stack.pop()
        elif active:
            kept.append(line)
    if stack:
        raise ValueError(f"{name}.wgsl: {len(stack)} //#if block(s) not closed")
    return "".join(kept)


def unroll_loops(source: str, constants: dict[str, object], name: str = "shader") -> str:
    """Repeat the lines between `//#for VAR in COUNT` and `//#endfor` COUNT times, with `{{VAR}}`
    replaced by 0, 1, ... (nestable). COUNT is an integer or the name of an integer constant.

    Why: naga's SPIR-V output gives every WGSL loop a forced iteration bound, which keeps the
    driver from unrolling it, so per-thread arrays indexed by a loop variable land in local memory
    (measured on the H100: 2.5-3x slower kernels). Unrolled text with one `let` per element keeps
    everything in registers on every compiler.
    """
    if "//#for " not in source:
        return source
    lines = source.splitlines(keepends=True)

    def expand(start: int, stop: int, env: dict[str, int]) -> list[str]:
        out: list[str] = []
        i = start
        while i < stop:
            marker = lines[i].strip()
            if marker.startswith("//#for "):
                parts = marker.split()
                if len(parts) != 4 or parts[2] != "in":
                    raise ValueError(f"{name}.wgsl line {i + 1}: expected '//#for VAR in COUNT', got {marker!r}")
                var, count_text = parts[1], parts[3]
                count = int(count_text) if count_text.isdigit() else constants.get(count_text)
                if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                    raise ValueError(f"{name}.wgsl line {i + 1}: loop count {count_text!r} is not an integer constant")
                depth, end = 1, i + 1
                while end < stop and depth:
                    inner = lines[end].strip()
                    depth += inner.startswith("//#for ") - (inner == "//#endfor")
                    end += 1
                if depth:
                    raise ValueError(f"{name}.wgsl line {i + 1}: //#for without //#endfor")
                for value in range(count):
                    out += expand(i + 1, end - 1, {**env, var: value})
                i = end
            elif marker == "//#endfor":
                raise ValueError(f"{name}.wgsl line {i + 1}: //#endfor without //#for")
            else:
                line = lines[i]
                for var, value in env.items():
                    line = line.replace("{{" + var + "}}", str(value))
                out.append(line)
                i += 1
        return out

    return "".join(expand(0, len(lines), {}))


def subgroups_available(device: gpu.Device) -> bool:
    return "subgroups" in device.features


def packed_dot_available(device: gpu.Device) -> bool:
    """Whether WGSL's dot4I8Packed (language feature packed_4x8_integer_dot_product) can be used.

    A device may list its `wgsl_language_features` (navigator.gpu.wgslLanguageFeatures in the
    browser); without that list assume yes: naga has it, and Chrome ships it since version 123.
    """
    listed = getattr(device, "wgsl_language_features", None)
    return listed is None or "packed_4x8_integer_dot_product" in listed


def wgsl_enables(device: gpu.Device, subgroups: bool = False, f16: bool = False) -> tuple[str, ...]:
    """The `enable` directives a shader using subgroups / f16 needs on this device's compiler.

    Tint (browsers) requires `enable subgroups;`; naga (wgpu-native 0.32) rejects that directive
    ("not yet supported") yet compiles subgroup builtins once the device feature is on. Both take
    `enable f16;`.
    """
    enables = []
    if subgroups and device.backend == "browser":
        enables.append("subgroups")
    if f16:
        enables.append("f16")
    return tuple(enables)


# Most token rows of a "small-T" step (a speculative verify over k+1 rows): the ternary linear layers
# and the LM head then read every weight once for all rows (kernels/linear.py, embedding.py); more
# rows take the tiled prefill kernels.
SMALL_T_MAX = 9


def check_token_pick(
    label: str, logits: gpu.Buffer, out_ids: gpu.Buffer, vocab_size: int, row: int, slot: int, error: type = ValueError
) -> None:
    """Refuse a token-picking op (argmax, sampler) whose logits row or output slot lies past its buffer."""
    if logits.nbytes < 4 * vocab_size * (row + 1) or out_ids.nbytes < 4 * (slot + 1):
        raise error(
            f"{label}: logits ({logits.nbytes} bytes) must hold row {row} of {vocab_size} f32 "
            f"and out_ids ({out_ids.nbytes} bytes) slot {slot}"
        )


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _wgsl_literal(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}u" if value >= 0 else f"{value}i"
    if isinstance(value, float):
        return repr(float(np.float32(value))) if np.isfinite(value) else "0.0"
    return str(value)


class KernelCache:
    """Compiled pipelines keyed by shader name and constants: one pipeline per shape, shared by layers.

    `KernelCache.of(device)` is the device's own cache, which models share: a model loaded again on
    the same device (a page switching back to a model, a load retried after a failure) compiles no
    kernel it already has. A pipeline holds no buffer (bind groups are made per model), so sharing it
    is safe; a new device (after a loss) starts an empty cache.
    """

    def __init__(self, device: gpu.Device, pipelines: dict[tuple, gpu.Pipeline] | None = None):
        self.device = device
        self._pipelines: dict[tuple, gpu.Pipeline] = {} if pipelines is None else pipelines

    @classmethod
    def of(cls, device: gpu.Device) -> KernelCache:
        # keyed weakly by the device, and the pipelines do not refer back to it: a lost device goes
        pipelines = _DEVICE_PIPELINES.setdefault(device, {})
        return cls(device, pipelines)

    def forget_unbuilt(self) -> None:
        """Drop pipelines a failed pipeline batch left without a handle, so the next use compiles them
        again instead of reusing one that never came to exist."""
        for key in [key for key, p in self._pipelines.items() if p.handle is None]:
            del self._pipelines[key]

    def pipeline(
        self,
        name: str,
        entry_point: str = "main",
        enables: tuple[str, ...] = (),
        defines: tuple[str, ...] = (),
        **constants: object,
    ) -> gpu.Pipeline:
        key = (name, entry_point, enables, tuple(sorted(defines)), tuple(sorted(constants.items())))
        found = self._pipelines.get(key)
        if found is None:
            label = (
                f"{name}:{entry_point}"
                + "".join(f" {d}" for d in sorted(defines))
                + "".join(f" {k}={v}" for k, v in sorted(constants.items()))
            )
            found = self.device.pipeline(load_shader(name, enables, defines, **constants), label, entry_point)
            self._pipelines[key] = found
        return found

    @property
    def count(self) -> int:
        return len(self._pipelines)


_DEVICE_PIPELINES: weakref.WeakKeyDictionary[gpu.Device, dict[tuple, gpu.Pipeline]] = weakref.WeakKeyDictionary()

STEP_PARAMS_WGSL = """
struct StepParams {
    n_tokens: u32,     // rows in this step (1 for decode)
    pos: u32,          // tokens already in the KV cache = absolute position of row 0
    kv_capacity: u32,  // rows allocated in each KV cache buffer
    slot: u32,         // index of a decode step in its submit (step_advance.wgsl advances it)
};
"""


class StepParams:
    """The per-step scalars, one 16-byte uniform buffer written by the host before a step, or on the
    GPU: by the previous decode step of the same submit (step_advance.wgsl), or by a speculative
    step's draft kernel (speculative.py)."""

    NBYTES = 16

    def __init__(self, device: gpu.Device):
        self.device = device
        # STORAGE too: kernels write it (step_advance.wgsl, a verify step's draft kernel); COPY_SRC: read back
        self.buffer = device.buffer(self.NBYTES, gpu.UNIFORM_USAGE | gpu.STORAGE | gpu.COPY_SRC, "step params")
        self._host = np.zeros(4, dtype=np.uint32)
        self._zero = np.zeros(1, dtype=np.uint32)  # reset_slot's word, made once (it runs every submit)

    def write(self, n_tokens: int, pos: int, kv_capacity: int, slot: int = 0) -> None:
        """The fields in STEP_PARAMS_WGSL's order, written before the next submit (queue order)."""
        self._host[:] = (n_tokens, pos, kv_capacity, slot)
        self.device.upload(self.buffer, 0, self._host)

    def reset_slot(self) -> None:
        """slot = 0, the other fields as the GPU left them (speculative steps set them on the GPU)."""
        self.device.upload(self.buffer, 12, self._zero)
