"""Expert iteration: for each round, sample G completions per question with the rollout engine, keep those the
reward marks correct, and fine-tune on them (SFTTrainer on the kept token ids) for sft_epochs; repeat ei_steps times.

A round reads top to bottom in `run_round`: questions -> rollout -> rewards -> keep (reward >= correct_threshold;
a question's completion sampled twice, once: distinct_correct) -> SFT on the kept (prompt ids, completion ids)
pairs, exactly the sampled tokens (no re-tokenization), masked as sft's rows -> metrics (with the means of what the
reward functions logged with TRL's log_metric over the round, as a training step's).
Each round starts a fresh AdamW and LR schedule (the data changes every round); checkpoints are per round, so a
resumed run continues at the next round with the weights and RNG states of a straight one.

Under torchrun (`torchrun --nproc_per_node N -m fastgrpo ei ...`, or a process group the caller started) a round is
data-parallel: each process samples and scores every N-th of the round's questions, with the built-in engine's
sampling noise keyed by the question's position in the run (so the samples are the ones one process would draw),
and the round's completions and rewards are gathered in the round's order, the same on every process; every process
then keeps the same examples and the SFT runs data-parallel as `fastgrpo sft` does (fastgrpo.train.sft: DDP for
LoRA, FSDP2 for full fine-tuning, the model wrapped once for every round). Rank 0 owns the output folder, the
metrics and the export; the processes agree on when to save and stop.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastgrpo.hf.peft import check_layer_adapters
from fastgrpo.loss.grpo import weighted_rewards
from fastgrpo.rewards.reward_logs import RewardLogs, merged_means
from fastgrpo.rewards.scoring import RewardError, nan_mean, nan_sample_std, reward_names, score, warn_unscored
from fastgrpo.rollout import BuiltinEngine, RolloutEngine
from fastgrpo.rollout.base import accepts_prompt_keys
from fastgrpo.train.checkpoint import apply_save_limit, rng_states
from fastgrpo.train.console import ConsoleLog
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.evaluate import check_reward_failures
from fastgrpo.train.final_export import export_at_end, export_model, nothing_to_train
from fastgrpo.train.grpo_data import prompt_token_ids, walk_rows
from fastgrpo.train.input_checks import (
    check_sampling_inputs, reward_list, warn_adapter_schedules, warn_unapplied_model_fields,
)
from fastgrpo.train.interrupts import InterruptGuard, Interrupted
from fastgrpo.train.loop_checkpoints import restore_newest, resumed_at, write_checkpoint
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.naming import setting
from fastgrpo.train.periodic_eval import ei_evaluator
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft import check_process_split as check_sft_split
from fastgrpo.train.sft_data import SFTExample
from fastgrpo.train.start_line import log_start, steps
from fastgrpo.train.step_end import end_step
from fastgrpo.train.step_rewards import (add_logged_metrics, metric_names, per_function_metrics, refuse_taken,
                                         trainer_state)

logger = logging.getLogger(__name__)
# The names of a round's metrics (run_round), which log_metric may not take
ROUND_METRICS = ("round", "reward", "reward_std", "reward_errors", "kept", "kept_repeats_dropped", "kept_frac",
                 "questions_solved_frac", "sft_steps", "sft_loss_first", "sft_loss_last", "completion_length",
                 "truncated_frac", "rollout_s", "sft_s")


def check_process_split(config: EIConfig, world_size: int) -> None:
    """Under torchrun each process samples some of a round's questions and runs an equal share of each SFT step's
    micro-batches (the CLI checks before it prepares the output folder: --overwrite-output-dir deletes)."""
    if config.questions_per_step < world_size:
        raise ValueError(f"questions_per_step: expected at least {world_size} (each of the {world_size} processes "
                         f"samples some of a round's questions), got {config.questions_per_step}")
    check_sft_split(config, world_size)


def gather_round(dist: Distributed, positions: list[int], samples: list, per_func: torch.Tensor, failures: dict,
                 num_generations: int) -> tuple[list, torch.Tensor, dict]:
    """Every process's share of a round -> the whole round's samples, rewards [N, F] and reward failures {name:
    message}, in the round's order, the same on every process: what one process sampling it all has. positions: the
    round's questions this process sampled (num_generations samples each, in `samples` and `per_func`)."""
    G, by_position, failed_on = num_generations, {}, {}
    # the failures as plain text: a RewardFailure does not unpickle
    shares = dist.gather_objects((positions, samples, per_func, {name: str(err) for name, err in failures.items()}))
    for rank, (own, part, rewards, errors) in enumerate(shares):
        by_position.update({p: (part[i * G:(i + 1) * G], rewards[i * G:(i + 1) * G]) for i, p in enumerate(own)})
        for name, err in errors.items():
            failed_on.setdefault(name, []).append((rank, err))
    ordered = [by_position[p] for p in sorted(by_position)]
    merged = {name: _merged_failure(found, dist.world_size) for name, found in failed_on.items()}
    return [s for part, _ in ordered for s in part], torch.cat([rewards for _, rewards in ordered]), merged


