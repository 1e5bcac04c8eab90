"""Evaluation every --eval-steps inside `fastgrpo train`, `sft` and `ei`: PeriodicEval, and one builder per config.

Each builder returns None when eval_steps is 0. The rows come from eval_dataset (an HF dataset: its test split),
or, when the run trains on a built-in task (dataset is None), from held-out rows of that task; a run on its own
data with eval_steps but no eval_dataset is an error naming eval_dataset. The prompt format, rewards and sampling
are the run's own, so an evaluation scores what the run optimises.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from fastgrpo.rewards.reward_logs import TakenNames
from fastgrpo.rewards.scoring import RewardError, reward_names
from fastgrpo.rollout import BuiltinEngine, RolloutEngine, SamplingParams
from fastgrpo.train.checkpoint import rng_states
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.evaluate import EvalTask, build_eval_task, evaluate, log_generations, summary_names, write_eval
from fastgrpo.train.input_checks import model_positions
from fastgrpo.train.loading import eval_rows, resolve_reward
from fastgrpo.train.naming import setting
from fastgrpo.train.prompts import stop_strings
from fastgrpo.train.step_rewards import trainer_state


class PeriodicEval:
    """Evaluation every `every` steps, into <output_dir>/eval/step-<N>.jsonl and step-<N>_summary.json; returns the
    summary's numbers (what the reward functions logged with log_metric among them) prefixed "eval/" for the step's
    metrics line, and {} when the step is not due (and on every
    process but rank 0 under torchrun). unit: what the log lines call a step ("round" under `ei`); max_steps: the
    run's steps (rounds), for the reward functions' `trainer_state`."""

    def __init__(self, model, engine: RolloutEngine, tokenizer, task: EvalTask, sampling: SamplingParams, *,
                 every: int, output_dir: str | Path, stop=None, seed: int = 0, reward_errors: str = "raise",
                 log_count: int = 3, unit: str = "step", max_steps: int = 0):
        if every < 1:
            raise ValueError(f"eval_steps: expected >= 1 for a periodic evaluation, got {every}")
        self.model, self.engine, self.tokenizer, self.task, self.sampling = model, engine, tokenizer, task, sampling
        self.reward_errors = reward_errors
        self.every, self.directory, self.stop = every, Path(output_dir) / "eval", stop
        self.seed, self.log_count, self.unit, self.max_steps = seed, log_count, unit, max_steps

    def __call__(self, step: int, *, force: bool = False, dist: Distributed | None = None) -> dict:
        """The step's evaluation when it is due (or forced); dist: the trainer's Distributed (None: one process).

        Under torchrun every process evaluates every world_size-th row (evaluate), under FSDP2 with every weight
        gathered (as for a rollout: the gathering is a collective, so no process can stay out), and rank 0 alone
        writes, logs (the rewards' warnings too) and returns the numbers ({} on the others). An error on any process
        stops every process."""
        dist = dist or Distributed()
        if not self.due(step, force):
            return {}
        self.engine.load_weights(self.model)  # an engine with its own copy (vLLM) gets the step's weights
        with dist.full_weights():
            summary = dist.raise_together(lambda: self._evaluate(step, dist))
        if not dist.is_main:
            return {}
        return {f"eval/{k}": v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def due(self, step: int, force: bool = False) -> bool:
        return force or step % self.every == 0

    def add_to(self, metrics: dict, step: int, *, force: bool, dist: Distributed, log,
               save: Callable[[dict | None, dict], Path]) -> dict:
        """The step's metrics with its evaluation's when due (__call__). One failing after the step's update (a reward
        function with reward_errors="raise", or a log_metric name clash: RewardError; in one process, any exception)
        would lose the steps since the last checkpoint; instead the metrics line is written without it (log: the
        run's MetricsLog), the step is saved with save(rng, metrics): the RNG states of before the evaluation and the
        metrics as plain JSON, for the resumed run to evaluate the step and log it whole (checkpoint.UNEVALUATED), and
        the error says so."""
        rng = rng_states() if self.due(step, force) else None  # a resumed run evaluates from the same RNG states
        try:
            return {**metrics, **self(step, force=force, dist=dist)}
        except RewardError as err:  # raised on every process together: they save together
            raise RewardError(f"{err}; {self._saved(metrics, step, rng, log, save)}") from err
        except Exception as err:  # a full disk, a GPU out of memory: on one process, where nothing waits on others
            if dist.active:
                raise
            err.add_note(self._saved(metrics, step, rng, log, save))
            raise

    def _saved(self, metrics: dict, step: int, rng: dict | None, log, save: Callable) -> str:
        """Write the step's metrics line without the evaluation, save the step (add_to), and say so."""
        log.write(metrics)
        path = save(rng, json.loads(json.dumps(metrics)))
        return (f"{self.unit} {step}'s evaluation failed after its update: {self.unit} {step} is saved in {path}: "
                f"continue with {setting('resume', True)} once fixed (the resumed run evaluates it first)")

    @property
    def taken_names(self) -> TakenNames:
        """The names its summary takes: a run refuses them as a reward function logs them on its first step, not
        first at the evaluation, after steps it would then lose."""
        return summary_names(reward_names(self.task.reward_funcs))

    def _evaluate(self, step: int, dist: Distributed) -> dict:
        records, summary = evaluate(self.engine, self.tokenizer, self.task, self.sampling, stop=self.stop,
                                    seed=self.seed, reward_errors=self.reward_errors, dist=dist,
                                    trainer_state=trainer_state(step, self.max_steps))
        if dist.is_main:
            write_eval(records, {"step": step, **summary}, self.directory / f"step-{step}.jsonl",
                       self.directory / f"step-{step}_summary.json")
            log_generations(records, self.log_count, f"eval {self.unit} {step}")
        return summary


def sft_evaluator(config, model, tokenizer, rows=None) -> PeriodicEval | None:
    """For an SFTConfig: its prompt column and format, eval_reward_funcs, eval_max_new_tokens, eval_temperature.
    rows: eval_rows(config), where the caller read them already (loading.load_eval_dataset); None: read here."""
    if not config.eval_steps:
        return None
    rewards = [resolve_reward(name) for name in config.eval_reward_funcs]
    task = build_eval_task(_read_once(config, rows), tokenizer, prompt_column=config.prompt_column,
                           prompt_format=config.prompt_format, reward_funcs=rewards,
                           max_examples=config.eval_max_examples, max_positions=model_positions(model),
                           max_new_tokens=config.eval_max_new_tokens, new_tokens_field="eval_max_new_tokens")
    sampling = SamplingParams(max_new_tokens=config.eval_max_new_tokens, temperature=config.eval_temperature)
    stop = stop_strings(None, config.prompt_format, config.eval_reward_funcs)
    return PeriodicEval(model, BuiltinEngine(model, tokenizer), tokenizer, task, sampling, every=config.eval_steps,
                        output_dir=config.output_dir, stop=stop, seed=config.seed, reward_errors=config.reward_errors)


def ei_evaluator(run, rows=None) -> PeriodicEval | None:
    """For an ExpertIteration: its prompt format, rewards, threshold, sampling, stop strings and engine. rows: as
    sft_evaluator's."""
    config = run.config
    if not config.eval_steps:
        return None
    task = build_eval_task(_read_once(config, rows), run.tokenizer, prompt_column=config.prompt_column,
                           prompt_format=config.prompt_format, reward_funcs=run.reward_funcs,
                           reward_weights=config.reward_weights, correct_threshold=config.correct_threshold,
                           max_examples=config.eval_max_examples, max_positions=model_positions(run.model),
                           max_new_tokens=run.sampling.max_new_tokens, new_tokens_field="max_completion_length")
    return PeriodicEval(run.model, run.engine, run.tokenizer, task, run.sampling, every=config.eval_steps,
                        output_dir=config.output_dir, stop=config.stop_strings, seed=config.seed,
                        reward_errors=config.reward_errors, unit="round", max_steps=config.ei_steps)


def grpo_evaluator(trainer, rows=None) -> PeriodicEval | None:
    """For a GRPOTrainer: its prompt format (raw: text as is, messages through the chat template), rewards and weights,
    sampling, stop strings and engine; one completion per prompt. rows: as sft_evaluator's."""
    config = trainer.config
    if not config.eval_steps:
        return None
    task = build_eval_task(_read_once(config, rows), trainer.tokenizer, prompt_column=config.prompt_column,
                           prompt_format=config.prompt_format, reward_funcs=trainer.reward_funcs,
                           reward_weights=config.reward_weights, max_examples=config.eval_max_examples,
                           max_positions=model_positions(trainer.model),
                           max_new_tokens=trainer.sampling.max_new_tokens,
                           new_tokens_field="max_completion_length")
    return PeriodicEval(trainer.model, trainer.engine, trainer.tokenizer, task, trainer.sampling,
                        every=config.eval_steps, output_dir=config.output_dir,
                        stop=config.stop_strings, seed=config.seed,
                        reward_errors=config.reward_errors, max_steps=config.max_steps)


def _read_once(config, rows):
    """The rows to evaluate on: those the caller read (a command, before the model loaded), else eval_rows(config)."""
    return rows if rows is not None else eval_rows(config)
