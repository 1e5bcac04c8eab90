"""GRPOTrainer: the GRPO loop, read top to bottom in `train_step`.

rollout -> rewards -> group advantages -> old (when the update needs them first) / reference log-probs ->
num_iterations epochs over minibatches (gradient accumulation through fastgrpo's fused loss) -> AdamW, clipping, LR
schedule -> adaptive beta -> log -> checkpoint. Bad input is rejected in __init__, before any compute.
What the loop calls lives beside it: grpo_data (the prompts, a step's rows), rollout_setup (the engine, a step's
rollout), step_rewards (scoring), loss_setup (the loss options), grpo_update (the log-prob passes and the update),
loop_checkpoints (save and resume, shared with SFTTrainer and ExpertIteration).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from fastgrpo.hf.models import is_peft_model
from fastgrpo.hf.peft import base_changing_init
from fastgrpo.loss.grpo import kl_penalty, reward_advantages
from fastgrpo.rewards.scoring import RewardError, nan_mean, nan_sample_std, reward_names, zero_spread_fraction
from fastgrpo.rollout import RolloutEngine
from fastgrpo.train.checkpoint import apply_save_limit, rng_states
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.console import ConsoleLog
from fastgrpo.train.distributed import Distributed
from fastgrpo.train.final_export import export_at_end, export_model, nothing_to_train
from fastgrpo.train.grpo_data import prompt_token_ids, step_rows
from fastgrpo.train.grpo_update import batch_logprobs, needs_old_pass, update_policy
from fastgrpo.train.input_checks import (
    check_sampling_inputs, reward_list, warn_adapter_schedules, warn_unapplied_model_fields,
)
from fastgrpo.train.interrupts import InterruptGuard, Interrupted
from fastgrpo.train.kl_control import AdaptiveKLController
from fastgrpo.train.loop_checkpoints import restore_newest, resumed_at, write_checkpoint
from fastgrpo.train.loss_setup import AdaptiveEntropy, correction_metrics, prepare_loss_batch
from fastgrpo.train.metrics_log import MetricsLog
from fastgrpo.train.naming import setting
from fastgrpo.train.optim import adamw_with_schedule
from fastgrpo.train.options import (
    CONTINUE_FROM_PYTHON, check_config_unchanged, check_own_run, check_trainer_objects, restore_schedule,
)
from fastgrpo.train.periodic_eval import grpo_evaluator
from fastgrpo.train.rollout_setup import rollout_batch, rollout_engine
from fastgrpo.train.start_line import log_start, steps
from fastgrpo.train.step_end import end_step
from fastgrpo.train.step_rewards import add_logged_metrics, metric_names, per_function_metrics, score_groups

logger = logging.getLogger(__name__)
GIB = 1024**3
ADVANTAGE_EPS = 1e-4
# The names of a step's metrics (train_step; the rollout correction's among them), which log_metric may not take
STEP_METRICS = ("step", "reward", "reward_std", "reward_errors", "frac_reward_zero_std", "kl", "kl_p95", "beta",
                "rollout_logp_diff", "rollout_logp_diff_max", "rollout_is_weight_mean", "rollout_is_weight_min",
                "rollout_is_weight_max", "rollout_truncated_frac", "rollout_masked_frac", "loss", "grad_norm",
                "clip_ratio", "entropy", "entropy_coef", "completion_length", "completion_length_max",
                "completion_length_min", "truncated_frac", "lr", "rollout_tokens_per_s", "train_tokens_per_s",
                "rollout_s", "rewards_s", "reference_s", "train_s", "peak_gpu_mem_gib")


def check_reference_base(model: torch.nn.Module) -> None:
    """A PEFT model's KL reference is the model with its adapters disabled: refused, in one line, where an adapter's
    initialization changed the base weights (PiSSA, OLoRA, ...), whose base alone is then not the model training
    started from (the KL would pull the policy towards the residual weights)."""
    found = base_changing_init(model)
    if found is not None:
        adapter, init = found
        raise ValueError(f"model: adapter {adapter!r} has init_lora_weights={init!r}, which moved part of the base "
                         "weights into the adapter, so the KL reference (the model with its adapters disabled) is not "
                         f"the model training started from; set {setting('beta', 0)}, or initialize the adapter with "
                         "init_lora_weights=True")


class GRPOTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        reward_funcs: Callable | Sequence[Callable],
        train_dataset,
        config: GRPOConfig | None = None,
        engine: RolloutEngine | None = None,
        *,
        prompt_ids: list[list[int]] | None = None,
        eval_rows=None,
    ):
        """engine: where rollouts come from (default: config.rollout_engine, BuiltinEngine(model, tokenizer) with
        the model's own modules, or a VLLMEngine sharing the model's weights). prompt_ids: every row's prompt as
        grpo_data.tokenized_prompts gives it, where the caller tokenized them already (the commands, to check their
        lengths before the model loads); None: tokenized here. eval_rows: the rows of the evaluation every
        config.eval_steps as loading.eval_rows(config) gives them, where the caller read them already (the commands,
        loading.load_eval_dataset); None: read here."""
        check_trainer_objects(model, tokenizer, train_dataset, config, GRPOConfig)
        self.config = config = config or GRPOConfig()
        self._built_with = dataclasses.asdict(config)  # train() refuses a field set since (check_config_unchanged)
        self.reward_funcs = reward_list(reward_funcs)
        self.model, self.tokenizer, self.dataset = model, tokenizer, train_dataset
        check_sampling_inputs(self.config, self.model, self.tokenizer, self.reward_funcs, self.dataset)
        warn_unapplied_model_fields(model, config)
        warn_adapter_schedules(model)
        # every row's, before any compute
        self.prompts = prompt_token_ids(train_dataset, tokenizer, config, prompt_ids=prompt_ids)
        self.device = next(model.parameters()).device
        # built before the optimizer and the reference copy: a VLLMEngine re-points the model's parameters at vLLM's
        self.engine = rollout_engine(model, tokenizer, config, self.device, engine)
        self.sampling = config.sampling()
        weights = config.reward_weights or [1.0] * len(self.reward_funcs)
        self.reward_weights = torch.tensor(weights, dtype=torch.float64)
        self.beta = config.beta
        self.kl_controller = (
            AdaptiveKLController(config.beta, config.kl_target, config.kl_max_log_step)
            if config.kl_target is not None else None
        )
        self.entropy = AdaptiveEntropy(config)  # the entropy bonus's coefficient (fixed or adaptive)
        # LoRA: the reference is the base model with the adapter disabled; full fine-tuning needs a frozen copy.
        self.ref_model = None
        if config.beta > 0 and is_peft_model(model):
            check_reference_base(model)
        elif config.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.dist = Distributed.wrap(model, self.ref_model, config)  # DDP (LoRA) / FSDP2 under torchrun; else as is
        self.updates_per_step = config.num_iterations * config.num_minibatches
        self.optimizer, self.scheduler = self._optimizer()
        self.step = 0
        self.output_dir = Path(config.output_dir)
        self.history: list[dict] = []
        self.metrics_log = self.dist.on_main(MetricsLog, self.output_dir, report_to=config.report_to,
                                             run_config=config.to_dict())
        self._guard: InterruptGuard | None = None  # while train() runs
        self._saved_step = self._saved_path = None  # the newest checkpoint written or resumed from
        self._saved_identity = None  # its checkpoint_identity: train() again continues there only while it is ours
        self._saved_time = time.monotonic()
        self.evaluator = grpo_evaluator(self, eval_rows)  # every config.eval_steps; None when 0
        self._unevaluated = None  # a resumed step's metrics, whose evaluation failed: evaluated first
        # what a reward function may not log: a name of the step's metrics, or of the evaluation's (same functions)
        taken = metric_names(STEP_METRICS, reward_names(self.reward_funcs))
        self.taken_names = taken if self.evaluator is None else taken | self.evaluator.taken_names

    # ---- one step ----
    def train_step(self) -> dict:
        config, model, G = self.config, self.model, self.config.num_generations
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_start = time.perf_counter()

        # 1. Rollout: G completions per prompt, one generation config for the whole batch.
        keys, indices = self.dist.shard(step_rows(config, len(self.dataset), self.step))  # this rank's, by position
        batch = rollout_batch(self, [self.prompts[i] for i in indices], keys)
        t_rollout = time.perf_counter()

        # 2. Rewards: every function on every completion. A failing function stops the run (reward_errors="raise")
        # or scores its failed samples 0 (reward_errors="skip"). per_func [N, F], rewards [N]: the whole batch's;
        # logged: what the functions logged with TRL's log_metric, a part of the step's metrics.
        per_func, rewards, errors, logged = score_groups(self.reward_funcs, self.reward_weights, self.dataset,
                                                         indices, batch, config, self.dist, self.step,
                                                         self.taken_names)

        # 3. Group-normalized advantages.
        advantages = reward_advantages(per_func, self.reward_weights, G, config.scale_rewards, ADVANTAGE_EPS,
                                       config.multi_objective_aggregation).float().to(self.device)  # [N]
        advantages = self.dist.own_rows(advantages)  # this rank's rows
        t_rewards = time.perf_counter()

        # 4. Old log-probs when the update needs them before it starts (see _needs_old_pass), and reference ones.
        old_logps = ref_logps = None
        if self._needs_old_pass():
            old_logps = self._logprobs(model, batch)
        if self.beta > 0:
            ref_model = model if self.ref_model is None else self.ref_model
            ref_logps = self._logprobs(ref_model, batch, disable_adapter=self.ref_model is None)
        t_reference = time.perf_counter()

        # 5. num_iterations epochs over minibatches, gradient accumulation over micro-batches. Without an old pass
        # the loss is on-policy and hands back the log-probs it computed (the policy's before its step) for step 6.
        self._begin_update()
        lr = self.optimizer.param_groups[0]["lr"]  # the step's first update's (the scheduler's now is the next one's)
        loss_batch, correction = prepare_loss_batch(config, batch, old_logps)  # truncated rows, rollout correction
        self_weighted = old_logps is None and config.rollout_correction != "none"  # the loss weights itself
        train, policy_logps = self._update(loss_batch, advantages, old_logps, ref_logps,
                                           return_logps=old_logps is None and (ref_logps is not None or self_weighted))
        if self_weighted:  # the weights the micro-batches took from their forwards, reported as an old pass's
            correction = correction_metrics(config, loss_batch, policy_logps)[1]
        train = {**correction, **train}
        old_logps = policy_logps if old_logps is None else old_logps
        t_train = time.perf_counter()

        # 6. Adaptive beta from the KL the policy had at rollout.
        kl = kl_penalty(old_logps, ref_logps)[batch["completion_mask"].bool()] if ref_logps is not None else None
        kl = self.dist.gather_ragged(kl)  # every rank adapts beta from the same KL
        if self.kl_controller is not None:
            self.beta = self.kl_controller.update(kl.mean())

        # 7. Log.
        self.step += 1
        lengths = self.dist.gather_rows(batch["completion_mask"].sum(-1).float())  # lengths: [N]
        grouped = rewards.view(-1, G)
        names = reward_names(self.reward_funcs)
        metrics = {
            "step": self.step,
            "reward": nan_mean(rewards),
            "reward_std": nan_sample_std(rewards),
            **per_function_metrics(per_func, names),  # per_func: gathered, so the whole batch's on every process
            "reward_errors": len(errors),
            "frac_reward_zero_std": zero_spread_fraction(grouped),
            "kl": kl.mean().item() if kl is not None else 0.0,
            "kl_p95": torch.quantile(kl.float(), 0.95).item() if kl is not None and kl.numel() else 0.0,
            "beta": self.beta,
            **train,
            "completion_length": lengths.mean().item(),
            "completion_length_max": lengths.max().item(),
            "completion_length_min": lengths.min().item(),  # 0: a row stopped at once (an EOS first)
            "truncated_frac": sum(r == "length" for r in batch["finish_reasons"]) / len(batch["finish_reasons"]),
            "lr": lr,
            # this process's tokens over its seconds: combine_metrics sums the processes' (lengths are all of them)
            "rollout_tokens_per_s": batch["completion_mask"].sum().item() / max(t_rollout - t_start, 1e-9),
            "train_tokens_per_s": (batch["attention_mask"].sum().item() * config.num_iterations
                                   / max(t_train - t_reference, 1e-9)),
            "rollout_s": t_rollout - t_start,
            "rewards_s": t_rewards - t_rollout,
            "reference_s": t_reference - t_rewards,
            "train_s": t_train - t_reference,
            "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / GIB if self.device.type == "cuda" else 0.0,
        }
        for name, err in errors.items():
            metrics[f"reward_error/{name}"] = err
        return self.dist.combine_metrics(add_logged_metrics(metrics, logged, self.taken_names))

    def _needs_old_pass(self) -> bool:
        """Whether train_step runs a no-grad pass for the old log-probs before the update (grpo_update.needs_old_pass:
        when the policy moves within the step, or the KL needs rows the loss masks)."""
        return needs_old_pass(self.config, self.updates_per_step, self.beta)

    def _logprobs(self, model: torch.nn.Module, batch: dict, disable_adapter: bool = False) -> torch.Tensor:
        """Per-token log-probs [N, P + L] of the sampled tokens, without grad (grpo_update.batch_logprobs)."""
        return batch_logprobs(model, batch, self.config, self.dist, self.device, disable_adapter=disable_adapter)

    def _update(self, batch: dict, advantages: torch.Tensor, old_logps, ref_logps,
                return_logps: bool = False) -> tuple[dict, torch.Tensor | None]:
        """num_iterations x num_minibatches optimizer steps: (the step's update metrics, the loss's log-probs when
        return_logps) (grpo_update.update_policy)."""
        return update_policy(self, batch, advantages, old_logps, ref_logps, return_logps=return_logps)

    def _optimizer(self):
        """AdamW and its schedule over config.max_steps' updates (built again by train() called again, or where
        max_steps was set since: the schedule spans the new length, as a resumed run's does)."""
        self._scheduled_steps = self.config.max_steps
        return adamw_with_schedule(self.model, self.config, self.device, self.config.max_steps * self.updates_per_step)

    # ---- the run ----
    def train(self, run_dir=None) -> list[dict]:
        """Run (or, with config.resume, continue) to config.max_steps; returns the metrics of this call's steps
        (self.history holds the run's). Called again (after the run's end, a raised max_steps, a Ctrl-C), it
        continues this trainer's run from its newest checkpoint, as resume=True would.

        The output folder is locked for the run, and a fresh run refuses a folder that holds another run unless
        overwrite_output_dir (fastgrpo.train.run_dir; under torchrun rank 0 does it for all); run_dir: the folder
        Distributed.run_directory gave the caller (the CLI opens it before it loads the model). SIGINT / SIGTERM end
        the run at a step boundary with a checkpoint, then raise Interrupted (fastgrpo.train.interrupts); a failing
        reward function (reward_errors="raise") saves the step before it, then raises RewardError; one failing in the
        evaluation after a step's update saves that step, which the resumed run evaluates first.
        """
        config = self.config
        check_config_unchanged(self._built_with, config)
        again = self._saved_path is not None  # this trainer's run is in output_dir: it goes on
        with contextlib.ExitStack() as stack:
            if run_dir is None:
                run_dir = stack.enter_context(self.dist.run_directory(self.output_dir))  # under torchrun: rank 0's
                run_dir.prepare(resume=config.resume or again, overwrite=config.overwrite_output_dir and not again,
                                command=config.COMMAND)
            if again:
                self.dist.raise_together(lambda: self.dist.is_main and check_own_run(
                    self.output_dir, self._saved_path, self._saved_identity))
            if again or config.max_steps != self._scheduled_steps:
                self.optimizer, self.scheduler = self._optimizer()
            if config.resume or again:
                self.resume()
                if self.step >= config.max_steps and self._unevaluated is None and self.dist.is_main:
                    logger.warning(nothing_to_train(self.output_dir, f"step {self.step}",
                                                    setting("max_steps", config.max_steps), "max_steps",
                                                    self.step if config.export else None))
                    apply_save_limit(self.output_dir, config.save_total_limit, self.step)
            if config.export and self.step < config.max_steps:  # said before the first step, not after the last
                self.dist.check_final_exportable(self.output_dir, self.model)
            logged = self.step - (self._unevaluated is not None)  # the steps logged whole
            self.metrics_log.start_at(logged)
            started, first = self.step, len(self.history)
            self._saved_time = time.monotonic()
            console = self.dist.on_main(ConsoleLog, config.logging_steps, config.max_steps, initial=logged,
                                        progress_bar=config.progress_bar)
            stack.callback(console.close)
            self._guard = stack.enter_context(InterruptGuard(deferred=self.dist.active))
            stack.callback(setattr, self, "_guard", None)
            if self.dist.is_main and self.step < config.max_steps:
                G = config.num_generations
                log_start("training", self.model, self.device, self.dist.world_size,
                          f"{steps(self.step + 1, config.max_steps)}, {config.batch_size} completions a step "
                          f"({config.batch_size // G} prompts x {G}, up to {config.max_completion_length} tokens)")
            try:
                self._run_steps(console)
            except Interrupted as stop:
                stop.how_to_resume = CONTINUE_FROM_PYTHON  # the CLI names its command line instead
                stop.nothing_saved = stop.checkpoint is None and self._saved_path is None
                raise
            if self._saved_step != self.step:
                self.save_checkpoint()
            export_at_end(self, self.step, self.step != started, self.export, self._guard)
        return self.history[first:]

    def _run_steps(self, console: ConsoleLog) -> None:
        config, guard = self.config, self._guard
        if self._unevaluated is not None:  # evaluated now, then saved again without them
            metrics, self._unevaluated = self._unevaluated, None
            self._end_step(metrics, console, save_now=True)
        while self.step < config.max_steps:
            rng, t_start = rng_states(), time.perf_counter()
            guard.abandonable = True  # until train_step calls _begin_update
            try:
                metrics = self.train_step()
            except (Interrupted, RewardError) as stop:
                if not guard.abandonable:  # a second signal in the middle of the update: nothing whole to save
                    raise
                guard.abandonable = False
                # The step changed nothing yet: save the state it began from (with its RNG states), so that
                # --resume redoes it exactly.
                path = self.save_checkpoint(rng) if self.step > 0 and self._saved_step != self.step else None
                path = path or self._saved_path
                if isinstance(stop, Interrupted):
                    raise stop.saved(self.step, path) from None
                where = f"; step {self.step} is saved in {path}: continue with {setting('resume', True)} once fixed" \
                    if path else ""
                raise RewardError(f"{stop}{where}") from stop
            guard.abandonable = False
            metrics["step_s"] = time.perf_counter() - t_start
            self._end_step(metrics, console)

    def _end_step(self, metrics: dict, console: ConsoleLog, save_now: bool = False) -> None:
        """After the update: evaluation, metrics line, checkpoint, a signal's stop (step_end.end_step)."""
        end_step(self, metrics, step=self.step, total=self.config.max_steps, log=self.metrics_log, console=console,
                 guard=self._guard, save_now=save_now, saved_time=self._saved_time)

    def _begin_update(self) -> None:
        """Called by train_step as the update starts: from here a signal lets the step finish (see train;
        InterruptGuard.begin_update)."""
        if self._guard is not None:
            self._guard.begin_update(self.dist)

    def save_checkpoint(self, rng: dict | None = None, unevaluated: dict | None = None) -> Path:
        """checkpoint-<step> of the current state (rng: RNG states captured earlier, for a step that was abandoned
        or whose evaluation failed; unevaluated: the metrics of the latter); then the oldest checkpoints past
        save_total_limit are deleted (loop_checkpoints.write_checkpoint)."""
        state = {
            "step": self.step,
            "data_position": self.step * (self.config.batch_size // self.config.num_generations),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "beta": self.beta,
            "entropy_coef": self.entropy.coef,  # the adaptive entropy bonus's state
            "last_entropy": self.entropy.last_entropy,
            "config": self.config.to_dict(),
        }
        return write_checkpoint(self, self.step, self.optimizer, state, rng, unevaluated)

    def resume(self) -> None:
        """Load the newest complete checkpoint of output_dir (a torn one is skipped with a warning): weights,
        optimizer, scheduler, RNG, step, beta, the entropy coefficient. Its run-defining settings must match the
        config's (config_changes)."""
        path, state = restore_newest(self, self.config.max_steps, self.optimizer)
        restore_schedule(self.scheduler, state["scheduler"])
        self.step, self.beta = state["step"], state["beta"]
        self.entropy.coef, self.entropy.last_entropy = state["entropy_coef"], state["last_entropy"]
        if self.kl_controller is not None:
            self.kl_controller.beta = self.beta
        resumed_at(self, path, self.step)
        logger.info("resumed from %s at step %d", path, self.step)

    def export(self, path: str | Path) -> Path:
        """An HF model directory; a LoRA adapter is merged into the dequantized base (export_model)."""
        return self.dist.export(export_model, self.model, self.tokenizer, path, run_config=self.config.to_dict(),
                                step=self.step)
