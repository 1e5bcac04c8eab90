"""SFTTrainer: supervised fine-tuning on prompt/response rows (SFTConfig), the loss on response tokens only.

A step reads top to bottom in `train_step`: the step's rows (length-sorted micro-batches, fastgrpo.train.sft_data)
-> fused cross-entropy of the response tokens (fastgrpo.loss.sft: no logits), normalised by the step's response
tokens -> gradient accumulation -> clipping, AdamW, LR schedule -> metrics. `train` adds logging, periodic
evaluation, checkpoints (exact resume) and the export, as GRPOTrainer does.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch

from fastgrpo.loss.sft import sft_loss
from fastgrpo.train.checkpoint import (
    export_due, export_model, load_latest_checkpoint, nothing_to_train, prune_checkpoints, restore_checkpoint,
    save_checkpoint, warn_stale_export,
)
from fastgrpo.train.config import check_resume
from fastgrpo.train.console import ConsoleLog
from fastgrpo.train.input_checks import model_positions, warn_unapplied_model_fields
from fastgrpo.train.interrupts import InterruptGuard
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.naming import setting
from fastgrpo.train.periodic_eval import sft_evaluator
from fastgrpo.train.run_dir import RunDirectory
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import SFTExample, collate, step_micro_batches, steps_per_epoch, tokenize_rows
from fastgrpo.train.optim import adamw_with_schedule

logger = logging.getLogger(__name__)
GIB = 1024**3
# What a run leaves in its output folder (a fresh run refuses a folder holding these): train's, and the evaluations.


def _is_examples(data) -> bool:
    return isinstance(data, (list, tuple)) and len(data) > 0 and all(isinstance(e, SFTExample) for e in data)


class SFTTrainer:
    def __init__(self, model: torch.nn.Module, tokenizer, train_dataset, config: SFTConfig | None = None):
        """train_dataset: rows with config.prompt_column / response_column (tokenized in config.prompt_format), or
        a list of SFTExample (already tokenized, e.g. expert iteration's kept samples)."""
        self.config = config = config or SFTConfig()
        self.model, self.tokenizer = model, tokenizer
        if tokenizer.pad_token_id is None:
            raise ValueError("tokenizer: needs a pad token (set tokenizer.pad_token)")
        positions = model_positions(model)
        if positions is not None and config.max_seq_length > positions:
            raise ValueError(f"max_seq_length: {config.max_seq_length} exceeds the model's max_position_embeddings "
                             f"({positions})")
        if _is_examples(train_dataset):  # expert iteration's kept samples: its own config was checked
            self.examples = list(train_dataset)
            longest = max(len(e) for e in self.examples)
            if longest > config.max_seq_length:
                raise ValueError(f"dataset: an example has {longest} tokens, over max_seq_length "
                                 f"({config.max_seq_length})")
        else:
            warn_unapplied_model_fields(model, config)
            self.examples = tokenize_rows(
                train_dataset, tokenizer, prompt_column=config.prompt_column, response_column=config.response_column,
                prompt_format=config.prompt_format, max_seq_length=config.max_seq_length,
                truncate=config.truncate_sequences,
            )
        self.lengths = [len(e) for e in self.examples]
        self.device = next(model.parameters()).device
        self.steps_per_epoch = steps_per_epoch(len(self.examples), config.batch_size)
        self.total_steps = config.max_steps or config.num_epochs * self.steps_per_epoch
        self.optimizer, self.scheduler = adamw_with_schedule(model, config, self.device, self.total_steps)
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.history: list[dict] = []
        self.evaluator = sft_evaluator(config, model, tokenizer)  # None unless eval_steps

    # ---- one step ----
    def train_step(self) -> dict:
        config, model = self.config, self.model
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_start = time.perf_counter()

        # 1. The step's rows, sorted by length into micro-batches; the divisor is the step's response tokens.
        micro_batches = step_micro_batches(self.lengths, self.step, batch_size=config.batch_size,
                                           micro_batch_size=config.micro_batch_size, seed=config.seed)
        examples = [[self.examples[i] for i in rows] for rows in micro_batches]
        response_tokens = sum(len(e.response_ids) for batch in examples for e in batch)

        # 2. Forward/backward per micro-batch: fused cross-entropy of the response tokens, accumulated in .grad.
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        nll = torch.zeros((), dtype=torch.float64, device=self.device)  # summed on the device, read once per step
        padded = 0
        for batch_examples in examples:
            batch = collate(batch_examples, self.tokenizer.pad_token_id, self.device)
            loss, metrics = sft_loss(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"],
                                     num_items_in_batch=response_tokens)
            loss.backward()
            nll += metrics["nll_sum"].double()
            padded += batch["input_ids"].numel()

        # 3. Clip, AdamW, LR schedule.
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1

        # 4. Metrics.
        seconds = time.perf_counter() - t_start
        tokens = sum(len(e) for batch in examples for e in batch)
        return {
            "step": self.step,
            "epoch": self.step / self.steps_per_epoch,
            "loss": nll.item() / response_tokens,
            "grad_norm": grad_norm.item(),
            "lr": lr,
            "rows": sum(len(b) for b in examples),
            "tokens": tokens,
            "response_tokens": response_tokens,
            "padding_frac": 1.0 - tokens / padded,
            "micro_batches": len(examples),
            "tokens_per_s": tokens / max(seconds, 1e-9),
            "step_s": seconds,
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / GIB if self.device.type == "cuda" else 0.0,
        }

    # ---- the run ----
    def train(self, run_dir: RunDirectory | None = None) -> list[dict]:
        """Run (or, with config.resume, continue) to the last step; returns the metrics of this call's steps.

        As GRPOTrainer.train: the output folder is locked and a fresh run refuses one that holds another run
        (run_dir: a RunDirectory the caller opened already); SIGINT / SIGTERM let the step finish, save a checkpoint
        and raise Interrupted.
        """
        config = self.config
        with contextlib.ExitStack() as stack:
            if run_dir is None:
                run_dir = stack.enter_context(RunDirectory(self.output_dir))
                run_dir.prepare(resume=config.resume, overwrite=config.overwrite_output_dir, command=config.COMMAND)
            log = MetricsLog(self.output_dir, report_to=config.report_to, run_config=config.to_dict())
            if config.resume:
                self.resume()
                if self.step >= self.total_steps:
                    field = "max_steps" if config.max_steps else "num_epochs"
                    logger.warning(nothing_to_train(self.output_dir, f"step {self.step}",
                                                    f"{self.total_steps} ({setting(field, getattr(config, field))})",
                                                    field))
            log.start_at(self.step)
            console = ConsoleLog(config.logging_steps, self.total_steps, initial=self.step,
                                 progress_bar=config.progress_bar)
            stack.callback(console.close)
            guard = stack.enter_context(InterruptGuard())  # every part of an SFT step is the update: it finishes
            started = self.step
            saved_step, saved_time = self.step if config.resume else None, time.monotonic()
            while self.step < self.total_steps:
                metrics = self.train_step()
                if self.evaluator is not None:
                    metrics.update(self.evaluator(self.step, force=self.step == self.total_steps))
                self.history.append(metrics)
                log.write(metrics)
                console.add(metrics)
                every_steps = config.save_steps and self.step % config.save_steps == 0
                every_minutes = config.save_minutes and time.monotonic() - saved_time >= 60 * config.save_minutes
                if every_steps or every_minutes or guard.requested:
                    path, saved_step, saved_time = self.save_checkpoint(), self.step, time.monotonic()
                if guard.requested:
                    raise guard.interrupted(self.step, path)
            if saved_step != self.step:
                self.save_checkpoint()
            if config.export and export_due(self.output_dir, self.step, self.step > started):
                export_model(self.model, self.tokenizer, self.output_dir / "final", run_config=config.to_dict(),
                             step=self.step)
            elif not config.export:
                warn_stale_export(self.output_dir, self.step)
        return self.history

    def save_checkpoint(self) -> Path:
        """checkpoint-<step> of the current state; then the oldest past save_total_limit are deleted."""
        state = {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "config": self.config.to_dict(),
        }
        path = save_checkpoint(self.output_dir / f"checkpoint-{self.step}", self.model, state)
        prune_checkpoints(self.output_dir, self.config.save_total_limit, self.step)
        return path

    def resume(self) -> None:
        """Load the newest complete checkpoint of output_dir (weights, optimizer, scheduler, RNG, step); its
        run-defining settings must match the config's."""
        path, state = load_latest_checkpoint(self.output_dir)
        check_resume(state.get("config", {}), self.config, path.name)
        state = restore_checkpoint(state, self.model)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        logger.info("resumed from %s at step %d", path, self.step)
