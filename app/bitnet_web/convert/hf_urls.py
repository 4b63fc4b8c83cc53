"""Which URLs name a Hugging Face checkpoint folder (standard library only).

Kept apart from hf_checkpoint (numpy) because the chat page's main thread, which has no numpy, must
tell a folder URL from a GGUF file URL before it asks the worker to load it.
"""

from __future__ import annotations

import urllib.parse

HF_HOSTS = ("huggingface.co", "www.huggingface.co", "hf.co")
FILE_SUFFIXES = (".gguf", ".safetensors", ".json", ".bin")


def checkpoint_base_url(url: str) -> str | None:
    """The base URL (ending in '/') of a Hugging Face checkpoint folder, or None if `url` names a file.

    https://huggingface.co/ORG/REPO, .../tree/REV[/dir] and .../resolve/REV[/dir] name the files under
    .../resolve/REV[/dir]/; on any host a URL ending in '/' is a folder.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return None
    path = parts.path
    if not path.endswith("/") and path.rsplit("/", 1)[-1].endswith(FILE_SUFFIXES):
        return None
    segments = [s for s in path.split("/") if s]
    if parts.netloc in HF_HOSTS:
        if len(segments) == 2:
            segments += ["resolve", "main"]
        elif len(segments) >= 4 and segments[2] in ("tree", "resolve", "blob"):
            segments[2] = "resolve"
        else:
            return None
        return f"https://huggingface.co/{'/'.join(segments)}/"
    if path.endswith("/"):
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
    return None


def checkpoint_name(base_url: str) -> str:
    """A short name for a checkpoint folder URL: 'ORG/REPO' when the path holds .../ORG/REPO/resolve/REV/
    (on any host, so mirrors and test servers name it the same), else the folder's last segment."""
    segments = [s for s in urllib.parse.urlsplit(base_url).path.split("/") if s]
    for i in range(len(segments) - 1, 1, -1):
        if segments[i] == "resolve":
            return "/".join(segments[i - 2 : i])
    return segments[-1] if segments else base_url
