"""What a GRPO run trains on: every dataset row's prompt as token ids (tokenized and checked once, before any
compute), and the rows each step takes (a function of the step, so a resumed run takes what the straight run did)."""
from __future__ import annotations

import functools
import hashlib
import logging
import pickle

import torch

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import as_wrapped, prompt_ids

logger = logging.getLogger(__name__)

# The ids the commands' early check tokenized (keep=True), for the trainer's call to take rather than tokenize every
# prompt again (5,000 prompts: 1-3 s on a CPU core): (tokenizer state, prompt_format), the prompts, their ids.
_kept: tuple | None = None


def prompt_token_ids(dataset, tokenizer, config, *, warn: bool = True, keep: bool = False) -> list[list[int]]:
    """Token ids of every row's prompt in config.prompt_format (fastgrpo.train.prompts; chat messages go through
    the chat template). `config` (a GRPOConfig or an EIConfig) has prompt_column, prompt_format, max_prompt_length
    and truncate_prompts.

    Prompts longer than max_prompt_length raise, naming the longest (the length the limit must reach), unless
    truncate_prompts: then they keep their last max_prompt_length tokens (the end holds the question and the
    generation prompt), said in one warning when `warn`.

    keep: hold the ids for the next call to take where it tokenizes the same prompts in the same format with a
    tokenizer in the same state (pickled alike: another load of the same files), which it then does not repeat.
    """
    prompts = [dataset[index][config.prompt_column] for index in range(len(dataset))]
    ids = _tokenized(prompts, tokenizer, config.prompt_format, keep)
    limit = config.max_prompt_length
    over = [index for index, row in enumerate(ids) if len(row) > limit]
    if not over:
        return ids
    if not config.truncate_prompts:
        raise ValueError(_over_long(ids, over, config))
    if warn:
        shown = ", ".join(map(str, over[:5])) + (", ..." if len(over) > 5 else "")
        logger.warning("dataset: %d of %d prompts over max_prompt_length (%d) left-truncated to their last %d tokens "
                       "(%s): rows %s", len(over), len(ids), limit, limit, setting("truncate_prompts", True), shown)
    return [row[-limit:] for row in ids]


def _tokenized(prompts: list, tokenizer, prompt_format: str, keep: bool) -> list[list[int]]:
    """prompt_ids of each prompt: those kept by the call before where they are of the same prompts, format and
    tokenizer state (taken once: they are not held beyond the call that takes them), else tokenized here."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None and kept[1] == prompts and kept[0] == (_tokenizer_state(tokenizer), prompt_format):
        return kept[2]
    ids = [_row_prompt_ids(prompt, index, tokenizer, prompt_format) for index, prompt in enumerate(prompts)]
    state = _tokenizer_state(tokenizer) if keep else None
    if state is not None:
        _kept = ((state, prompt_format), prompts, ids)
    return ids


def _tokenizer_state(tokenizer) -> bytes | None:
    """A digest of everything the tokenizer's ids follow from (its class and pickled state: vocabulary, merges,
    normalizer, special tokens, chat template); None for one that cannot be pickled (its ids are not kept). A
    151K-token BPE vocabulary: 0.1-0.5 s, where tokenizing 5,000 prompts again took 1-3 s."""
    try:
        return hashlib.sha256(pickle.dumps(tokenizer)).digest()
    except Exception:  # noqa: BLE001 - pickling fails in many ways (a local class, a handle); it then tokenizes
        return None


def _row_prompt_ids(prompt, index: int, tokenizer, prompt_format: str) -> list[int]:
    try:
        return prompt_ids(tokenizer, prompt, prompt_format)
    except ValueError as err:
        raise ValueError(f"dataset: row {index}: {err}") from None


def _over_long(ids: list[list[int]], over: list[int], config) -> str:
    """The error for the rows `over` (of ids) longer than max_prompt_length: the longest, and how many others."""
    longest = max(over, key=lambda index: len(ids[index]))
    others = f", as {len(over) - 1} other row{'s' if len(over) > 2 else ''}' {'are' if len(over) > 2 else 'is'}" \
        if len(over) > 1 else ""
    return (f"dataset: row {longest} has a {len(ids[longest])}-token prompt{as_wrapped(config.prompt_format)}, over "
            f"max_prompt_length ({config.max_prompt_length}){others}; raise {setting('max_prompt_length')} or pass "
            f"{setting('truncate_prompts', True)} to left-truncate")


def step_rows(config: GRPOConfig, dataset_size: int, step: int) -> list[int]:
    """Dataset rows of `step` (batch_size / num_generations of them)."""
    return walk_rows(dataset_size, config.batch_size // config.num_generations, step, config.seed)


def walk_rows(dataset_size: int, per_step: int, step: int, seed: int) -> list[int]:
    """Rows per_step * step .. per_step * (step + 1) - 1 of a run's walk through the data: epochs of permutations
    seeded by seed + epoch, so what a step (or an ei round) takes is a function of its index, and a resumed run takes
    what the straight run did."""
    indices = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(position, dataset_size)
        indices.append(_epoch_order(dataset_size, seed + epoch)[offset])
    return indices


@functools.lru_cache(maxsize=2)  # a step's epoch and the next, which a step crossing the boundary reads too
def _epoch_order(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
