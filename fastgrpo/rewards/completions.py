"""Completions as reward functions get them, as TRL's GRPOTrainer passes them: text for a standard dataset, a list
of messages [{"role": "assistant", "content": text}] for a conversational one (prompts of chat messages); and the
text a built-in reward grades in either form: the text contents of its messages, one after the other."""
from __future__ import annotations


def is_conversational(prompt) -> bool:
    """A prompt of chat messages, as TRL's data_utils.is_conversational tells one: a list whose first item is a dict
    with a role."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def as_trl_passes(prompts: list, completions: list) -> list:
    """The completions (texts) as TRL passes them for these prompts: each as one assistant message when the first
    prompt is chat messages (TRL looks at the first), else as they are. A completion that is not text is kept."""
    if not prompts or not is_conversational(prompts[0]):
        return list(completions)
    return [[{"role": "assistant", "content": c}] if isinstance(c, str) else c for c in completions]


def completion_text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and all(isinstance(m, dict) and "content" in m for m in completion):
        # a tool call's message has no text content (None): nothing of it to grade
        return "\n".join(m["content"] for m in completion if isinstance(m["content"], str))
    raise ValueError(f"completions: expected text or a list of chat messages {{'role': ..., 'content': ...}}, got "
                     f"{completion!r:.80}")


def completion_texts(completions: list) -> list[str]:
    return [completion_text(c) for c in completions]
