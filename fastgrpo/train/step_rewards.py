"""A GRPO step's rewards: every reward function on every completion, failures handled as config.reward_errors
says, the scores weighted into one reward per completion, and the metrics the functions logged (TRL's log_metric)."""
from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Sequence

import torch

from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards.reward_logs import RewardLogs, TakenNames, clash_message, merged_means
from fastgrpo.rewards.scoring import (RewardError, RewardFailure, check_failures, nan_mean, nan_sample_std, score,
                                      warn_unscored)
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


def metric_names(own: Iterable[str], reward_names: Sequence[str]) -> TakenNames:
    """The names a command's metrics take: `own`, rewards/<name> and rewards/<name>/std of each reward function
    (per_function_metrics) and, as a training step's or a round's metrics get them later or on a step where a
    function fails, step_s, eval/... and reward_error/..."""
    per_function = (f"rewards/{name}{suffix}" for name in reward_names for suffix in ("", "/std"))
    return TakenNames(frozenset({*own, "step_s", *per_function}), ("eval/", "reward_error/"))


def per_function_metrics(per_func: torch.Tensor, reward_names: Sequence[str]) -> dict:
    """Each reward function's mean and spread over the batch's completions it scored (per_func [N, F]: the whole
    batch's, every process's rows; NaN where a function returned None), unweighted, as TRL 1.16's GRPOTrainer logs
    rewards/<name>/mean and rewards/<name>/std: nanmean, and nanstd (Bessel's std, None for fewer than two scored).
    The mean keeps fastgrpo's earlier name rewards/<name>. Under torchrun every process computes both from all rows,
    and Distributed.combine_metrics leaves them as they are: a mean of the processes' own stds would miss the spread
    between their rows."""
    metrics = {}
    for j, name in enumerate(reward_names):
        metrics[f"rewards/{name}"] = nan_mean(per_func[:, j])
        metrics[f"rewards/{name}/std"] = nan_sample_std(per_func[:, j])
    return metrics


def refuse_taken(logs: RewardLogs) -> None:
    """Stop the run when a reward function logged a name its command's metrics take (RewardLogs.clash): raised
    as the functions return, before anything changed."""
    if logs.clash is not None:
        raise RewardError(logs.clash)


def score_groups(reward_funcs: Sequence[Callable], weights: torch.Tensor, dataset, indices: list[int], batch: dict,
                 config: GRPOConfig, dist: Distributed, step: int, taken: Container[str] = (),
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, RewardFailure], dict]:
    """Score this process's groups (dataset rows `indices`, num_generations completions each, rows grouped by
    prompt; batch: their rollout, texts and [prompt | completion] ids with the completion mask) at optimizer step
    `step`. Returns the whole batch's (all processes') scores per function [N, F] and weighted rewards [N] (NaN
    where no function applied), this process's failures {function name: failure}, and what the functions logged
    with log_metric on every process ({name: (mean, function)}: merged_means).

    A failing function stops the run (reward_errors="raise": every process raises, naming the function and the
    first bad row) or scores its failed samples 0 (reward_errors="skip": logged). A metric name in `taken` (the
    step's own: metric_names) stops it either way.
    """
    G = config.num_generations
    rows = [dataset[i] for i in indices]
    prompts = [row[config.prompt_column] for row in rows for _ in range(G)]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != config.prompt_column}
    completions = batch["texts"]
    trainer = dict(completion_ids=completion_id_lists(batch["input_ids"], batch["completion_mask"]),
                   trainer_state=trainer_state(step, config.max_steps))
    logs = RewardLogs(taken=taken)
    per_func, failures = score(reward_funcs, prompts, completions, columns, logs=logs, **trainer)  # per_func: [N, F]

    def describe_row(row: int) -> str:
        return f"dataset row {indices[row // G]} (completion {row % G + 1} of {G})"

    dist.raise_together(lambda: refuse_taken(logs) or failures and check_failures(
        failures, reward_funcs, prompts, completions, columns, on_error=config.reward_errors,
        describe_row=describe_row, **trainer))
    rewards = weighted_rewards(per_func, weights)  # rewards: [N]; NaN where no function applied
    warn_unscored(rewards, describe_row)
    logged = merged_means(dist.gather_objects((logs.values, logs.sources)))
    return dist.gather_rows(per_func), dist.gather_rows(rewards), failures, logged


def add_logged_metrics(metrics: dict, logged: dict, taken: Container[str] = ()) -> dict:
    """A step's metrics with the ones its reward functions logged (score_groups), each under its own name as TRL logs
    it. RewardLogs refused the names in `taken` (the command's: metric_names) as they were logged; one that still
    meets a name of `metrics` stops the run all the same: one would hide the other."""
    for name, (value, function) in logged.items():
        if name in metrics or name in taken:
            raise RewardError(clash_message(function, name))
        metrics[name] = value
    return metrics
