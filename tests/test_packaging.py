"""The wheel: pyproject lists every package, ships the WGSL kernels and the default model, and an
installed wheel generates text from any directory (the same text as the checkout)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "app" / "bitnet_web"
COMMAND = ["generate", "--prompt", "def f(", "--max-tokens", "8", "--quiet"]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_package():
    """setuptools is given an explicit package list (so that shaders/ can be mapped in): a new
    sub-package missing from it would be missing from the wheel."""
    listed = set(_setuptools()["packages"])
    on_disk = {
        ".".join(path.parent.relative_to(ROOT / "app").parts)
        for path in PACKAGE.rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    for data_package, folder, pattern in (
        ("bitnet_web.shaders", "shaders", "*.wgsl"),
        ("bitnet_web.models", "static/models", "*.gguf"),
    ):
        assert _setuptools()["package-dir"][data_package] == folder
        assert sorted((ROOT / folder).glob(pattern)), f"{folder}/ has no {pattern}"


def _run(args: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.slow
@pytest.mark.gpu
def test_installed_wheel_generates_outside_the_checkout(tmp_path):
    """`pip wheel .`, a fresh venv with the wheel and wgpu, `bitnet-web generate` run from an empty
    folder: it finds its kernels and its default model inside the installed package and prints the
    same greedy text as the checkout."""
    # Build from a copy holding only what the wheel is made of, so the checkout gets no build/ folder.
    src = tmp_path / "src"
    for name in ("app", "shaders", "static/models"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("XDG_RUNTIME_DIR", "/tmp")
    wheels = tmp_path / "wheels"
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
        tmp_path,
        env,
    )
    (wheel,) = wheels.glob("bitnet_web-*.whl")

    target = tmp_path / "venv"
    venv.create(target, with_pip=True)
    python = target / "bin" / "python"
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}[gpu]"], tmp_path, env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = _run([target / "bin" / "bitnet-web", *COMMAND], elsewhere, env)
    location = _run([python, "-c", "import bitnet_web; print(bitnet_web.__file__)"], elsewhere, env).stdout
    assert str(target) in location, location

    checkout = _run([sys.executable, "-m", "bitnet_web", *COMMAND], ROOT, {**env, "PYTHONPATH": str(ROOT / "app")})
    assert installed.stdout.strip(), installed.stderr
    assert installed.stdout == checkout.stdout


def test_architecture_doc_lists_every_module():
    """docs/ARCHITECTURE.md's layout block has one line per module, no more and no fewer, each
    opening with the first words of the module's docstring (so a renamed or new module shows up)."""
    import ast
    import re

    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = doc.split("## Layout (app/bitnet_web/, one line per module)")[1].split("```")[1]
    listed = dict(re.findall(r"^(\S+\.py)\s+(.+)$", block, re.M))
    on_disk = {str(p.relative_to(PACKAGE)): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    assert sorted(set(on_disk) - set(listed)) == [], "add these modules to docs/ARCHITECTURE.md"
    assert sorted(set(listed) - set(on_disk)) == [], "these modules are gone: remove them from docs/ARCHITECTURE.md"
    for name, path in on_disk.items():
        opening = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").split()
        assert opening, f"{name} has no docstring saying what it is for"
        assert listed[name].split()[:4] == opening[:4], f"{name}: the doc line does not open like its docstring"
