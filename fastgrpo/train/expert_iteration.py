"""Expert iteration: for each round, sample G completions per question with the rollout engine, keep those the
reward marks correct, and fine-tune on them (SFTTrainer on the kept token ids) for sft_epochs; repeat ei_steps times.

A round reads top to bottom in `run_round`: questions -> rollout -> rewards -> keep (reward >= correct_threshold)
-> SFT on the kept (prompt ids, completion ids) pairs, exactly the sampled tokens (no re-tokenization) -> metrics.
Each round starts a fresh AdamW and LR schedule (the data changes every round); checkpoints are per round, so a
resumed run continues at the next round with the weights and RNG states of a straight one. It runs on one process:
under torchrun (WORLD_SIZE > 1) it refuses to start, before any process touches the output folder.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards.scoring import nan_mean, nan_std, reward_names, score, warn_unscored
from fastgrpo.rollout import BuiltinEngine, RolloutEngine
from fastgrpo.rollout.base import accepts_prompt_keys
from fastgrpo.train.checkpoint import (
    check_final_exportable, export_due, export_model, load_latest_checkpoint, nothing_to_train, prune_checkpoints,
    restore_checkpoint, rng_states, save_checkpoint, warn_stale_export,
)
from fastgrpo.train.config import check_resume
from fastgrpo.train.console import ConsoleLog
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.evaluate import check_reward_failures
from fastgrpo.train.input_checks import check_sampling_inputs, reward_list, warn_unapplied_model_fields
from fastgrpo.train.interrupts import InterruptGuard, Interrupted
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.naming import setting
from fastgrpo.train.periodic_eval import ei_evaluator
from fastgrpo.train.prompts import as_wrapped, prompt_ids
from fastgrpo.train.run_dir import RunDirectory
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_data import SFTExample

logger = logging.getLogger(__name__)


def check_one_process() -> None:
    """Expert iteration is not data-parallel: under torchrun (or in a process group of several) each process would
    run the whole of it into one output folder. A one-line refusal instead."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = max(world, torch.distributed.get_world_size())
    if world > 1:
        raise ValueError(f"WORLD_SIZE: expected 1 (expert iteration runs on one process; `fastgrpo train` and "
                         f"`fastgrpo sft` run under torchrun), got {world}; run `fastgrpo ei` without torchrun")


