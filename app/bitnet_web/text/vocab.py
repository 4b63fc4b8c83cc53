"""Vocabulary facts the tokenizers share: the error type, special token types, end-of-turn texts."""

from __future__ import annotations

from ..formats.ggml import TokenType


class TokenizerError(ValueError):
    """Vocabulary metadata that cannot make a tokenizer, or a token id out of range."""


SPECIAL_TYPES = frozenset({TokenType.CONTROL, TokenType.USER_DEFINED})

# Texts that end a turn in the chat formats we know; any of them present as a special token is a
# stop token (llama.cpp collects the same set into its end-of-generation list).
END_OF_TURN_TEXTS = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
)
