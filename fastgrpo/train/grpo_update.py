"""The trainer's passes over a step's rollout batch after the rewards: whether the update needs an old log-prob pass
before it starts (needs_old_pass), the no-grad log-prob pass of the old and reference log-probs (batch_logprobs),
and the update (update_policy: num_iterations epochs over minibatches, gradient accumulation over micro-batches).

Kept out of trainer.py so that the loop reads top to bottom; GRPOTrainer's _needs_old_pass, _logprobs and _update
call these (tests and benchmarks call or wrap those by name).
"""
from __future__ import annotations

import contextlib

import torch

from fastgrpo.loss.model import grpo_loss, sequence_logprobs
from fastgrpo.train.loss_setup import (
    LOSS_EXTRAS, correction_of, loss_config, micro_batch_scale, minibatch_config, rows_may_regroup,
)
from fastgrpo.train.micro_batches import micro_batch_order


def needs_old_pass(config, updates_per_step: int, beta: float) -> bool:
    """Whether train_step runs a no-grad pass for the old log-probs before the update: when the policy moves
    within the step (several optimizer steps), and with beta > 0 when mask_truncated_completions hides the
    truncated rows from the loss (step 6's KL covers every completion token). Otherwise one optimizer step ends
    the update, so no micro-batch's forward sees a moved policy and the old log-probs are the update's own (TRL:
    per_token_logps.detach() as old with num_iterations == 1): the loss runs on-policy (ratio exp(logp -
    logp.detach()) = 1: the gradient of a separate old pass up to the rounding of the two forwards; with
    dropout, the ratio is no longer moved by it and the KL is taken from the train-mode forward), weights itself
    by the rollout correction from those log-probs (its lm_head once more, no grad: grpo_loss), and returns
    them for the KL. That saves one
    no-grad forward over the batch (64 x 1280 tokens of Qwen2.5-1.5B LoRA: 1.3 s on an H100 with PEFT's fp32
    adapter math; a bf16-branch pass, 0.5 s on an H200).
    """
    return updates_per_step > 1 or (beta > 0 and config.mask_truncated_completions)


@torch.no_grad()
def batch_logprobs(model: torch.nn.Module, batch: dict, config, dist, device: torch.device,
                   disable_adapter: bool = False) -> torch.Tensor:
    """Per-token log-probs [N, P + L] of the sampled tokens, micro-batch by micro-batch, without grad."""
    was_training = model.training
    model.eval()
    size = config.micro_batch_size
    # The adapter is switched off once for the pass: PEFT's switch walks every LoRA layer (37 ms for 28 layers
    # x 7 adapted linears on a 2-core CPU), and done per micro-batch it left the GPU idle in between.
    # Rows of a no-grad pass are independent: a prompt's rows share micro-batches (its tokens run once:
    # fastgrpo.loss.shared_prompts), or short completions do (the backbone runs to the longest row only), whichever
    # runs fewer tokens.
    rows = torch.arange(batch["input_ids"].shape[0], device=batch["input_ids"].device)
    order = micro_batch_order(rows, batch, config.num_generations, size, model)
    out = torch.empty(batch["input_ids"].shape, dtype=torch.float32, device=device)
    with model.disable_adapter() if disable_adapter else contextlib.nullcontext():
        for i in range(0, len(order), size):
            rows = order[i:i + size]
            out[rows] = dist.forward(
                sequence_logprobs, model, batch["input_ids"][rows], batch["attention_mask"][rows],
                batch["completion_mask"][rows], temperature=config.temperature,
            ).float()
    model.train(was_training)
    return out