class ExpertIteration:
    def __init__(self, model: torch.nn.Module, tokenizer, reward_funcs: Callable | Sequence[Callable],
                 train_dataset, config: EIConfig | None = None, *, engine: RolloutEngine | None = None):
        """engine: where samples come from (default: BuiltinEngine on the model's own modules)."""
        check_one_process()
        self.config = config = config or EIConfig()
        self.model, self.tokenizer, self.dataset = model, tokenizer, train_dataset
        self.reward_funcs = reward_list(reward_funcs)
        check_sampling_inputs(self.config, self.model, self.tokenizer, self.reward_funcs, self.dataset)
        warn_unapplied_model_fields(model, config)
        self.prompts = []
        for i in range(len(train_dataset)):
            try:
                self.prompts.append(prompt_ids(tokenizer, train_dataset[i][config.prompt_column], config.prompt_format))
            except ValueError as err:
                raise ValueError(f"dataset: row {i}: {err}") from None
            if len(self.prompts[-1]) > config.max_prompt_length:
                raise ValueError(f"dataset: row {i} has a {len(self.prompts[-1])}-token prompt"
                                 f"{as_wrapped(config.prompt_format)}, over max_prompt_length "
                                 f"({config.max_prompt_length})")
        self.engine = engine if engine is not None else BuiltinEngine(model, tokenizer)
        self.sampling = config.sampling()
        self.weights = torch.tensor(config.reward_weights or [1.0] * len(self.reward_funcs), dtype=torch.float64)
        self.round = 0
        self.output_dir = Path(config.output_dir)
        self.history: list[dict] = []
        self.evaluator = ei_evaluator(self)  # None unless eval_steps
        self._guard: InterruptGuard | None = None  # while train() runs
        self.last_kept: list[SFTExample] = []  # the SFT examples of the latest round

    def _questions(self, round_index: int) -> list[int]:
        """Dataset rows of a round: epochs of seeded permutations, so a round's questions depend on its index only."""
        n, per_round = len(self.dataset), self.config.questions_per_step
        orders, indices = {}, []
        for position in range(round_index * per_round, (round_index + 1) * per_round):
            epoch, offset = divmod(position, n)
            if epoch not in orders:
                orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(self.config.seed + epoch))
            indices.append(int(orders[epoch][offset]))
        return indices

    def run_round(self) -> dict:
        config, G = self.config, self.config.num_generations
        t_start = time.perf_counter()

        # 1. Sample G completions per question, generation_batch_size questions per engine call.
        indices = self._questions(self.round)
        rows = [self.dataset[i] for i in indices]
        samples = self._sample(indices)  # (completion ids, text, finish reason) of each of the N completions
        t_rollout = time.perf_counter()

        # 2. Score; keep the completions marked correct, as (prompt ids, sampled completion ids).
        texts = [text for _, text, _ in samples]
        prompts = [row[config.prompt_column] for row in rows for _ in range(G)]
        columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != config.prompt_column}
        per_func, errors = score(self.reward_funcs, prompts, texts, columns)  # per_func: [N, F]
        check_reward_failures(errors, config.reward_errors)
        rewards = weighted_rewards(per_func, self.weights)  # rewards: [N]; NaN where no function applied
        warn_unscored(rewards)
        correct = rewards >= config.correct_threshold  # an unscored completion is not kept
        self.last_kept = kept = [
            SFTExample(tuple(self.prompts[indices[k // G]]), tuple(samples[k][0]))
            for k in correct.nonzero().flatten().tolist() if samples[k][0]
        ]

        # 3. SFT on the kept completions (none kept: the round leaves the weights as they are). From here a signal
        # lets the round finish.
        if self._guard is not None:
            self._guard.abandonable = False
        sft = []
        if kept:
            trainer = SFTTrainer(self.model, self.tokenizer, kept, config.sft_config(self.round))
            sft = [trainer.train_step() for _ in range(trainer.total_steps)]
        else:  # a round that learns nothing; every round alike is a run that cannot start (a setting, not luck)
            logger.warning("round %d: no completion reached correct_threshold %g (best reward %.3g, %d of %d cut at "
                           "max_completion_length): nothing to fine-tune on", self.round + 1,
                           config.correct_threshold, rewards.nan_to_num(-math.inf).max().item(),
                           sum(reason == "length" for _, _, reason in samples), len(samples))
        t_sft = time.perf_counter()

        self.round += 1
        lengths = torch.tensor([len(ids) for ids, _, _ in samples], dtype=torch.float32)
        metrics = {
            "round": self.round,
            "reward": nan_mean(rewards),
            "reward_std": nan_std(rewards),
            **{f"rewards/{name}": nan_mean(per_func[:, j]) for j, name in enumerate(reward_names(self.reward_funcs))},
            "reward_errors": len(errors),
            "kept": len(kept),
            "kept_frac": len(kept) / rewards.numel(),
            "questions_solved_frac": correct.view(-1, G).any(-1).float().mean().item(),
            "sft_steps": len(sft),
            "sft_loss_first": sft[0]["loss"] if sft else None,
            "sft_loss_last": sft[-1]["loss"] if sft else None,
            "completion_length": lengths.mean().item(),
            "truncated_frac": sum(reason == "length" for _, _, reason in samples) / len(samples),
            "rollout_s": t_rollout - t_start,
            "sft_s": t_sft - t_rollout,
        }
        for name, err in errors.items():
            metrics[f"reward_error/{name}"] = err
        return metrics

    def _sample(self, indices: list[int]) -> list[tuple[list[int], str, str]]:
        """(completion token ids, text, finish reason) of num_generations samples per question, in row order."""
        config, G, per_call = self.config, self.config.num_generations, self.config.generation_batch_size
        self.engine.load_weights(self.model)  # the previous round's SFT reaches an engine with its own weights
        self.engine.reacquire_memory()
        keyed, round_seed = accepts_prompt_keys(self.engine), config.seed * 1_000_003 + self.round
        samples = []
        for start in range(0, len(indices), per_call):
            chunk = indices[start:start + per_call]
            # Keyed by the position in the run's walk through the data (unique, also when a round wraps an epoch),
            # so the samples do not depend on generation_batch_size; an engine without keys gets a seed per call.
            first = self.round * config.questions_per_step + start
            keys = {"prompt_keys": list(range(first, first + len(chunk)))} if keyed else {}
            seed = round_seed if keyed else round_seed * 65_537 + start
            out = self.engine.generate([self.prompts[i] for i in chunk], num_generations=G, sampling=self.sampling,
                                       stop=config.stop_strings, seed=seed, **keys)
            ids, mask = out.completion_ids.cpu(), out.completion_mask.cpu().bool()
            samples += [(ids[k][mask[k]].tolist(), out.texts[k], out.finish_reasons[k]) for k in range(len(out.texts))]
        self.engine.release_memory()
        return samples

    def train(self, run_dir: RunDirectory | None = None) -> list[dict]:
        """Run (or, with config.resume, continue) to config.ei_steps rounds; returns this call's round metrics.

        As GRPOTrainer.train: the output folder is locked and a fresh run refuses one holding another run (run_dir:
        a RunDirectory the caller opened already). A signal while a round samples abandons it (the checkpoint is the
        previous round's); once its SFT began, the round finishes, is saved, and Interrupted is raised.
        """
        config = self.config
        with contextlib.ExitStack() as stack:
            if run_dir is None:
                run_dir = stack.enter_context(RunDirectory(self.output_dir))
                run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
            log = MetricsLog(self.output_dir, report_to=config.report_to, run_config=config.to_dict(), key="round")
            if config.resume:
                self.resume()
                if self.round >= config.ei_steps:
                    logger.warning(nothing_to_train(self.output_dir, f"round {self.round}",
                                                    setting("ei_steps", config.ei_steps), "ei_steps"))
            if config.export and self.round < config.ei_steps:  # said before the first round, not after the last
                check_final_exportable(self.output_dir)
            log.start_at(self.round)
            if self.evaluator is not None and self.round == 0:
                log.write({"round": 0, **self.evaluator(0, force=True)})  # the starting point the rounds improve on
            console = ConsoleLog(config.logging_steps, config.ei_steps, initial=self.round,
                                 progress_bar=config.progress_bar, unit="round")
            stack.callback(console.close)
            self._guard = guard = stack.enter_context(InterruptGuard(unit="round"))
            stack.callback(setattr, self, "_guard", None)
            started = saved = self.round if config.resume else None
            while self.round < config.ei_steps:
                rng = rng_states()
                guard.abandonable = True  # until the round's SFT starts
                try:
                    metrics = self.run_round()
                except Interrupted as stop:
                    if not guard.abandonable:
                        raise
                    path = self.save_checkpoint(rng) if self.round > 0 and saved != self.round else None
                    raise stop.saved(self.round, path) from None
                if self.evaluator is not None:
                    metrics.update(self.evaluator(self.round, force=self.round == config.ei_steps))
                self.history.append(metrics)
                log.write(metrics)
                console.add({**metrics, "loss": metrics["sft_loss_last"]})
                if (config.save_steps and self.round % config.save_steps == 0) or guard.requested:
                    path, saved = self.save_checkpoint(), self.round
                if guard.requested:
                    raise guard.interrupted(self.round, path)
            if saved != self.round:
                self.save_checkpoint()
            if config.export and export_due(self.output_dir, self.round, self.round != started):
                export_model(self.model, self.tokenizer, self.output_dir / "final", run_config=config.to_dict(),
                             step=self.round)
            elif not config.export:
                warn_stale_export(self.output_dir, self.round)
        return self.history

    def save_checkpoint(self, rng: dict | None = None) -> Path:
        """checkpoint-<round> (weights, RNG states, round); the oldest past save_total_limit are deleted."""
        state = {"step": self.round, "round": self.round, "config": self.config.to_dict(),
                 **({"rng": rng} if rng is not None else {})}
        path = save_checkpoint(self.output_dir / f"checkpoint-{self.round}", self.model, state)
        prune_checkpoints(self.output_dir, self.config.save_total_limit, self.round)
        return path

    def resume(self) -> None:
        """Load the newest complete round checkpoint of output_dir: weights, RNG states, round."""
        path, state = load_latest_checkpoint(self.output_dir)
        check_resume(state.get("config", {}), self.config, path.name)
        self.round = restore_checkpoint(state, self.model)["round"]
        logger.info("resumed from %s after round %d", path, self.round)
