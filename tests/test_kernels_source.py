"""WGSL source handling: `//#include` snippets, the `show` command, and no code copied between shaders.

Pure text processing (no GPU): the kernels themselves are checked against numpy in
test_kernels_linear.py / test_kernels_attention.py.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from bitnet_web.kernels import common, show
from bitnet_web.kernels.common import shader_dir

RUN = 6  # issue 12: no run of this many identical lines may appear twice in shaders/


def _kernels() -> list[str]:
    return sorted(p.stem for p in shader_dir().glob("*.wgsl") if not p.stem.startswith("_"))


def test_every_snippet_is_included_and_every_include_resolves():
    snippets = {p.stem for p in shader_dir().glob("_*.wgsl")}
    assert snippets, "no shared WGSL snippets found"
    used = set()
    for name in _kernels():
        raw = (shader_dir() / f"{name}.wgsl").read_text()
        used |= {line.split()[1] for line in raw.splitlines() if line.strip().startswith("//#include")}
        assert "\n//#include" not in common._shader_source(name), name
    assert used == snippets, f"snippets never included: {sorted(snippets - used)}"


def test_no_run_of_identical_lines_repeats_across_shaders():
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in sorted(shader_dir().glob("*.wgsl")):
        lines = [line.strip() for line in path.read_text().splitlines()]
        for i in range(len(lines) - RUN + 1):
            window = tuple(lines[i : i + RUN])
            if all(line and not line.startswith("//") for line in window):  # code, not blank/comments
                seen[window].append(f"{path.name}:{i + 1}")
    repeated = {w: where for w, where in seen.items() if len(where) > 1}
    assert not repeated, "repeated WGSL (move it into a shaders/_snippet.wgsl): " + "; ".join(
        ", ".join(where) for where in list(repeated.values())[:5]
    )


def test_show_prints_the_expanded_kernel(capsys):
    assert show.main(["ternary_gemv", "DOT4", "K=256", "N=16", "ROWS=2", "WG=32", "ITERS=1", "EPILOGUE=0"]) == 0
    out = capsys.readouterr().out
    assert "return dot4I8Packed" in out and "fn block_dot(" in out and "fn store_out(" in out  # from the snippets
    assert "const K: u32 = 256u;" in out and "\n//#" not in out
    assert "let w0_1 = " in out  # //#for unrolled with ROWS=2
    assert show.main(["ternary_gemv", "K=256", "ROWS=2", "ITERS=1"]) == 0
    assert "return dot4I8Packed" not in capsys.readouterr().out  # the fallback dot4 without DOT4
    assert show.main(["ternary_gemv", "K=256"]) == 2  # //#for counts are needed to unroll
    assert "loop count 'ITERS' is not an integer constant" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        show.main(["no_such_kernel"])


def test_include_errors_name_the_files(tmp_path, monkeypatch):
    (tmp_path / "k.wgsl").write_text("//#include _a\nfn main() {}\n")
    (tmp_path / "_a.wgsl").write_text("//#include _b\n")
    (tmp_path / "_b.wgsl").write_text("//#include _a\n")
    (tmp_path / "m.wgsl").write_text("//#include _missing\n")
    monkeypatch.setattr(common, "shader_dir", lambda: tmp_path)
    with pytest.raises(ValueError, match="cycle k -> _a -> _b -> _a"):
        common._expand_includes("k", ())
    with pytest.raises(FileNotFoundError, match="_missing.wgsl not found .included from m.wgsl"):
        common._expand_includes("m", ())