def update_policy(trainer, batch: dict, advantages: torch.Tensor, old_logps, ref_logps,
                  return_logps: bool = False) -> tuple[dict, torch.Tensor | None]:
    """num_iterations x num_minibatches optimizer steps of `trainer` (a GRPOTrainer: its config, model, beta,
    optimizer, scheduler, entropy, dist, device, step, updates_per_step); returns (the mean loss / grad norm / clip /
    entropy, the per-token log-probs [N, P + L] fp32 of the loss's forwards in the batch's row order, as
    batch_logprobs lays them out, when return_logps, else None). With several updates a row's log-probs are its last
    forward's."""
    config, model, dist, device = trainer.config, trainer.model, trainer.dist, trainer.device
    optimizer, entropy = trainer.optimizer, trainer.entropy
    base_config = loss_config(config, trainer.beta)
    n = batch["input_ids"].shape[0]
    mb_size, micro = n // config.num_minibatches, config.micro_batch_size
    params = [p for g in optimizer.param_groups for p in g["params"]]
    # fp64 sums on the device: one host sync per step (at the return), none per micro-batch. clip_ratio and
    # entropy are a micro-batch's means over its tokens (its sequences, for sequence-level ratios): summed
    # weighted by them, so that the step's are means over all its tokens, however they were split
    sums = {k: torch.zeros((), dtype=torch.float64, device=device)
            for k in ("loss", "grad_norm", "clip_ratio", "entropy", "clip_weight", "tokens")}
    per_sequence_clip = config.importance_sampling_level == "sequence"
    logps = torch.zeros(batch["input_ids"].shape, device=device) if return_logps else None  # [N, P + L]
    correction = correction_of(config) if old_logps is None else None  # on-policy: the loss weights itself
    regroup = rows_may_regroup(config)
    model.train()
    for iteration in range(config.num_iterations):
        # Minibatches are a seeded shuffle of the batch: the same on a resumed run.
        seed = (config.seed * 1_000_003 + trainer.step) * 131 + iteration
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(device)
        for start in range(0, n, mb_size):
            minibatch = order[start:start + mb_size]
            if regroup:  # a prompt's rows, or short rows, share micro-batches (see batch_logprobs)
                minibatch = micro_batch_order(minibatch, batch, config.num_generations, micro, model)
            # dapo, cispo, vespo divide by the active tokens of the whole minibatch, all ranks' (DDP / FSDP2 average
            # over ranks: their loss is scaled by their count below); the others are per-micro-batch means.
            num_items = int(dist.all_reduce_sum(batch["completion_mask"][minibatch].sum()))
            micro_config = minibatch_config(config, base_config, num_items, micro / mb_size / dist.world_size,
                                            entropy.applied())
            optimizer.zero_grad(set_to_none=True)
            for m in range(0, mb_size, micro):
                rows = minibatch[m:m + micro]
                dist.sync_gradients(m + micro >= mb_size)  # DDP: all-reduce on the last micro-batch only
                loss, metrics = dist.forward(
                    grpo_loss, model, batch["input_ids"][rows], batch["attention_mask"][rows],
                    batch["completion_mask"][rows], advantages[rows],
                    old_logps=None if old_logps is None else old_logps[rows],
                    ref_logps=None if ref_logps is None else ref_logps[rows], config=micro_config,
                    return_entropy=True, return_logps=return_logps, rollout_correction=correction,
                    rollout_logps=None if correction is None else batch["rollout_logps"][rows],
                    **{k: batch[k][rows] for k in LOSS_EXTRAS if k in batch},
                )
                if return_logps:
                    logps[rows] = metrics["logps"].float()  # rows: shuffled positions in the batch
                scale = micro_batch_scale(config.loss_type, len(rows), mb_size, dist.world_size)
                (loss * scale).backward()
                sums["loss"] += loss.detach().double() * scale
                tokens = batch["completion_mask"][rows].sum()
                clip_weight = len(rows) if per_sequence_clip else tokens
                sums["clip_ratio"] += torch.as_tensor(metrics.get("clip_ratio", 0.0)).detach() * clip_weight
                sums["clip_weight"] += clip_weight
                sums["entropy"] += torch.as_tensor(metrics.get("entropy", 0.0)).detach() * tokens
                sums["tokens"] += tokens
                entropy.add(metrics, tokens)
            sums["grad_norm"] += dist.finish_gradients(params, config.max_grad_norm)
            optimizer.step()
            entropy.step(dist.all_reduce_sum)
            trainer.scheduler.step()
    updates = trainer.updates_per_step
    # the processes' means: of the weighted sums and of the weights, whose ratio is the ratio of their totals
    loss, grad_norm, clip_ratio, entropy_sum, clip_weight, tokens = dist.mean(torch.stack(list(sums.values()))).tolist()
    return {
        "loss": loss / updates,
        "grad_norm": grad_norm / updates,
        "clip_ratio": clip_ratio / clip_weight if clip_weight else 0.0,
        "entropy": entropy_sum / tokens if tokens else 0.0,
        "entropy_coef": entropy.coef,
    }, logps
