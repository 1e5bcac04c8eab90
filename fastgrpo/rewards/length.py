"""A length reward: 1.0 at `target_length` characters, falling linearly to 0.0 at 0 and at twice the target."""
from __future__ import annotations

from fastgrpo.rewards.completions import completion_texts


def length_reward(prompts: list, completions: list, target_length: int | list[int] = 256, **kwargs) -> list[float]:
    """1 - |len - target| / target, clipped to [0, 1]; `target_length` may be a dataset column (one per row)."""
    targets = target_length if isinstance(target_length, (list, tuple)) else [target_length] * len(completions)
    texts = completion_texts(completions)
    return [max(0.0, 1.0 - abs(len(text) - t) / t) if t > 0 else 0.0 for text, t in zip(texts, targets)]
