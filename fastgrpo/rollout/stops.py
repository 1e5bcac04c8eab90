"""Stop strings, found in decoded text on the host, where vLLM and HF `generate` find them.

A stop string is looked for in a completion's text as it reads after its prompt: decode(context + ids) less
decode(context), the context being the prompt's last few tokens, as vLLM's incremental detokenizer reads it. A
SentencePiece (Metaspace) tokenizer drops the leading space of the first token it decodes ("▁Hello" alone is "Hello"),
so in the completion decoded alone a stop string that starts with a space could not match at its first token; after
the prompt it does (HF's StopStringCriteria reads "▁" as a space too). Byte-level tokenizers (Qwen, Llama-3) read the
same either way. Like vLLM (and unlike HF), only the completion's text is searched: a string begun in the prompt does
not count, and a prompt ending in special tokens alone (skipped) gives no context.

A completion stopped by a string ends with the token that completes the string's first occurrence, so its ids,
mask and text agree: the returned text is `tokenizer.decode(ids, skip_special_tokens=True)` of the kept ids. It
holds the stop string and at most the rest of that last token after it, less the leading space a SentencePiece
tokenizer drops when the string starts at the completion's first token (the text that was searched has it).
"""
from __future__ import annotations

import os

import torch

# Bytes of one character a byte-level BPE may split over separate tokens (UTF-8: at most 4).
_TOKENS_PER_CHAR = 4
# Tokens of context a text is decoded after: vLLM primes its detokenizer with a prompt's last 4 (or more) tokens.
CONTEXT_TOKENS = 4


class StopStrings:
    """strings looked for in the completions of `prompts` (token id lists), `num_generations` rows each: the call's
    row n*G+g is sample g of prompt n."""

    def __init__(self, tokenizer, strings: list[str], check_every: int, prompts: list[list[int]],
                 num_generations: int):
        self.tokenizer = tokenizer
        self.strings = strings
        self.contexts = [list(p[-CONTEXT_TOKENS:]) for p in prompts]
        self.num_generations = num_generations
        # tokens that can hold a string completed since the last check: the new ones plus the string's span
        self.tail = check_every + _TOKENS_PER_CHAR * max(len(s) for s in strings)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def text_after(self, context: list[int], ids: list[int]) -> str:
        """ids' text as it reads after context's tokens (an incremental detokenizer's text)."""
        before, text = self.decode(context), self.decode(context + ids)
        if text.startswith(before):
            return text[len(before):]
        # a character split between context and ids reads as U+FFFD in `before`: it belongs to ids' text
        return text[len(os.path.commonprefix((before, text))):]

    def found(self, context: list[int], ids: list[int]) -> bool:
        text = self.text_after(context, ids)
        return any(s in text for s in self.strings)

    def running_hits(self, tokens: torch.Tensor, rows: list[int], call_rows: list[int]) -> list[int]:
        """Rows (of tokens [n, s], on the host: the completions so far) whose recent tokens complete a stop string.

        rows: those still running; call_rows: [n] the call's row of each row of tokens (rows compacted away are
        gone, rollout/compaction.py). The recent tokens are read after the tokens before them: the prompt's while
        they are the whole completion."""
        recent = tokens[:, -(self.tail + CONTEXT_TOKENS):]
        window = min(self.tail, tokens.shape[1])
        hits = []
        for r in rows:
            ids = recent[r].tolist()
            if len(ids) < self.tail + CONTEXT_TOKENS:  # the whole completion: the prompt goes before it
                ids = self.contexts[call_rows[r] // self.num_generations] + ids
            if self.found(ids[-window - CONTEXT_TOKENS:-window], ids[-window:]):
                hits.append(r)
        return hits

    def cut(self, ids: list[int], row: int) -> int | None:
        """Length of the shortest prefix of ids (the completion of the call's `row`) whose text holds a stop string;
        None when the text holds none."""
        context = self.contexts[row // self.num_generations]
        if not self.found(context, ids):
            return None
        lo, hi = 1, len(ids)  # found(ids[:hi]) holds; a prefix's text only grows, so binary search
        while lo < hi:
            mid = (lo + hi) // 2
            if self.found(context, ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        return lo
