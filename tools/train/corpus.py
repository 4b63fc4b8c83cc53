"""The training corpus: the Python standard library's own source files (PSF License).

The corpus is defined by a fixed rule, so anyone with the same CPython version rebuilds it exactly:
every ``*.py`` file under the stdlib directory (``site-packages`` and ``__pycache__`` excluded),
sorted by relative POSIX path, decoded as strict UTF-8 (files that are not valid UTF-8, a few test
fixtures with legacy encodings, are skipped and listed). A file goes to the validation split when the
first 8 bytes of the SHA-256 of its relative path, read as a big-endian integer, are < ``VAL_PERCENT``
modulo 100: the split is by file, so no validation text is ever seen in training.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

VAL_PERCENT = 3  # share of files held out for validation (by file, chosen by path hash)
EXCLUDED_DIRS = frozenset({"site-packages", "__pycache__"})
CORPUS_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2), see LICENSE.txt of the stdlib"


@dataclass(frozen=True)
class CorpusFile:
    rel_path: str  # POSIX path relative to the stdlib directory
    split: str  # 'train' | 'val'
    text: str


def default_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_version() -> str:
    return ".".join(str(p) for p in sys.version_info[:3])


def split_of(rel_path: str) -> str:
    digest = int.from_bytes(hashlib.sha256(rel_path.encode("utf-8")).digest()[:8], "big")
    return "val" if digest % 100 < VAL_PERCENT else "train"


def list_source_files(stdlib_dir: Path) -> list[str]:
    """Relative POSIX paths of all candidate files, sorted by name (the fixed data order)."""
    paths = []
    for path in stdlib_dir.rglob("*.py"):
        rel = path.relative_to(stdlib_dir)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        paths.append(rel.as_posix())
    return sorted(paths)


def load_corpus(stdlib_dir: Path) -> tuple[list[CorpusFile], list[str]]:
    """All readable files in fixed order, and the relative paths skipped as not UTF-8."""
    files, skipped = [], []
    for rel in list_source_files(stdlib_dir):
        raw = (stdlib_dir / rel).read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if not text.strip():
            continue  # empty __init__.py files carry nothing to learn
        files.append(CorpusFile(rel, split_of(rel), text))
    return files, skipped


def file_list_sha256(files: list[CorpusFile]) -> str:
    """Hash of 'split<TAB>path<TAB>sha256(content)' lines: pins both the list and the contents."""
    lines = [f"{f.split}\t{f.rel_path}\t{hashlib.sha256(f.text.encode('utf-8')).hexdigest()}" for f in files]
    return hashlib.sha256("\n".join(lines).encode("utf-8")).hexdigest()
