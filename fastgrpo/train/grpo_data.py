"""What a GRPO run trains on: every dataset row's prompt as token ids (tokenized and checked once, before any
compute), and the rows each step takes (a function of the step, so a resumed run takes what the straight run did)."""
from __future__ import annotations

import functools
import logging

import torch

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import as_wrapped
from fastgrpo.train.prompts import prompt_ids as one_prompt_ids  # the name of prompt_token_ids' argument

logger = logging.getLogger(__name__)


def prompt_token_ids(dataset, tokenizer, config, *, warn: bool = True,
                     prompt_ids: list[list[int]] | None = None) -> list[list[int]]:
    """Token ids of every row's prompt in config.prompt_format (tokenized_prompts), within max_prompt_length.
    `config` (a GRPOConfig or an EIConfig) has prompt_column, prompt_format, max_prompt_length and truncate_prompts.

    Prompts longer than max_prompt_length raise, naming the longest (the length the limit must reach), unless
    truncate_prompts: then they keep their last max_prompt_length tokens (the end holds the question and the
    generation prompt), said in one warning when `warn`.

    prompt_ids: the rows' ids as tokenized_prompts gave them, where the caller has them already (the commands' early
    check tokenized them before the model loaded): checked and truncated here, not tokenized again.
    """
    if prompt_ids is None:
        prompt_ids = tokenized_prompts(dataset, tokenizer, config)
    elif len(prompt_ids) != len(dataset):
        raise ValueError(f"prompt_ids: expected the ids of each of the dataset's {len(dataset)} rows, got "
                         f"{len(prompt_ids)}")
    limit = config.max_prompt_length
    over = [index for index, row in enumerate(prompt_ids) if len(row) > limit]
    if not over:
        return prompt_ids
    if not config.truncate_prompts:
        raise ValueError(_over_long(prompt_ids, over, config))
    if warn:
        shown = ", ".join(map(str, over[:5])) + (", ..." if len(over) > 5 else "")
        logger.warning("dataset: %d of %d prompts over max_prompt_length (%d) left-truncated to their last %d tokens "
                       "(%s): rows %s", len(over), len(prompt_ids), limit, limit, setting("truncate_prompts", True),
                       shown)
    return [row[-limit:] for row in prompt_ids]


def tokenized_prompts(dataset, tokenizer, config) -> list[list[int]]:
    """Every row's prompt (its config.prompt_column) in config.prompt_format, whole (fastgrpo.train.prompts; chat
    messages go through the chat template)."""
    prompts = [dataset[index][config.prompt_column] for index in range(len(dataset))]
    return [_row_prompt_ids(prompt, index, tokenizer, config.prompt_format) for index, prompt in enumerate(prompts)]


def _row_prompt_ids(prompt, index: int, tokenizer, prompt_format: str) -> list[int]:
    try:
        return one_prompt_ids(tokenizer, prompt, prompt_format)
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
