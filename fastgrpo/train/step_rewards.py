"""A GRPO step's rewards: every reward function on every completion, failures handled as config.reward_errors
says, the scores weighted into one reward per completion."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards.scoring import RewardFailure, check_failures, score, warn_unscored
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed


def score_groups(reward_funcs: Sequence[Callable], weights: torch.Tensor, dataset, indices: list[int],
                 completions: list[str], config: GRPOConfig, dist: Distributed,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, RewardFailure]]:
    """Score this process's groups (dataset rows `indices`, num_generations completions each, rows grouped by
    prompt). Returns the whole batch's (all processes') scores per function [N, F] and weighted rewards [N] (NaN
    where no function applied), and this process's failures {function name: failure}.

    A failing function stops the run (reward_errors="raise": every process raises, naming the function and the
    first bad row) or scores its failed samples 0 (reward_errors="skip": logged).
    """
    G = config.num_generations
    rows = [dataset[i] for i in indices]
    prompts = [row[config.prompt_column] for row in rows for _ in range(G)]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != config.prompt_column}
    per_func, failures = score(reward_funcs, prompts, completions, columns)  # per_func: [N, F]

    def describe_row(row: int) -> str:
        return f"dataset row {indices[row // G]} (completion {row % G + 1} of {G})"

    dist.raise_together(lambda: failures and check_failures(
        failures, reward_funcs, prompts, completions, columns, on_error=config.reward_errors,
        describe_row=describe_row))
    rewards = weighted_rewards(per_func, weights)  # rewards: [N]; NaN where no function applied
    warn_unscored(rewards, describe_row)
    return dist.gather_rows(per_func), dist.gather_rows(rewards), failures
