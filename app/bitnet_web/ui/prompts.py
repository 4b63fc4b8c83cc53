"""Prompts the app writes itself (the TL;DR widget). Pure Python."""

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
    return [{"role": "system", "content": SUMMARY_SYSTEM},
            {"role": "user", "content": f"Summarize this text in one or two sentences:\n\n{text}"}]


def summary_prompt(text: str) -> str:
    """For models without a chat template (template_kind 'completion')."""
    return f"{text}\n\nTL;DR:"