def _merged_failure(found: list[tuple[int, str]], world_size: int) -> str:
    """One function's failure messages from the processes it failed on, [(rank, message)], as one: the first's,
    whose row counts are of that process's share alone, so it says so and which processes failed too."""
    rank, message = found[0]
    if world_size == 1:
        return message
    others = [str(r) for r, _ in found[1:]]
    also = f"; process{'es' if len(others) > 1 else ''} {', '.join(others)} failed too" if others else ""
    return f"{message} (in process {rank}'s share of the round{also})"


def distinct_correct(prompts: list[list[int]], completions: list[list[int]], correct: torch.Tensor,
                     num_generations: int) -> tuple[list[SFTExample], int]:
    """The SFT examples (prompt ids, sampled completion ids) of a round's correct, non-empty completions, each
    distinct completion of a question once, and how many repeats were dropped. completions: num_generations per
    question of `prompts`, in order; correct: [N] bool. A completion sampled again is dropped, as rejection-sampling
    fine-tuning keeps distinct reasoning paths (Yuan et al. 2023): kept, it would weight the questions the model
    already solves by how sure of them it is, over the ones it solves once in a while."""
    kept, seen, repeats = [], set(), 0
    for k in correct.nonzero().flatten().tolist():
        question, completion = k // num_generations, tuple(completions[k])
        if not completion:
            continue
        if (question, completion) in seen:
            repeats += 1
            continue
        seen.add((question, completion))
        kept.append(SFTExample(tuple(prompts[question]), completion))
    return kept, repeats


