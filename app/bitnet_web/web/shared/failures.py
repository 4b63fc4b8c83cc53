"""What the page tells a person when something fails: a title, what happened, and what to do.

Pure Python, used on both sides: the worker classifies exceptions into a kind (by the names of the
exception's classes, so this module needs no GPU or engine import), and the page renders the kind's
text. Fatal kinds replace the app with a failure page; the others are a message above the chat
while the app stays usable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Failure:
    kind: str
    title: str
    message: str
    advice: tuple[str, ...] = field(default_factory=tuple)
    fatal: bool = False


_GPU_BROWSERS = (
    "Use a current Chrome or Edge (version 113 or newer) on Windows, macOS or ChromeOS.",
    "On Linux, Chrome needs chrome://flags/#enable-unsafe-webgpu (and often "
    "chrome://flags/#enable-vulkan) turned on, then a restart.",
    'Check that hardware acceleration is on: chrome://settings/system, "Use graphics acceleration '
    "when available\". chrome://gpu shows WebGPU's status.",
    "Firefox and Safari ship WebGPU only in recent versions or behind settings; Chrome or Edge is the tested choice.",
)

_TEXTS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    # kind: (title, advice, fatal)
    "no_webgpu": ("This browser has no WebGPU", _GPU_BROWSERS, True),
    "no_adapter": (
        "WebGPU is present but no GPU adapter is available",
        (
            "The GPU may be blocklisted or hardware acceleration switched off: see chrome://gpu.",
            *_GPU_BROWSERS[1:3],
            "Close other tabs that use the GPU heavily and reload.",
        ),
        True,
    ),
    "missing_feature": (
        "Your GPU lacks a feature this model needs",
        (
            "Update the browser and the graphics driver, then reload.",
            "Try another browser (Chrome or Edge) or another device.",
        ),
        False,
    ),
    "memory": (
        "Not enough memory for this model",
        (
            "Close other tabs and apps, then load the model again.",
            "Choose a smaller model (the bundled one needs only a few MB).",
            "A 64-bit browser on a device with 8 GB of RAM or more is needed for BitNet 2B-4T.",
        ),
        False,
    ),
    "quota": (
        "Not enough storage space for this model",
        (
            "Delete cached models you no longer need (Storage, below the model list).",
            "Free disk space, or allow this site more storage in the browser's site settings.",
        ),
        False,
    ),
    "storage": (
        "Browser storage failed",
        (
            "Press Load to try again: what was stored so far is kept when it can be.",
            "If this repeats, free disk space, or leave private browsing (it limits storage), then reload.",
        ),
        False,
    ),
    "deleted": ("The model was deleted while it was loading", ("Press Load to download it again.",), False),
    "download": (
        "The model could not be downloaded",
        (
            "Check the URL (an HTTP error such as 404 means the server has no file there) and the "
            "network connection, then press Load again: a partial download resumes where it stopped "
            "when the server supports it.",
            "If the URL is on another site, that server must allow cross-origin requests (CORS).",
        ),
        False,
    ),
    "not_gguf": (
        "That URL is not a GGUF model file",
        ('Use a direct link to a .gguf file (on Hugging Face: the "resolve/main/...gguf" link, not the "blob" page).',),
        False,
    ),
    "bad_model": (
        "The model file is damaged or not supported",
        (
            "Download it again (delete the cached copy under Storage first).",
            "Only BitNet b1.58 GGUF files (I2_S, TQ1_0, TQ2_0 weights) are supported.",
        ),
        False,
    ),
    "device_lost": ("The GPU was reset", ("Press Load to load the model again; your chat is kept.",), False),
    "engine_missing": (
        "The inference engine is not part of this build",
        (
            "The model was downloaded and checked, but this build cannot run it. Rebuild with the "
            "engine (python3 build.py serve) to chat.",
        ),
        False,
    ),
    "cancelled": ("Loading cancelled", ("Press Load to continue: the download resumes.",), False),
    "worker_start": (
        "The engine worker could not start",
        ("Reload the page. If this repeats, the site's files may be incomplete: rebuild and serve them again.",),
        True,
    ),
    "busy": ("Busy", ("Wait for the current step to finish, or press Stop.",), False),
    "blocked_host": (
        "This site cannot download from that host",
        (
            "Use a model on Hugging Face (a huggingface.co link) or one served by this site.",
            "Self-hosting the app? Add the host to MODEL_HOSTS in build.py and rebuild.",
        ),
        False,
    ),
    "too_long": (
        "The message is too long for this model's context",
        (
            "Shorten the message (it is still in the box), or lower Max tokens in Settings to leave it more room.",
            "Older turns are dropped automatically; a single message must fit on its own.",
        ),
        False,
    ),
    "internal": (
        "Something went wrong",
        ("Reload the page. The details below help when reporting the problem.",),
        False,
    ),
}

# Exception class names (anywhere in the MRO) -> kind. Names, not imports: the GPU and engine
# modules may be absent, and this module runs on the page too.
_CLASS_KINDS = (
    ("GPUDeviceLostError", "device_lost"),
    ("GPUOutOfMemoryError", "memory"),
    ("GPUUnavailableError", "missing_feature"),
    ("MemoryError", "memory"),
    ("QuotaExceededError", "quota"),
    ("NotGGUFError", "not_gguf"),
    ("GGUFError", "bad_model"),
    ("ModelConfigError", "bad_model"),
    ("TokenizerError", "bad_model"),
    ("ChatTemplateError", "bad_model"),
    ("DownloadError", "download"),
    ("DownloadCancelled", "cancelled"),
    ("EntryDeletedError", "deleted"),
    ("StoreError", "storage"),
)


def classify(exc: BaseException) -> str:
    """The failure kind for an exception, from the names of its classes."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    kind = getattr(exc, "failure_kind", None)
    if isinstance(kind, str) and kind in _TEXTS:
        return kind
    for name, kind in _CLASS_KINDS:
        if name in names:
            return kind
    return "internal"


def name_the_file(exc: BaseException, name: str | None) -> None:
    """Prefix a model-file failure's message with the file's name, in place, unless it names it
    already: the reader works on bytes, so "tensor 'blk.2.ffn_up.weight' extends past the end of the
    file" would not say which of the user's files that is."""
    if (
        name
        and classify(exc) == "bad_model"
        and len(exc.args) == 1
        and isinstance(exc.args[0], str)
        and name not in exc.args[0]
    ):
        exc.args = (f"{name}: {exc.args[0]}",)


def describe(kind: str, message: str) -> Failure:
    """The text shown for a failure of `kind`; `message` says what exactly happened."""
    title, advice, fatal = _TEXTS.get(kind, _TEXTS["internal"])
    return Failure(
        kind=kind if kind in _TEXTS else "internal", title=title, message=message, advice=advice, fatal=fatal
    )


def failure_event(exc: BaseException, request_id: int | None = None) -> dict:
    """An `error` protocol event for an exception raised in the worker."""
    kind = classify(exc)
    text = str(exc) or type(exc).__name__
    f = describe(kind, text)
    detail = type(exc).__name__ if kind != "internal" else f"{type(exc).__module__}.{type(exc).__name__}"
    return {
        "event": "error",
        "id": request_id,
        "kind": f.kind,
        "title": f.title,
        "message": f.message,
        "advice": list(f.advice),
        "fatal": f.fatal,
        "detail": detail,
    }
