"""A GRPO step's rewards: every reward function on every completion, failures handled as config.reward_errors
says, the scores weighted into one reward per completion."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards.scoring import RewardFailure, check_failures, score, warn_unscored
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed


def trainer_state(global_step: int = 0, max_steps: int = 0):
    """transformers' TrainerState as TRL's GRPOTrainer passes it to reward functions (`trainer_state`): the
    optimizer steps done (rounds, under `ei`) and the run's total, for rewards shaped by training progress."""
    from transformers import TrainerState

    return TrainerState(global_step=global_step, max_steps=max_steps)


def completion_id_lists(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """Each completion's token ids (ids [N, L] where mask [N, L] is set: the stop token included), as TRL passes
    them to reward functions (`completion_ids`)."""
    ids, mask = ids.cpu(), mask.cpu().bool()
    return [row[keep].tolist() for row, keep in zip(ids, mask)]


def score_groups(reward_funcs: Sequence[Callable], weights: torch.Tensor, dataset, indices: list[int], batch: dict,
                 config: GRPOConfig, dist: Distributed, step: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, RewardFailure]]:
    """Score this process's groups (dataset rows `indices`, num_generations completions each, rows grouped by
    prompt; batch: their rollout, texts and [prompt | completion] ids with the completion mask) at optimizer step
    `step`. Returns the whole batch's (all processes') scores per function [N, F] and weighted rewards [N] (NaN
    where no function applied), and this process's failures {function name: failure}.

    A failing function stops the run (reward_errors="raise": every process raises, naming the function and the
    first bad row) or scores its failed samples 0 (reward_errors="skip": logged).
    """
    G = config.num_generations
    rows = [dataset[i] for i in indices]
    prompts = [row[config.prompt_column] for row in rows for _ in range(G)]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != config.prompt_column}
    completions = batch["texts"]
    trainer = dict(completion_ids=completion_id_lists(batch["input_ids"], batch["completion_mask"]),
                   trainer_state=trainer_state(step, config.max_steps))
    per_func, failures = score(reward_funcs, prompts, completions, columns, **trainer)  # per_func: [N, F]

    def describe_row(row: int) -> str:
        return f"dataset row {indices[row // G]} (completion {row % G + 1} of {G})"

    dist.raise_together(lambda: failures and check_failures(
        failures, reward_funcs, prompts, completions, columns, on_error=config.reward_errors,
        describe_row=describe_row, **trainer))
    rewards = weighted_rewards(per_func, weights)  # rewards: [N]; NaN where no function applied
    warn_unscored(rewards, describe_row)
    return dist.gather_rows(per_func), dist.gather_rows(rewards), failures
