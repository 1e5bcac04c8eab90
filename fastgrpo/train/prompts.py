"""Prompt and response token ids of a dataset row, one rule for `fastgrpo train`, `sft`, `ei` and `eval`.

Prompt formats:
  raw      text as it is (tokenized with the tokenizer's special tokens); a list of chat messages goes through the
           chat template.
  chat     the tokenizer's chat template; a text prompt is one user message.
  auto     chat when the tokenizer has a chat template, else raw.
  r1_zero  the R1-Zero prompt (R1_ZERO_PROMPT) around the text, then raw: the course's format for base models, and
           the one the `r1_zero_math` reward grades (`... </think> <answer> ... </answer>`).
A response is the assistant turn of the chat template where the prompt went through it (its end-of-turn token
included), else its text followed by the EOS token (once: not after a text that ends with it), so that a trained
model learns to stop. The prompt is tokenized alone, exactly as generation sees it, and the response on its own: a
BPE merge across the boundary (prompt "... t", response "here") cannot move it. TRL tokenizes the joined text and
starts the completion where it diverges from the prompt's tokens, training on a context generation never shows.
"""
from __future__ import annotations

from collections.abc import Sequence

from fastgrpo._checks import check_choice
from fastgrpo.train.naming import setting

PROMPT_FORMATS = ("raw", "chat", "auto", "r1_zero")
R1_ZERO_PROMPT = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. The Assistant "
    "first thinks about the reasoning process in the mind and then provides the User with the answer. The reasoning "
    "process is enclosed within <think> </think> and answer is enclosed within <answer> </answer> tags, respectively, "
    "i.e., <think> reasoning process here </think> <answer> answer here </answer>.\nUser: {question}\n"
    "Assistant: <think>"
)
# Generation stops at the closing tag under r1_zero: the reward reads nothing after it.
R1_ZERO_STOP = ["</answer>"]


def stop_strings(stop: list[str] | None, prompt_format: str, reward_funcs: Sequence[str] = ()) -> list[str] | None:
    """A config's stop strings: its own, or where it sets none and prompts in the r1_zero format (or, for an
    evaluation, grades with r1_zero_math) the closing answer tag."""
    r1_zero = prompt_format == "r1_zero" or "r1_zero_math" in reward_funcs
    return stop if stop is not None or not r1_zero else list(R1_ZERO_STOP)


def as_wrapped(prompt_format: str) -> str:
    """For an error about a prompt's length: under r1_zero, a note that the count is the template's, not the
    question's (a 7-character question is a ~400-token prompt); else ""."""
    if prompt_format != "r1_zero":
        return ""
    return f" as {setting('prompt_format', 'r1_zero')} wraps it (raw: as written)"


def uses_chat_template(tokenizer, prompt, prompt_format: str) -> bool:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    check_prompt_format(prompt, prompt_format, has_template)
    if prompt_format == "r1_zero":
        return False
    return not isinstance(prompt, str) or prompt_format == "chat" or (prompt_format == "auto" and has_template)


def check_prompt_format(prompt, prompt_format: str, has_chat_template: bool) -> None:
    """A ValueError for a prompt that prompt_format cannot take with a tokenizer that has (or lacks) a chat
    template: chat messages under r1_zero, and a template needed (by chat messages; by any prompt under 'chat')
    that the tokenizer lacks. Needs no tokenizer: the commands check every row's before the model loads."""
    check_choice("prompt_format", prompt_format, PROMPT_FORMATS)
    check_prompt(prompt)
    if prompt_format == "r1_zero":
        prompt_text(prompt, prompt_format)
    elif not has_chat_template and not isinstance(prompt, str):
        raise ValueError(f"chat messages need a chat template, and the model's tokenizer has none: give text prompts "
                         f"({setting('prompt_format')} raw, auto or r1_zero) or a model whose tokenizer has a chat "
                         "template")
    elif not has_chat_template and prompt_format == "chat":
        raise ValueError("prompt_format: 'chat' needs a tokenizer with a chat template; use 'raw' or 'auto'")


def chat_messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return list(prompt)
    raise ValueError(f"prompt: expected a string or a list of chat messages {{'role': ..., 'content': ...}}, "
                     f"got {type(prompt).__name__}")


def check_prompt(prompt) -> None:
    """A ValueError unless `prompt` is text or a list of chat messages (chat_messages), which needs no tokenizer:
    the commands check every row's before the model loads."""
    if not isinstance(prompt, str):
        chat_messages(prompt)


def check_response(response) -> None:
    if not isinstance(response, str):
        raise ValueError(f"response: expected a string, got {type(response).__name__}")


def _ids(encoded) -> list[int]:
    """apply_chat_template(tokenize=True) returns a list, or a BatchEncoding, depending on the transformers version."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def prompt_text(prompt, prompt_format: str) -> str | list:
    """The prompt after the R1-Zero template (other formats: unchanged)."""
    if prompt_format != "r1_zero":
        return prompt
    if not isinstance(prompt, str):
        raise ValueError("prompt_format: 'r1_zero' wraps a text question; got chat messages (use 'chat' or 'raw')")
    return R1_ZERO_PROMPT.format(question=prompt)


def prompt_ids(tokenizer, prompt, prompt_format: str) -> list[int]:
    """Token ids of a prompt (text or chat messages) in `prompt_format`, ready for generation: one or more (a template
    that writes only the contents renders an empty question as none)."""
    if uses_chat_template(tokenizer, prompt, prompt_format):
        messages = chat_messages(prompt)
        ids = _ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    else:  # a text prompt (uses_chat_template takes every other), r1_zero-wrapped or as it is
        ids = list(tokenizer(prompt_text(prompt, prompt_format), add_special_tokens=True)["input_ids"])
    if not ids:
        raise ValueError(f"prompt: {prompt!r} has no tokens (the engine generates from a prompt's last token)")
    return ids


def response_ids(tokenizer, prompt, response: str, prompt_format: str) -> list[int]:
    """Token ids of `response` as it follows prompt_ids(tokenizer, prompt, prompt_format)."""
    check_response(response)
    if uses_chat_template(tokenizer, prompt, prompt_format):
        messages = chat_messages(prompt)
        head = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False
        )
        # The assistant turn is what the full conversation adds after the generation prompt (its end-of-turn token
        # included); templates that rewrite earlier turns (e.g. drop reasoning) fall back to text + EOS below.
        if full.startswith(head):
            return list(tokenizer(full[len(head):], add_special_tokens=False)["input_ids"])
    ids = list(tokenizer(response, add_special_tokens=False)["input_ids"])
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer: needs an eos_token_id (appended to each response so the model learns to stop)")
    # a response whose text ends with the EOS token already has it (as TRL checks): once, not twice
    return ids if ids[-1:] == [tokenizer.eos_token_id] else ids + [tokenizer.eos_token_id]
