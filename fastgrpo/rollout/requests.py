"""Checks and conversions of a rollout request shared by every engine: prompts to token ids, stop strings and ids,
the pad id, unknown sampling options. Every argument is checked before any model work."""
from __future__ import annotations

import difflib
from collections.abc import Sequence

import torch

from fastgrpo.rollout.sampling import SamplingParams

OPTIONS = (
    "num_generations", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop",
    "seed",
)


def check_request(num_generations, seed, sampling) -> None:
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling: expected a fastgrpo.rollout.SamplingParams (SamplingParams(max_new_tokens=..., "
                         f"...)), got {type(sampling).__name__}")
    if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations: expected an int >= 1, got {num_generations!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed: expected an int or None, got {seed!r}")


def unknown_options_message(unknown: dict) -> str:
    parts = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, OPTIONS, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"unknown sampling option {', '.join(parts)}: expected one of {list(OPTIONS)}"


def split_stop(stop, vocab: int) -> tuple[list[str], list[int]]:
    """stop -> (strings, token ids); a single str or int is a list of one."""
    if stop is None:
        return [], []
    items = [stop] if isinstance(stop, (str, int)) else stop
    if not isinstance(items, Sequence):
        raise ValueError(f"stop: expected a str, an int or a list of them, got {type(stop).__name__}")
    strings, ids = [], []
    for item in items:
        if isinstance(item, str) and item:
            strings.append(item)
        elif isinstance(item, int) and not isinstance(item, bool) and 0 <= item < vocab:
            ids.append(item)
        else:
            raise ValueError(f"stop: expected non-empty strings or token ids in [0, {vocab}), got {item!r}")
    return strings, ids


def tokenize_prompts(tokenizer, prompts, vocab: int) -> list[list[int]]:
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a non-empty list of strings or of token id lists")
    if all(isinstance(p, str) for p in prompts):
        if not callable(tokenizer):
            raise ValueError(f"tokenizer: expected a Hugging Face tokenizer to read text prompts, got "
                             f"{type(tokenizer).__name__}")
        ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    elif any(isinstance(p, dict) or (isinstance(p, Sequence) and p and isinstance(p[0], dict)) for p in prompts):
        raise ValueError("prompts: expected strings or token id lists, got chat messages; apply the chat template "
                         "first (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))")
    else:
        ids = [_id_list(p) for p in prompts]
    for i, p in enumerate(ids):
        if p is None or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty string or token id list, got {prompts[i]!r}")
        bad = next(((j, t) for j, t in enumerate(p) if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompts[{i}]: expected token ids in [0, {vocab}), got {bad[1]!r} at position {bad[0]}")
    return ids


def _id_list(prompt) -> list | None:
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
        return prompt.tolist()
    return list(prompt) if isinstance(prompt, Sequence) and not isinstance(prompt, str) else None


def check_lengths(config, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    limit = getattr(config, "max_position_embeddings", None)
    if limit is None:
        return
    longest = max(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    n = len(prompt_ids[longest])
    if n + max_new_tokens > limit:
        raise ValueError(
            f"prompts[{longest}]: {n} tokens + max_new_tokens {max_new_tokens} = {n + max_new_tokens} exceeds the "
            f"model's max_position_embeddings {limit}; shorten the prompt or lower max_new_tokens"
        )


def pad_token_id(tokenizer) -> int:
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad is not None:
            return pad
    return 0


def as_list(ids) -> list:
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]
