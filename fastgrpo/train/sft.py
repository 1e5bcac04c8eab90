"""SFTTrainer: supervised fine-tuning on prompt/response rows (SFTConfig), the loss on response tokens only.

A step reads top to bottom in `train_step`: the step's rows (length-sorted micro-batches, fastgrpo.train.sft_data)
-> fused cross-entropy of the response tokens (fastgrpo.loss.sft: no logits), normalised by the step's response
tokens -> gradient accumulation -> clipping, AdamW, LR schedule -> metrics. `train` adds logging, periodic
evaluation, checkpoints (exact resume) and the export, as GRPOTrainer does.

Under torchrun (`torchrun --nproc_per_node N -m fastgrpo sft ...`, or a process group the caller started) the run is
data-parallel as GRPOTrainer's is (fastgrpo.train.distributed): each process takes every N-th of a step's
micro-batches (sft_data.process_share), scales its loss by N and lets DDP (LoRA) or FSDP2 (full fine-tuning) average
the gradients, so the step's gradient is one process's up to the order of the sums. Rank 0 owns the output folder,
the metrics, the periodic evaluation and the export; the processes agree on when to save and stop.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

import torch

from fastgrpo.loss.sft import sft_loss
from fastgrpo.rollout.requests import as_list
from fastgrpo.train.checkpoint import apply_save_limit
from fastgrpo.train.console import ConsoleLog
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.final_export import export_at_end, export_model, nothing_to_train
from fastgrpo.train.input_checks import (
    check_lengths_fit, model_positions, warn_adapter_schedules, warn_unapplied_model_fields,
)
from fastgrpo.train.interrupts import InterruptGuard, Interrupted
from fastgrpo.train.loop_checkpoints import restore_newest, resumed_at, write_checkpoint
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.naming import setting
from fastgrpo.train.options import (
    CONTINUE_FROM_PYTHON, check_config_unchanged, check_own_run, check_trainer_objects, restore_schedule,
)
from fastgrpo.train.periodic_eval import sft_evaluator
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import (
    SFTExample, collate, padded_tokens, process_share, step_micro_batches, steps_per_epoch, tokenize_rows,
)
from fastgrpo.train.optim import adamw_with_schedule
from fastgrpo.train.start_line import log_start, steps
from fastgrpo.train.step_end import end_step

logger = logging.getLogger(__name__)
GIB = 1024**3
# What a run leaves in its output folder (a fresh run refuses a folder holding these): train's, and the evaluations.


def check_process_split(config: SFTConfig, world_size: int) -> None:
    """A step's rows split into equal shares of whole micro-batches, one per process (the CLI checks before it
    prepares the output folder: --overwrite-output-dir deletes)."""
    if config.batch_size % world_size:
        raise ValueError(f"batch_size: expected a multiple of {world_size} (each of the {world_size} processes takes "
                         f"an equal share of a step's rows), got {config.batch_size}")
    share = config.batch_size // world_size
    if share % config.micro_batch_size:
        raise ValueError(f"micro_batch_size: expected a divisor of {share} (each of the {world_size} processes' "
                         f"batch_size {config.batch_size} / {world_size} rows), got {config.micro_batch_size}")


def total_steps(config: SFTConfig, num_examples: int) -> int:
    """The optimizer steps of a run on num_examples rows: max_steps, or num_epochs passes."""
    return config.max_steps or config.num_epochs * steps_per_epoch(num_examples, config.batch_size)


def warn_no_stop_token(model, tokenizer, examples: list[SFTExample]) -> None:
    """A warning when no response trains a token that generation stops at (the tokenizer's EOS, the model's
    generation_config eos_token_id): the model would never learn to stop. A chat template whose end of turn is
    neither does this, e.g. Qwen2.5's `<|im_end|>` with a base model's tokenizer, whose EOS is `<|endoftext|>`."""
    generation_config = getattr(model, "generation_config", None)
    stops = {tokenizer.eos_token_id, *as_list(getattr(generation_config, "eos_token_id", None))} - {None}
    if any(stops.intersection(e.response_ids) for e in examples):
        return
    logger.warning("dataset: no response holds a token generation stops at (%s: the tokenizer's eos_token and "
                   "generation_config.json's eos_token_id), so the model will not learn to stop; where the chat "
                   "template ends a turn with another token, add its id to the model folder's generation_config.json "
                   "eos_token_id", ", ".join(repr(tokenizer.convert_ids_to_tokens(i)) for i in sorted(stops)))


def _is_examples(data) -> bool:
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(e, SFTExample) for e in data)


def _checked_examples(examples, config: SFTConfig, field: str) -> list[SFTExample]:
    """Examples tokenized before the trainer (expert iteration's kept samples, the sft command's rows), each within
    config.max_seq_length."""
    examples = list(examples)
    longest = max(len(e) for e in examples)
    if longest > config.max_seq_length:
        raise ValueError(f"{field}: an example has {longest} tokens, over max_seq_length ({config.max_seq_length})")
    return examples


class SFTTrainer:
    def __init__(self, model: torch.nn.Module, tokenizer, train_dataset, config: SFTConfig | None = None, *,
                 dist: Distributed | None = None, examples: list[SFTExample] | None = None, eval_rows=None):
        """train_dataset: rows with config.prompt_column / response_column (tokenized in config.prompt_format), or
        a list of SFTExample (already tokenized, e.g. expert iteration's kept samples). dist: a Distributed whose
        data_parallel wrapped `model` already (expert iteration's, once for all its rounds: DDP or FSDP2 wrap a model
        once); none: this process's, wrapping the model here under torchrun. examples: the rows as
        sft_data.tokenize_rows gives them with this config, where the caller tokenized them already (`fastgrpo sft`,
        to check them before the model loads); None: tokenized here. eval_rows: as GRPOTrainer's."""
        check_trainer_objects(model, tokenizer, train_dataset, config, SFTConfig)
        self.config = config = config or SFTConfig()
        self._built_with = dataclasses.asdict(config)  # train() refuses a field set since (check_config_unchanged)
        self.model, self.tokenizer = model, tokenizer
        self.dist = dist if dist is not None else Distributed.current()
        check_process_split(config, self.dist.world_size)
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer: needs a pad token (set tokenizer.pad_token)")
        check_lengths_fit(config, model_positions(model))
        if _is_examples(train_dataset):  # expert iteration's kept samples: its own config was checked
            self.examples = _checked_examples(train_dataset, config, "dataset")
        else:
            warn_unapplied_model_fields(model, config)
            warn_adapter_schedules(model)
            if examples is None:
                examples = tokenize_rows(
                    train_dataset, tokenizer, prompt_column=config.prompt_column,
                    response_column=config.response_column, prompt_format=config.prompt_format,
                    max_seq_length=config.max_seq_length, truncate=config.truncate_sequences,
                )
            elif len(examples) != len(train_dataset):
                raise ValueError(f"examples: expected the tokens of each of the dataset's {len(train_dataset)} rows, "
                                 f"got {len(examples)}")
            self.examples = _checked_examples(examples, config, "examples")
            warn_no_stop_token(model, tokenizer, self.examples)
        self.lengths = [len(e) for e in self.examples]
        self.device = next(model.parameters()).device
        self.steps_per_epoch = steps_per_epoch(len(self.examples), config.batch_size)
        self.total_steps = total_steps(config, len(self.examples))
        self.evaluator = sft_evaluator(config, model, tokenizer, eval_rows)  # None unless eval_steps
        self._unevaluated = None  # a resumed step's metrics, whose evaluation failed: evaluated first
        if dist is None:
            self.dist.data_parallel(model, None, config)  # DDP (LoRA) / FSDP2 under torchrun, before the optimizer
        self.optimizer, self.scheduler = adamw_with_schedule(model, config, self.device, self.total_steps)
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.history: list[dict] = []
        self.metrics_log = None  # built by the first train(), kept by the next (one wandb run)
        # the newest checkpoint written or resumed from, as GRPOTrainer's
        self._saved_step = self._saved_path = self._saved_identity = None

    # ---- one step ----
    def train_step(self) -> dict:
        config, model = self.config, self.model
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_start = time.perf_counter()

        # 1. The step's rows, sorted by length into micro-batches; the divisor is the step's response tokens. Under
        # torchrun this process's share of the micro-batches (sft_data.process_share).
        micro_batches = step_micro_batches(self.lengths, self.step, batch_size=config.batch_size,
                                           micro_batch_size=config.micro_batch_size, seed=config.seed)
        examples = [[self.examples[i] for i in rows] for rows in micro_batches]
        response_tokens = sum(len(e.response_ids) for batch in examples for e in batch)
        share, own = process_share(examples, self.dist.rank, self.dist.world_size)

        # 2. Forward/backward per micro-batch: fused cross-entropy of the response tokens, accumulated in .grad.
        # DDP / FSDP2 average the processes' gradients: each scales its loss by their count to get their sum.
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device, read once per step
        for k, batch_examples in enumerate(share):
            batch = collate(batch_examples, self.tokenizer.pad_token_id, self.device)
            self.dist.sync_gradients(k == len(share) - 1)  # DDP: all-reduce in the last backward only
            loss, metrics = self.dist.forward(sft_loss, model, batch["input_ids"], batch["attention_mask"],
                                              batch["response_mask"], num_items_in_batch=response_tokens)
            (loss * (self.dist.world_size if k < own else 0.0)).backward()  # past `own`: a repeat, weighted 0
            if k < own:
                nll += metrics["nll_sum"].double()
        nll = self.dist.all_reduce_sum(nll)

        # 3. Clip, AdamW, LR schedule.
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = self.dist.finish_gradients(params, config.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]  # this update's
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

        # 4. Metrics.
        seconds = time.perf_counter() - t_start
        tokens = sum(len(e) for batch in examples for e in batch)
        return self.dist.combine_metrics({
            "step": self.step,
            "epoch": self.step / self.steps_per_epoch,
            "loss": nll.item() / response_tokens,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "rows": sum(len(b) for b in examples),
            "tokens": tokens,
            "response_tokens": response_tokens,
            "padding_frac": 1.0 - tokens / padded_tokens(examples),
            "micro_batches": len(examples),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "step_s": seconds,
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / GIB if self.device.type == "cuda" else 0.0,
        })

    # ---- the run ----
    def train(self, run_dir=None) -> list[dict]:
        """Run (or, with config.resume, continue) to the last step; returns the metrics of this call's steps
        (self.history holds the run's). Called again, it continues this trainer's run, as GRPOTrainer.train does.

        As GRPOTrainer.train: the output folder is locked and a fresh run refuses one that holds another run
        (run_dir: the folder Distributed.run_directory gave the caller; under torchrun rank 0 does it for all);
        SIGINT / SIGTERM let the step finish, save a checkpoint and raise Interrupted (on every process, when any
        got one). A reward function failing in the evaluation after a step saves that step, which the resumed run
        evaluates first.
        """
        config, dist = self.config, self.dist
        check_config_unchanged(self._built_with, config)
        again = self._saved_path is not None  # this trainer's run is in output_dir: it goes on
        with contextlib.ExitStack() as stack:
            if run_dir is None:
                run_dir = stack.enter_context(dist.run_directory(self.output_dir))
                run_dir.prepare(resume=config.resume or again, overwrite=config.overwrite_output_dir and not again,
                                command=config.COMMAND)
            if self.metrics_log is None:
                self.metrics_log = dist.on_main(MetricsLog, self.output_dir, report_to=config.report_to,
                                                run_config=config.to_dict())
            log = self.metrics_log
            if again:
                dist.raise_together(lambda: dist.is_main and check_own_run(self.output_dir, self._saved_path,
                                                                          self._saved_identity))
            if again or total_steps(config, len(self.examples)) != self.total_steps:
                # the schedule spans a max_steps / num_epochs set since, as a resumed run's does
                self.total_steps = total_steps(config, len(self.examples))
                self.optimizer, self.scheduler = adamw_with_schedule(self.model, config, self.device, self.total_steps)
            if config.resume or again:
                self.resume()
                if self.step >= self.total_steps and self._unevaluated is None and dist.is_main:
                    field = "max_steps" if config.max_steps else "num_epochs"
                    logger.warning(nothing_to_train(self.output_dir, f"step {self.step}",
                                                    f"{self.total_steps} ({setting(field, getattr(config, field))})",
                                                    field, self.step if config.export else None))
                    apply_save_limit(self.output_dir, config.save_total_limit, self.step)
            if config.export and self.step < self.total_steps:  # said before the first step, not after the last
                dist.check_final_exportable(self.output_dir, self.model)
            logged = self.step - (self._unevaluated is not None)  # the steps logged whole
            log.start_at(logged)
            console = dist.on_main(ConsoleLog, config.logging_steps, self.total_steps, initial=logged,
                                   progress_bar=config.progress_bar)
            stack.callback(console.close)
            # every part of an SFT step is the update: it finishes; several processes stop together after it
            guard = stack.enter_context(InterruptGuard(deferred=dist.active))
            if dist.is_main and self.step < self.total_steps:
                log_start("fine-tuning", self.model, self.device, dist.world_size,
                          f"{steps(self.step + 1, self.total_steps)}, {config.batch_size} rows a step (up to "
                          f"{config.max_seq_length} tokens)")
            started, first = self.step, len(self.history)
            try:
                self._run_steps(log, console, guard)
            except Interrupted as stop:
                stop.how_to_resume = CONTINUE_FROM_PYTHON  # the CLI names its command line instead
                stop.nothing_saved = stop.checkpoint is None and self._saved_path is None
                raise
            if self._saved_step != self.step:
                self.save_checkpoint()
            export_at_end(self, self.step, self.step > started, self.export, guard)
        return self.history[first:]

    def _run_steps(self, log: MetricsLog, console: ConsoleLog, guard: InterruptGuard) -> None:
        self._saved_time = time.monotonic()
        if self._unevaluated is not None:  # evaluated now, then saved again without them
            metrics, self._unevaluated = self._unevaluated, None
            self._end_step(metrics, log, console, guard, save_now=True)
        while self.step < self.total_steps:
            self._end_step(self.train_step(), log, console, guard)

    def _end_step(self, metrics: dict, log: MetricsLog, console: ConsoleLog, guard: InterruptGuard,
                  save_now: bool = False) -> None:
        """After the update: evaluation, metrics line, checkpoint, a signal's stop (step_end.end_step)."""
        end_step(self, metrics, step=self.step, total=self.total_steps, log=log, console=console, guard=guard,
                 save_now=save_now, saved_time=self._saved_time)

    def export(self, path: str | Path) -> Path:
        """An HF model directory of the current weights and the tokenizer, as GRPOTrainer.export (export_model)."""
        return self.dist.export(export_model, self.model, self.tokenizer, Path(path), run_config=self.config.to_dict(),
                                step=self.step)

    def save_checkpoint(self, rng: dict | None = None, unevaluated: dict | None = None) -> Path:
        """checkpoint-<step> of the current state (unevaluated: the metrics of a step whose evaluation failed, with
        rng, the RNG states of before it); then the oldest past save_total_limit are deleted."""
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.config.to_dict(),
        }
        return write_checkpoint(self, self.step, self.optimizer, state, rng, unevaluated)

    def resume(self) -> None:
        """Load the newest complete checkpoint of output_dir (weights, optimizer, scheduler, RNG, step); its
        run-defining settings must match the config's (Distributed.restore_checkpoint: on any process count)."""
        path, state = restore_newest(self, self.total_steps, self.optimizer)
        restore_schedule(self.scheduler, state["scheduler"])
        self.step = state["step"]
        resumed_at(self, path, self.step)
        logger.info("resumed from %s at step %d", path, self.step)
