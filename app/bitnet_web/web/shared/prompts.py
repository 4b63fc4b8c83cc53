"""What the app sends the engine for a chat turn or a TL;DR. Pure Python."""

from __future__ import annotations

SUMMARY_SYSTEM = "You write short, faithful summaries. Reply with the summary only."
CHARS_PER_TOKEN = 3  # conservative for English BPE: keeps the pasted text inside the context


def clip_to_context(text: str, context_length: int | None, reserve_tokens: int) -> tuple[str, bool]:
    """The text cut so that it (plus `reserve_tokens` for the prompt and the reply) fits the context.
    Returns (text, was_cut). Policy: keep the beginning, where the topic usually is."""
    text = text.strip()
    if not context_length:
        return text, False
    budget = max(0, (context_length - reserve_tokens)) * CHARS_PER_TOKEN
    if len(text) <= budget:
        return text, False
    return text[:budget], True


def summary_messages(text: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SUMMARY_SYSTEM},
        {"role": "user", "content": f"Summarize this text in one or two sentences:\n\n{text}"},
    ]


def summary_prompt(text: str) -> str:
    """For models without a chat template (template_kind 'completion')."""
    return f"{text}\n\nTL;DR:"


def turn_request(
    template_kind: str | None, system: str, history: list[dict[str, str]], text: str
) -> tuple[str, object]:
    """The engine request for the next chat turn: ("chat", messages) for a chat model, or
    ("complete", prompt) for a model without a chat format (template kind "completion"), where the
    conversation is one running document that the model continues (the system prompt is not used).
    `history` holds the earlier turns as {"role", "content"} dicts, without the system prompt."""
    if template_kind == "completion":
        return "complete", "".join(m["content"] for m in history) + text
    system_part = [{"role": "system", "content": system}] if system.strip() else []
    return "chat", system_part + list(history) + [{"role": "user", "content": text}]
