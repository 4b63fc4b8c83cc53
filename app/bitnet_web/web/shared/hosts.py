"""Which hosts the page may download models from: read from its Content-Security-Policy. Pure Python.

The policy (build.py MODEL_HOSTS, in each page's meta tag) is the one fact; the page reads it to say
which hosts a Custom URL may use and to refuse another host before fetching (the browser would only
report "Failed to fetch").
"""

from __future__ import annotations

from urllib.parse import urlsplit


class BlockedHostError(ValueError):
    """A model URL on a host the page's policy does not allow (kind "blocked_host")."""

    failure_kind = "blocked_host"


def connect_sources(csp: str) -> list[str]:
    """The sources of the policy's connect-src directive (default-src when there is none)."""
    directives = {}
    for part in csp.split(";"):
        words = part.split()
        if words:
            directives.setdefault(words[0].lower(), words[1:])
    return directives.get("connect-src", directives.get("default-src", []))


def allowed(url: str, sources: list[str], page_origin: str) -> bool:
    """True if `url` matches a source ('self', https://host, https://*.host)."""
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}".lower()
    host = (parts.hostname or "").lower()
    for source in sources:
        if source == "'self'":
            if origin == page_origin.lower():
                return True
            continue
        src = urlsplit(source if "://" in source else f"{parts.scheme}://{source}")
        if src.scheme and src.scheme != parts.scheme:
            continue
        pattern = (src.hostname or src.netloc).lower()
        if pattern.startswith("*."):
            if host.endswith(pattern[1:]) and host != pattern[2:]:
                return True
        elif host == pattern:
            return True
    return False


def describe(sources: list[str]) -> str:
    """ "this site, huggingface.co, *.huggingface.co, *.hf.co" for the page to show."""
    names = ["this site" if s == "'self'" else s.split("://", 1)[-1] for s in sources]
    return ", ".join(names) if names else "this site"


def blocked_message(url: str, sources: list[str]) -> str:
    """Why a URL on another host cannot be fetched, the cause first."""
    host = urlsplit(url).netloc or url
    return (
        f"{host} is not a host this site may download from ({url}): its Content-Security-Policy allows "
        f"models only from {describe(sources)}. Put the file on Hugging Face (or this site) and use that URL"
    )
