"""Stop strings, found in decoded text on the host (HF `generate` semantics).

A completion stopped by a string ends with the token that completes the string's first occurrence, so its ids,
mask and text agree: the text is the decode of the kept ids (it contains the stop string, and at most the rest
of that last token after it). Text is always `tokenizer.decode(ids, skip_special_tokens=True)`.
"""
from __future__ import annotations

import torch

# Bytes of one character a byte-level BPE may split over separate tokens (UTF-8: at most 4).
_TOKENS_PER_CHAR = 4


class StopStrings:
    def __init__(self, tokenizer, strings: list[str], check_every: int):
        self.tokenizer = tokenizer
        self.strings = strings
        # tokens that can hold a string completed since the last check: the new ones plus the string's span
        self.tail = check_every + _TOKENS_PER_CHAR * max(len(s) for s in strings)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def found(self, ids: list[int]) -> bool:
        text = self.decode(ids)
        return any(s in text for s in self.strings)

    def running_hits(self, tokens: torch.Tensor, rows: list[int]) -> list[int]:
        """Rows (of tokens [N, s], on the host) whose recent tokens complete a stop string."""
        return [r for r in rows if self.found(tokens[r, -self.tail:].tolist())]

    def cut(self, ids: list[int]) -> int | None:
        """Length of the shortest prefix of ids whose text holds a stop string; None when the text holds none."""
        if not self.found(ids):
            return None
        lo, hi = 1, len(ids)  # found(ids[:hi]) holds; a prefix's text only grows, so binary search
        while lo < hi:
            mid = (lo + hi) // 2
            if self.found(ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo
