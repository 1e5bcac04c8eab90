"""What a GRPO run trains on: every dataset row's prompt as token ids (tokenized and checked once, before any
compute), and the rows each step takes (a function of the step, so a resumed run takes what the straight run did)."""
from __future__ import annotations

import functools
import logging

import torch

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import as_wrapped, prompt_ids

logger = logging.getLogger(__name__)


def prompt_token_ids(dataset, tokenizer, config, *, warn: bool = True) -> list[list[int]]:
    """Token ids of every row's prompt in config.prompt_format (fastgrpo.train.prompts; chat messages go through
    the chat template). `config` (a GRPOConfig or an EIConfig) has prompt_column, prompt_format, max_prompt_length
    and truncate_prompts.

    Prompts longer than max_prompt_length raise, naming the longest (the length the limit must reach), unless
    truncate_prompts: then they keep their last max_prompt_length tokens (the end holds the question and the
    generation prompt), said in one warning when `warn`.
    """
    ids = [_row_prompt_ids(dataset[index][config.prompt_column], index, tokenizer, config.prompt_format)
           for index in range(len(dataset))]
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