class ExpertIteration:
    def __init__(self, model: torch.nn.Module, tokenizer, reward_funcs: Callable | Sequence[Callable],
                 train_dataset, config: EIConfig | None = None, *, engine: RolloutEngine | None = None,
                 prompt_ids: list[list[int]] | None = None, eval_rows=None):
        """engine: where samples come from (default: BuiltinEngine on the model's own modules; under torchrun the
        only one: each process samples with the model it trains). prompt_ids: as GRPOTrainer's (every row's prompt
        tokenized by the caller already; None: tokenized here); eval_rows too (the evaluation's rows, read by the
        caller already; None: read here)."""
        self.config = config = config or EIConfig()
        check_layer_adapters(model)
        self.model, self.tokenizer, self.dataset = model, tokenizer, train_dataset
        self.dist = Distributed.current()
        check_process_split(config, self.dist.world_size)
        if self.dist.active and engine is not None and not isinstance(engine, BuiltinEngine):
            raise ValueError(f"engine: expected the built-in engine under torchrun ({self.dist.world_size} processes, "
                             f"each sampling with the model it trains), got {type(engine).__name__}; run on one "
                             "process to sample with it")
        self.reward_funcs = reward_list(reward_funcs)
        check_sampling_inputs(self.config, self.model, self.tokenizer, self.reward_funcs, self.dataset)
        warn_unapplied_model_fields(model, config)
        warn_adapter_schedules(model)
        # every row's, before any compute
        self.prompts = prompt_token_ids(train_dataset, tokenizer, config, prompt_ids=prompt_ids)
        self.engine = engine if engine is not None else BuiltinEngine(model, tokenizer)
        self.dist.data_parallel(model, None, config)  # DDP (LoRA) / FSDP2 under torchrun, once for every round
        self.sampling = config.sampling()
        self.weights = torch.tensor(config.reward_weights or [1.0] * len(self.reward_funcs), dtype=torch.float64)
        self.round = 0
        self.output_dir = Path(config.output_dir)
        self.history: list[dict] = []
        # the newest round checkpoint written or resumed from, as GRPOTrainer's (loop_checkpoints)
        self._saved_step = self._saved_path = self._saved_identity = self._saved_time = None
        self.evaluator = ei_evaluator(self, eval_rows)  # None unless eval_steps
        self._unevaluated = None  # a resumed round's metrics, whose evaluation failed: evaluated first
        # what a reward function may not log: a name of the round's metrics, or of the evaluation's (same functions)
        taken = metric_names(ROUND_METRICS, reward_names(self.reward_funcs))
        self.taken_names = taken if self.evaluator is None else taken | self.evaluator.taken_names
        self._guard: InterruptGuard | None = None  # while train() runs
        self.last_kept: list[SFTExample] = []  # the SFT examples of the latest round

    def _questions(self, round_index: int) -> list[int]:
        """Dataset rows of a round: a function of its index only (grpo_data.walk_rows)."""
        return walk_rows(len(self.dataset), self.config.questions_per_step, round_index, self.config.seed)

    def run_round(self) -> dict:
        config, G, dist = self.config, self.config.num_generations, self.dist
        t_start = time.perf_counter()

        # 1. Sample G completions per question, generation_batch_size questions per engine call; under torchrun each
        # process takes every world_size-th of the round's questions.
        indices = self._questions(self.round)
        positions = list(range(dist.rank, len(indices), dist.world_size))
        rows = [self.dataset[indices[p]] for p in positions]
        samples = self._sample(indices, positions)  # (completion ids, text, finish reason) of each completion
        t_rollout = time.perf_counter()

        # 2. Score (a failing function stops every process); gather the round's (completion ids, finish reason) and
        # rewards and what the functions logged; keep the completions marked correct, as (prompt ids, sampled
        # completion ids).
        texts, logs = [text for _, text, _ in samples], RewardLogs(taken=self.taken_names)
        prompts = [row[config.prompt_column] for row in rows for _ in range(G)]
        columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k != config.prompt_column}
        per_func, errors = score(self.reward_funcs, prompts, texts, columns,  # per_func: [N, F]
                                 completion_ids=[ids for ids, _, _ in samples],
                                 trainer_state=trainer_state(self.round, config.ei_steps), logs=logs)
        dist.raise_together(lambda: refuse_taken(logs) or check_reward_failures(errors, config.reward_errors,
                                                                                warn=False))
        samples, per_func, errors = gather_round(dist, positions, [(ids, reason) for ids, _, reason in samples],
                                                 per_func, errors, G)
        logged = merged_means(dist.gather_objects((logs.values, logs.sources)))  # {name: (mean, function)}
        rewards = weighted_rewards(per_func, self.weights)  # rewards: [N]; NaN where no function applied
        if dist.is_main:  # the whole round's warnings, once: skipped failures merged across the processes
            check_reward_failures(errors, config.reward_errors)
            warn_unscored(rewards)
        correct = rewards >= config.correct_threshold  # an unscored completion is not kept
        kept, repeats = distinct_correct([self.prompts[i] for i in indices], [ids for ids, _ in samples], correct, G)
        self.last_kept = kept

        # 3. SFT on the kept completions (none kept: the round leaves the weights as they are). From here a signal
        # lets the round finish.
        self._begin_sft()
        sft = []
        if kept:
            trainer = SFTTrainer(self.model, self.tokenizer, kept, config.sft_config(self.round), dist=dist)
            sft = [trainer.train_step() for _ in range(trainer.total_steps)]
        elif dist.is_main:  # learns nothing; every round alike is a run that cannot start (a setting, not luck)
            logger.warning("round %d: no completion reached correct_threshold %g (best reward %.3g, %d of %d cut at "
                           "max_completion_length): nothing to fine-tune on", self.round + 1,
                           config.correct_threshold, rewards.nan_to_num(-math.inf).max().item(),
                           sum(reason == "length" for _, reason in samples), len(samples))
        t_sft = time.perf_counter()

        self.round += 1
        lengths = torch.tensor([len(ids) for ids, _ in samples], dtype=torch.float32)
        metrics = {
            "round": self.round,
            "reward": nan_mean(rewards),
            "reward_std": nan_sample_std(rewards),
            **per_function_metrics(per_func, reward_names(self.reward_funcs)),  # per_func: the whole round's
            "reward_errors": len(errors),
            "kept": len(kept),
            "kept_repeats_dropped": repeats,
            "kept_frac": len(kept) / rewards.numel(),
            "questions_solved_frac": correct.view(-1, G).any(-1).float().mean().item(),
            "sft_steps": len(sft),
            "sft_loss_first": sft[0]["loss"] if sft else None,
            "sft_loss_last": sft[-1]["loss"] if sft else None,
            "completion_length": lengths.mean().item(),
            "truncated_frac": sum(reason == "length" for _, reason in samples) / len(samples),
            "rollout_s": t_rollout - t_start,
            "sft_s": t_sft - t_rollout,
        }
        for name, err in errors.items():
            metrics[f"reward_error/{name}"] = err
        return add_logged_metrics(metrics, logged, self.taken_names)

    def _sample(self, indices: list[int], positions: list[int]) -> list[tuple[list[int], str, str]]:
        """(completion token ids, text, finish reason) of num_generations samples of each question at `positions` of
        the round's dataset rows `indices`, in that order."""
        config, G, per_call = self.config, self.config.num_generations, self.config.generation_batch_size
        self.engine.load_weights(self.model)  # the previous round's SFT reaches an engine with its own weights
        self.engine.reacquire_memory()
        keyed, round_seed = accepts_prompt_keys(self.engine), config.seed * 1_000_003 + self.round
        # Keyed by the position in the run's walk through the data (unique, also when a round wraps an epoch), so the
        # samples depend neither on generation_batch_size nor on the process count; an engine without keys gets a
        # seed per call.
        first, samples = self.round * config.questions_per_step, []
        with self.dist.full_weights():  # FSDP2: every weight gathered for the rollout
            for start in range(0, len(positions), per_call):
                chunk = positions[start:start + per_call]
                keys = {"prompt_keys": [first + p for p in chunk]} if keyed else {}
                seed = round_seed if keyed else round_seed * 65_537 + chunk[0]
                out = self.engine.generate([self.prompts[indices[p]] for p in chunk], num_generations=G,
                                           sampling=self.sampling, stop=config.stop_strings, seed=seed, **keys)
                ids, mask = out.completion_ids.cpu(), out.completion_mask.cpu().bool()
                samples += [(ids[k][mask[k]].tolist(), out.texts[k], out.finish_reasons[k])
                            for k in range(len(out.texts))]
        self.engine.release_memory()
        return samples

    def _begin_sft(self) -> None:
        """Called as a round's SFT starts: from here a signal lets the round finish (InterruptGuard.begin_update)."""
        if self._guard is not None:
            self._guard.begin_update(self.dist)

    def train(self, run_dir=None) -> list[dict]:
        """Run (or, with config.resume, continue) to config.ei_steps rounds; returns this call's round metrics.

        As GRPOTrainer.train: the output folder is locked and a fresh run refuses one holding another run (run_dir:
        the folder Distributed.run_directory gave the caller; under torchrun rank 0 does it for all). A signal while a
        round samples abandons it (the checkpoint is the previous round's); once its SFT began, the round finishes,
        is saved, and Interrupted is raised (on every process, when any got one). A failing reward function
        (reward_errors="raise") saves the round before it, then raises RewardError; one failing in the evaluation
        after a round's SFT saves that round, which the resumed run evaluates first.
        """
        config, dist = self.config, self.dist
        with contextlib.ExitStack() as stack:
            if run_dir is None:
                run_dir = stack.enter_context(dist.run_directory(self.output_dir))
                run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
            log = dist.on_main(MetricsLog, self.output_dir, report_to=config.report_to, run_config=config.to_dict(),
                               key="round")
            if config.resume:
                self.resume()
                if self.round >= config.ei_steps and self._unevaluated is None and dist.is_main:
                    logger.warning(nothing_to_train(self.output_dir, f"round {self.round}",
                                                    setting("ei_steps", config.ei_steps), "ei_steps",
                                                    self.round if config.export else None))
                    apply_save_limit(self.output_dir, config.save_total_limit, self.round)
            if config.export and self.round < config.ei_steps:  # said before the first round, not after the last
                dist.check_final_exportable(self.output_dir, self.model)
            logged = self.round - (self._unevaluated is not None)  # the rounds logged whole
            log.start_at(logged)
            if self.evaluator is not None and self.round == 0:  # the starting point the rounds improve on
                log.write({"round": 0, **self.evaluator(0, force=True, dist=dist)})
            console = dist.on_main(ConsoleLog, config.logging_steps, config.ei_steps, initial=logged,
                                   progress_bar=config.progress_bar, unit="round")
            stack.callback(console.close)
            self._guard = guard = stack.enter_context(InterruptGuard(unit="round", deferred=dist.active))
            stack.callback(setattr, self, "_guard", None)
            if dist.is_main and self.round < config.ei_steps:
                log_start("expert iteration on", self.model, next(self.model.parameters()).device, dist.world_size,
                          f"{steps(self.round + 1, config.ei_steps, 'round')}, {config.questions_per_step} "
                          f"questions x {config.num_generations} completions a round (up to "
                          f"{config.max_completion_length} tokens), then SFT on those rewarded >= "
                          f"{config.correct_threshold:g}")
            started = self.round if config.resume else None
            if self._unevaluated is not None:  # evaluated now, then saved again without them
                metrics, self._unevaluated = self._unevaluated, None
                self._end_round(metrics, log, console, save_now=True)
            while self.round < config.ei_steps:
                rng = rng_states()
                guard.abandonable = True  # until the round's SFT starts
                try:
                    metrics = self.run_round()
                except (Interrupted, RewardError) as stop:
                    if not guard.abandonable:
                        if isinstance(stop, Interrupted):  # a second signal, in the round's SFT
                            stop.nothing_saved = self._saved_path is None
                        raise
                    # the round changed nothing yet: save the rounds before it (with the RNG states it began from)
                    path = self.save_checkpoint(rng) if self.round > 0 and self._saved_step != self.round else None
                    if isinstance(stop, Interrupted):
                        raise stop.saved(self.round, path) from None
                    path = path or self._saved_path
                    where = f"; round {self.round} is saved in {path}: continue with {setting('resume', True)} " \
                        "once fixed" if path else ""
                    raise RewardError(f"{stop}{where}") from stop
                self._end_round(metrics, log, console)
            if self._saved_step != self.round:
                self.save_checkpoint()
            export_at_end(self, self.round, self.round != started,
                          lambda final: dist.export(export_model, self.model, self.tokenizer, final,
                                                    run_config=config.to_dict(), step=self.round), guard)
        return self.history

    def _end_round(self, metrics: dict, log: MetricsLog, console: ConsoleLog, save_now: bool = False) -> None:
        """After the round's SFT: evaluation, metrics line, checkpoint, a signal's stop (step_end.end_step)."""
        end_step(self, metrics, step=self.round, total=self.config.ei_steps, log=log, console=console,
                 guard=self._guard, save_now=save_now, unit="round")

    def save_checkpoint(self, rng: dict | None = None, unevaluated: dict | None = None) -> Path:
        """checkpoint-<round> (weights, RNG states, round; unevaluated: the metrics of a round whose evaluation
        failed, with rng, the RNG states of before it); the oldest past save_total_limit, and those of a history a
        resume went back over, are deleted (loop_checkpoints.write_checkpoint)."""
        state = {"step": self.round, "round": self.round, "config": self.config.to_dict()}
        # no optimizer state: each round starts a fresh AdamW
        return write_checkpoint(self, self.round, None, state, rng, unevaluated)

    def resume(self) -> None:
        """Load the newest complete round checkpoint of output_dir: weights, RNG states, round (on any process count:
        Distributed.restore_checkpoint)."""
        path, state = restore_newest(self, self.config.ei_steps, None)
        self.round = state["round"]
        resumed_at(self, path, self.round, unit="round")
        logger.info("resumed from %s after round %d", path, self.round)
