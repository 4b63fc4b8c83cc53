"""Files the CLI writes: never over one of the command's inputs, and only complete under their final name.

Each output is written to a temporary file in the same folder and renamed over the final path when
complete (a rename within one folder is atomic), so an interrupted or failed run leaves no half file
under the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


class OutputError(ValueError):
    """An output path the command must not write (an input, a folder)."""


def check_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), what: str = "output") -> Path:
    """`out` as a Path, after refusing a folder or any path that is (or holds) one of `inputs`.

    An input that is a folder (a checkpoint) protects every file in it that exists now, apart from
    GGUF files (an earlier output; checkpoints are read from their JSON and safetensors files).
    """
    path = Path(out)
    if path.is_dir():
        raise OutputError(f"{what} {out} is a folder: give a file path")
    if not path.parent.is_dir():
        raise OutputError(f"{what} {out}: no such folder {path.parent}")
    target = path.resolve()
    for source in inputs:
        if isinstance(source, str) and "://" in source:
            continue
        src = Path(source)
        if not src.exists():
            continue
        src = src.resolve()
        if target == src or (path.exists() and os.path.samefile(path, src)):
            raise OutputError(f"{what} {out} is the input {source}: refusing to write over it")
        if src.is_dir() and path.exists() and src in target.parents and target.suffix.lower() != ".gguf":
            raise OutputError(f"{what} {out} is a file of the input folder {source}: refusing to write over it")
    return path


@contextlib.contextmanager
def atomic_path(out: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `out`; renamed to `out` when the block completes, removed if it raises."""
    final = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".part", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, final)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp_path.unlink()
        raise


def write_text(out: str | os.PathLike, text: str) -> None:
    with atomic_path(out) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
