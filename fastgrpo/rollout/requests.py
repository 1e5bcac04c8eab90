"""Checks and conversions of a rollout request shared by every engine: prompts to token ids, stop strings and ids,
the pad id, unknown sampling options. Every argument is checked before any model work."""
from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence

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


def split_stop(stop, tokenizer, vocab: int) -> tuple[list[str], list[int]]:
    """stop -> (strings, token ids); a single str or int is a list of one, a special token's text its id."""
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
    strings, special_ids = special_token_stops(tokenizer, strings, vocab)
    return strings, ids + special_ids


def tokenize_prompts(tokenizer, prompts, vocab: int) -> list[list[int]]:
    _check_not_encoded("prompts", prompts)
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts: expected a non-empty list of strings or of token id lists")
    if all(isinstance(p, str) for p in prompts):
        ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    elif any(isinstance(p, dict) or (isinstance(p, Sequence) and p and isinstance(p[0], dict)) for p in prompts):
        raise ValueError("prompts: expected strings or token id lists, got chat messages; apply the chat template "
                         "first (tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))")
    else:
        for i, p in enumerate(prompts):
            _check_not_encoded(f"prompts[{i}]", p)
        ids = [_id_list(p) for p in prompts]
    for i, p in enumerate(ids):
        if p is None or not p:
            raise ValueError(f"prompts[{i}]: expected a non-empty string or token id list, got {prompts[i]!r}")
        bad = next(((j, t) for j, t in enumerate(p) if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise ValueError(f"prompts[{i}]: expected token ids in [0, {vocab}), got {bad[1]!r} at position {bad[0]}")
    return ids


def _check_not_encoded(where: str, value) -> None:
    """A tokenizer's output (transformers 5's apply_chat_template returns one by default) named as such, with the
    fix, rather than echoed whole."""
    if isinstance(value, Mapping) and "input_ids" in value:
        raise ValueError(f"{where}: expected strings or token id lists, got a tokenizer's output "
                         f"({type(value).__name__}); pass its ['input_ids'], or the text of "
                         "tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)")


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


def check_tokenizer(tokenizer) -> None:
    """A tokenizer is needed whatever the prompts: it decodes the completions' texts (and reads text prompts)."""
    if not callable(tokenizer) or not hasattr(tokenizer, "decode"):
        raise ValueError(f"tokenizer: expected a Hugging Face tokenizer (it reads text prompts and decodes the "
                         f"completions), got {type(tokenizer).__name__}")


def pad_token_id(tokenizer, vocab: int) -> int:
    """The id that pads prompts and completions: the tokenizer's pad token, else its EOS, else 0. The padded ids go
    through the model's embedding (the prefill, the trainer's forward), so an id past it is refused."""
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)
    if not 0 <= pad < vocab:
        raise ValueError(f"tokenizer: its pad token id {pad} is outside the model's {vocab} embeddings (a token "
                         "added without resizing them?); call model.resize_token_embeddings(len(tokenizer)) or set "
                         "tokenizer.pad_token = tokenizer.eos_token")
    return pad


def special_token_stops(tokenizer, strings: list[str], vocab: int) -> tuple[list[str], list[int]]:
    """Stop strings -> (strings, token ids): a string that is one special token (e.g. "<|im_end|>") becomes its id.

    Stop strings are looked for in the completion's text, which is decoded with special tokens skipped, so such a
    string would never be found; HF generate's stop_strings stops at the token. A string that holds a special token
    among other text can never match: refused."""
    hidden = _hidden_tokens(tokenizer, strings)
    kept, ids = [], []
    for text in strings:
        if text in hidden:
            if hidden[text] < vocab:  # an id past the logits is never sampled
                ids.append(hidden[text])
            continue
        inside = next((token for token in hidden if token in text), None)
        if inside is not None:
            raise ValueError(f"stop: {text!r} holds the special token {inside!r}, which the completions' text "
                             f"(special tokens skipped) never shows; pass {inside!r} alone to stop at that token")
        kept.append(text)
    return kept, ids


def _hidden_tokens(tokenizer, strings: list[str]) -> dict[str, int]:
    """The added tokens written in `strings` that decode(..., skip_special_tokens=True) drops, by text (non-special
    added tokens, e.g. Qwen3's <think>, stay in the text). Only those are decoded: Gemma-3 adds some 6,000."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token.content: i for i, token in added.items()
            if token.content and any(token.content in text for text in strings)
            and tokenizer.decode([i], skip_special_tokens=True) == ""}


def stop_token_ids(stop_ids: list[int], tokenizer, generation_config) -> list[int]:
    """Every id a row stops at, each once: the request's, the tokenizer's EOS and the generation config's EOS ids (a
    list for chat models, e.g. <|im_end|> and <|endoftext|>), read at each call, as HF generate reads them."""
    eos = [tokenizer.eos_token_id, *as_list(getattr(generation_config, "eos_token_id", None))]
    return list(dict.fromkeys([*stop_ids, *(i for i in eos if i is not None)]))


def as_list(ids) -> list:
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [ids]
