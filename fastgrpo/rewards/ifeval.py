"""IFEval-style verifiable constraints: each a pure check of the text, combined by `ifeval_reward`.

A dataset row carries `constraints`: a list of {"type": <name in CONSTRAINTS>, **arguments}, e.g.
[{"type": "num_words", "min": 50}, {"type": "forbidden_keywords", "keywords": ["sorry"]}]. An argument set to None is
left out (a Hugging Face dataset stores such a column as one struct: every constraint gets every key, None where
unset). A row ifeval_reward cannot read is refused before anything runs (value_checks; the trainer's dataset check).
"""
from __future__ import annotations

import json
import re

from fastgrpo.rewards.completions import completion_texts

_SENTENCE_END = re.compile(r"[.!?]+(?:\s|$)")


def num_words(text: str, min: int | None = None, max: int | None = None) -> bool:
    n = len(text.split())
    return (min is None or n >= min) and (max is None or n <= max)


def num_sentences(text: str, min: int | None = None, max: int | None = None) -> bool:
    stripped = text.strip()
    n = len(_SENTENCE_END.findall(stripped)) + (1 if stripped and stripped[-1] not in ".!?" else 0)
    return (min is None or n >= min) and (max is None or n <= max)


def num_paragraphs(text: str, min: int | None = None, max: int | None = None) -> bool:
    n = len([p for p in re.split(r"\n\s*\n", text) if p.strip()])
    return (min is None or n >= min) and (max is None or n <= max)


def _words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


def _has(text: str, keyword: str) -> bool:
    # Single words match whole words ("cat" is not in "concatenate"); phrases match as substrings.
    kw = keyword.lower()
    return kw in _words(text) if re.fullmatch(r"\w+", kw) else kw in text.lower()


def required_keywords(text: str, keywords: list[str]) -> bool:
    return all(_has(text, k) for k in keywords)


def forbidden_keywords(text: str, keywords: list[str]) -> bool:
    return not any(_has(text, k) for k in keywords)


def json_output(text: str) -> bool:
    """The whole response parses as JSON, optionally inside one ```json fence."""
    body = text.strip()
    fenced = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.DOTALL | re.IGNORECASE)  # ```JSON too, as IFEval
    try:
        json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return False
    return True


def letter_case(text: str, case: str) -> bool:
    """case 'upper' or 'lower': every cased letter is in it (a text with no letters passes neither)."""
    if case not in ("upper", "lower"):
        raise ValueError(f"constraints: letter_case expects case 'upper' or 'lower', got {case!r}")
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return False
    return all(c.isupper() for c in letters) if case == "upper" else all(c.islower() for c in letters)


def starts_with(text: str, prefix: str) -> bool:
    return text.lstrip().startswith(prefix)


def ends_with(text: str, suffix: str) -> bool:
    return text.rstrip().endswith(suffix)


CONSTRAINTS = {
    "num_words": num_words,
    "num_sentences": num_sentences,
    "num_paragraphs": num_paragraphs,
    "required_keywords": required_keywords,
    "forbidden_keywords": forbidden_keywords,
    "json_output": json_output,
    "letter_case": letter_case,
    "starts_with": starts_with,
    "ends_with": ends_with,
}


def check_constraint(text: str, constraint: dict) -> bool:
    """One constraint {"type": name, **arguments}; an unknown type or bad arguments raise ValueError."""
    if not isinstance(constraint, dict):
        raise ValueError(f"constraints: expected a dict {{'type': name, **arguments}}, got {constraint!r}")
    kind = constraint.get("type")
    if kind not in CONSTRAINTS:
        raise ValueError(f"constraints: unknown type {kind!r}, expected one of {sorted(CONSTRAINTS)}")
    args = {k: v for k, v in constraint.items() if k != "type" and v is not None}
    try:
        return bool(CONSTRAINTS[kind](text, **args))
    except TypeError as err:
        raise ValueError(f"constraints: bad arguments {args} for {kind!r}: {err}") from None


def row_constraints(row) -> list:
    """A row's constraints as a list: one dict alone, or a list of them; anything else is a ValueError."""
    if isinstance(row, dict):
        return [row]
    if not isinstance(row, (list, tuple)):
        raise ValueError(f"constraints: expected a list of constraints {{'type': name, **arguments}}, got {row!r:.80}")
    return list(row)


def check_row(row) -> None:
    """A ValueError naming the first constraint of `row` that ifeval_reward cannot read (each is tried on an empty
    text, which checks its type and arguments), None when it can read them all."""
    for constraint in row_constraints(row):
        check_constraint("", constraint)


def ifeval_reward(prompts: list, completions: list, constraints: list[list[dict]], **kwargs) -> list[float]:
    """The fraction of each row's constraints the completion satisfies (1.0 = all), in [0, 1]."""
    rewards = []
    for text, row in zip(completion_texts(completions), constraints):
        row = row_constraints(row)
        rewards.append(sum(check_constraint(text, c) for c in row) / len(row) if row else 1.0)
    return rewards


# The rows are checked before anything runs (fastgrpo.rewards.scoring.check_column_values).
ifeval_reward.value_checks = {"constraints": check_row}
