"""Prompts: chat messages rendered to token ids with the policy's own chat template."""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl_common.messages import ChatMessage


class PromptError(ValueError):
    """A prompt that can never be served by this model (the request is dead-lettered)."""


def require_chat_template(tokenizer, model: str) -> None:
    """Refuse a tokenizer without a chat template: the prompt format would be guesswork."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {model} has no chat template; the generator renders prompts "
            "with the model's own template (use an instruct/chat model, or add one to "
            "tokenizer_config.json / chat_template.jinja)"
        )


def render_prompt(tokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    # Some tokenizer versions still wrap the ids in a mapping or a batch of one.
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(i) for i in ids]


def completion_budget(prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """Tokens a completion may have: the request's max_tokens, capped by the context left."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise PromptError(
            f"prompt of {prompt_tokens} tokens leaves no room for a completion "
            f"(max_model_len {max_model_len})"
        )
    return min(max_tokens, room)
