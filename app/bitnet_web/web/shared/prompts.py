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


def reply_room(context_length: int, max_tokens: int) -> int:
    """Tokens of the context kept free for the reply (as the engine's chat policy: at most half)."""
    return min(max(1, int(max_tokens)), context_length // 2)


def keep_recent_tokens(ids: list[int], budget: int, keep_first: int = 0, min_keep: int = 0) -> list[int]:
    """The completion-mode context policy: the first `keep_first` ids (BOS) and the most recent ones,
    at most `budget` ids in all. The cut moves in steps of half the budget, counted from the start,
    so the same cut is chosen turn after turn and the engine reuses its cached prefix until the text
    has grown by another half budget; it never cuts into the last `min_keep` ids (the latest message)
    when those fit."""
    if len(ids) <= budget:
        return list(ids)
    step = max(1, budget // 2)
    needed = len(ids) - budget
    drop = -(-needed // step) * step
    drop = max(needed, min(drop, len(ids) - keep_first - min_keep))
    return list(ids[:keep_first]) + list(ids[keep_first + drop :])
