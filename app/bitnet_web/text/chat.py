"""Chat prompt formats, recognised from a model's template text and rendered in Python.

The GGUF key `tokenizer.chat_template` holds a Jinja template. Like llama.cpp, we never execute it:
its text only tells which known format the model uses (detection by content), and the format is
rendered here. Known kinds:

- ``bitnet``: BitNet b1.58 2B-4T, as bitnet.cpp renders it (`LLM_CHAT_TEMPLATE_BITNET` in its
  llama.cpp fork): ``System: {sys}`` (no separator after it), per user turn
  ``User: {msg}<|eot_id|>Assistant: ``, and each earlier assistant reply followed by ``<|eot_id|>``
  (in bitnet.cpp that token is the model's own end-of-turn token, kept in the context).
- ``llama3``: ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content.strip()}<|eot_id|>``.
- ``chatml``: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``.
- ``completion``: no chat format (base models): the messages' contents joined as they are.

BOS is not part of the rendered text: the tokenizer adds it (`render_tokens(add_bos=True)`).

Use `render_tokens` to get the prompt's token ids: template markup may produce control tokens, but
message contents never do, even when a user types ``<|eot_id|>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .tokenizer import Tokenizer

__all__ = ["CHAT_KINDS", "ChatTemplate", "ChatTemplateError", "render_tokens"]

CHAT_KINDS = ("bitnet", "llama3", "chatml", "completion")
_ROLES = ("system", "user", "assistant")


class ChatTemplateError(ValueError):
    """An unrecognised template, an unknown kind, or malformed messages."""


# A rendered conversation is a list of parts: (text, part kind). Part kinds:
#   "markup"  - template text; may contain special-token text that becomes control tokens
#   "content" - a system or user message; never special tokens
#   "reply"   - an assistant message; never special tokens, and tokenized on its own so that its
#               tokens are the ones the model generated after the generation prompt
_Part = tuple[str, str]


def _detect_kind(text: str) -> str | None:
    """Which known format a Jinja chat template renders, judged by its text (as llama.cpp does)."""
    stripped = text.strip()
    if stripped in CHAT_KINDS:
        return stripped
    if "<|im_start|>" in text:
        return "chatml"
    if "<|start_header_id|>" in text and "<|end_header_id|>" in text:
        return "llama3"
    # 2B-4T: plain "Role: " prefixes without header tokens, written out ("User: ") or built from the
    # role name (`message['role'] | capitalize + ': '`); bitnet.cpp also accepts any text with "BITNET".
    if "BITNET" in text or ("Assistant: " in text and ("User: " in text or "capitalize" in text)):
        return "bitnet"
    return None


@dataclass(frozen=True)
class ChatTemplate:
    """One chat format. `kind` in CHAT_KINDS; `stop_strings` end a reply if they appear as text."""

    kind: str
    source: str | None = None  # the template text it was recognised from, if any
    note: str = ""  # why this kind was chosen when the template text was not recognised

    def __post_init__(self) -> None:
        if self.kind not in CHAT_KINDS:
            raise ChatTemplateError(f"unknown chat template kind {self.kind!r} (known: {', '.join(CHAT_KINDS)})")

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_template_text(cls, text: str) -> ChatTemplate:
        """Recognise a Jinja chat template (or a kind name). Raises ChatTemplateError if unknown."""
        if not isinstance(text, str):
            raise ChatTemplateError(f"chat template must be a string, got {type(text).__name__}")
        kind = _detect_kind(text)
        if kind is None:
            head = text.strip().replace("\n", " ")[:80]
            raise ChatTemplateError(f"chat template not recognised (known: bitnet, llama3, chatml); it begins {head!r}")
        return cls(kind=kind, source=text)

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, object], strict: bool = False) -> ChatTemplate:
        """The format of a GGUF's `tokenizer.chat_template`.

        No template means a base model: kind 'completion'. An unrecognised template also gives
        'completion' (with `note` saying so) unless `strict`, which raises ChatTemplateError.
        """
        text = metadata.get("tokenizer.chat_template")
        if text is None:
            return cls(kind="completion", note="the model has no tokenizer.chat_template (base model)")
        if not isinstance(text, str):
            raise ChatTemplateError(f"metadata 'tokenizer.chat_template': expected a string, got {type(text).__name__}")
        kind = _detect_kind(text)
        if kind is None:
            if strict:
                return cls.from_template_text(text)
            return cls(kind="completion", source=text, note="tokenizer.chat_template not recognised")
        return cls(kind=kind, source=text)

    # -- rendering ---------------------------------------------------------------------------

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Texts that end a reply when they show up as plain text (special tokens stop by id)."""
        return {
            "bitnet": ("<|eot_id|>", "<|end_of_text|>"),
            "llama3": ("<|eot_id|>", "<|start_header_id|>"),
            "chatml": ("<|im_end|>", "<|im_start|>"),
            "completion": (),
        }[self.kind]

    def parts(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> list[_Part]:
        """The conversation as (text, part kind) pieces; see `render_tokens`."""
        msgs = _check_messages(messages)
        out: list[_Part] = []
        if self.kind == "bitnet":
            for role, content in msgs:
                if role == "system":
                    out += [("System: ", "markup"), (content, "content")]
                elif role == "user":
                    out += [("User: ", "markup"), (content, "content"), ("<|eot_id|>", "markup")]
                else:
                    out += [("Assistant: ", "markup"), (content, "reply"), ("<|eot_id|>", "markup")]
            if add_generation_prompt:
                out.append(("Assistant: ", "markup"))
        elif self.kind == "llama3":
            for role, content in msgs:
                header = f"<|start_header_id|>{role}<|end_header_id|>\n\n"
                # llama.cpp and the Llama 3 Jinja template both strip message contents.
                out += [
                    (header, "markup"),
                    (content.strip(), "reply" if role == "assistant" else "content"),
                    ("<|eot_id|>", "markup"),
                ]
            if add_generation_prompt:
                out.append(("<|start_header_id|>assistant<|end_header_id|>\n\n", "markup"))
        elif self.kind == "chatml":
            for role, content in msgs:
                out += [
                    (f"<|im_start|>{role}\n", "markup"),
                    (content, "reply" if role == "assistant" else "content"),
                    ("<|im_end|>\n", "markup"),
                ]
            if add_generation_prompt:
                out.append(("<|im_start|>assistant\n", "markup"))
        else:  # completion: the text as is
            out += [(content, "reply" if role == "assistant" else "content") for role, content in msgs]
        return out

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text (without BOS)."""
        return "".join(text for text, _ in self.parts(messages, add_generation_prompt))

    def render_tokens(
        self,
        tokenizer: Tokenizer,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        add_bos: bool = True,
    ) -> list[int]:
        """Prompt token ids; see the module function `render_tokens`."""
        return render_tokens(tokenizer, self, messages, add_generation_prompt, add_bos)


def _check_messages(messages: Sequence[Mapping[str, str]]) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        content = m.get("content")
        if role not in _ROLES:
            raise ChatTemplateError(f"messages[{i}]['role'] = {role!r}: expected one of {', '.join(_ROLES)}")
        if not isinstance(content, str):
            raise ChatTemplateError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        out.append((role, content))
    return out


def render_tokens(
    tokenizer: Tokenizer,
    template: ChatTemplate,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    add_bos: bool = True,
) -> list[int]:
    """Prompt token ids for `messages`: what the engine feeds the model.

    Template markup is tokenized with special tokens allowed, message contents without, and text
    runs across the markup/content boundary are tokenized as one text (as llama.cpp tokenizes the
    whole rendered prompt). Assistant replies are tokenized on their own, starting right after the
    generation prompt, so that rendering the conversation again with the model's reply appended
    gives the previous prompt's tokens + the reply's tokens + end of turn: the KV cache of a
    multi-turn chat stays a valid prefix.
    """
    ids: list[int] = []
    # BOS as llama.cpp adds it: when asked and the vocabulary says so (tokenizer.ggml.add_bos_token).
    if add_bos and tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)
    chunk: list[tuple[str, bool]] = []
    continuation = False

    def flush() -> None:
        nonlocal continuation
        if chunk:
            ids.extend(tokenizer.encode_segments(chunk, continuation=continuation))
            chunk.clear()
            continuation = True

    for text, part_kind in template.parts(messages, add_generation_prompt):
        if part_kind == "reply":
            flush()
            chunk.append((text, False))
            flush()
        else:
            chunk.append((text, part_kind == "markup"))
    flush()
    return ids
