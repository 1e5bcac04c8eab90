"""The text a built-in reward grades: a completion as fastgrpo passes it (a string), or as TRL (and so
FastGRPOTrainer) passes it for a conversational dataset, a list of messages [{"role": "assistant", "content": text}]:
the text contents of its messages, one after the other."""
from __future__ import annotations


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
