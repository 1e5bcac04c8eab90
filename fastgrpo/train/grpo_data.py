"""What a GRPO run trains on: every dataset row's prompt as token ids (tokenized and checked once, before any
compute), and the rows each step takes (a function of the step, so a resumed run takes what the straight run did)."""
from __future__ import annotations

import functools
import logging

import torch

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import prompt_ids

logger = logging.getLogger(__name__)


def prompt_token_ids(dataset, tokenizer, config: GRPOConfig) -> list[list[int]]:
    """Token ids of every row's prompt in config.prompt_format (fastgrpo.train.prompts; chat messages go through
    the chat template).

    Prompts longer than max_prompt_length raise, unless truncate_prompts: then they keep their last
    max_prompt_length tokens (the end holds the question and the generation prompt), with a warning.
    """
    return [_row_prompt_ids(dataset[index][config.prompt_column], index, tokenizer, config)
            for index in range(len(dataset))]


def _row_prompt_ids(prompt, index: int, tokenizer, config: GRPOConfig) -> list[int]:
    try:
        ids = prompt_ids(tokenizer, prompt, config.prompt_format)
    except ValueError as err:
        raise ValueError(f"dataset: row {index}: {err}") from None
    limit = config.max_prompt_length
    if len(ids) > limit:
        if not config.truncate_prompts:
            raise ValueError(f"dataset: row {index} has a {len(ids)}-token prompt, over max_prompt_length "
                             f"({limit}); raise {setting('max_prompt_length')} or pass "
                             f"{setting('truncate_prompts', True)} to left-truncate")
        logger.warning("row %d: prompt of %d tokens left-truncated to max_prompt_length=%d", index, len(ids), limit)
        ids = ids[-limit:]
    return list(ids)


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
