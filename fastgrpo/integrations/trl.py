"""FastGRPOTrainer: TRL's GRPOTrainer with its log-probs, entropies and loss computed by fastgrpo.

A TRL script changes two lines: `from fastgrpo.integrations.trl import FastGRPOTrainer`, and `FastGRPOTrainer(...)`
where it built `GRPOTrainer(...)`: same arguments, same trl.GRPOConfig. Generation, rewards, advantages, logging and
checkpoints stay TRL's. Two of its documented override points are replaced:

- `_get_per_token_logps_and_entropies`, the one place TRL computes the old, the reference (and its own policy)
  log-probs: the backbone's hidden states through fastgrpo's chunked lm_head + log-softmax (no [B, T, V] logits);
- `_compute_loss`: fastgrpo.fused_linear_grpo_loss, which forms the gradient through the lm_head chunk by chunk in the
  forward pass (3 GEMMs, 2 with a frozen lm_head), with every loss type and option of TRL 1.15 / 1.16, and logs the
  metrics TRL logs, with TRL's names and aggregation.

The model is patched (fastgrpo.patch_model: fused RMSNorm, RoPE, SwiGLU, LoRA) unless patch=False;
offload_activations=True (or an ActivationOffloader) checkpoints the layers with their inputs in CPU memory, in place
of TRL's gradient checkpointing. What it cannot compute the same way is refused when it is built (_refusals), never
run differently; a compute_metrics, which GRPO evaluation never calls (it returns no logits), where it is set.
"""
from __future__ import annotations

import math

import torch
from packaging.specifiers import SpecifierSet
from transformers import ProcessorMixin

from fastgrpo._checks import read_ints
from fastgrpo.hf.architectures import ARCHITECTURES
from fastgrpo.hf.models import (
    backbone_and_head, head_bias, is_peft_model, logit_softcap, unwrap_peft,
)
from fastgrpo.loss.config import GRPOLossConfig
from fastgrpo.loss.fused import fused_linear_grpo_loss
from fastgrpo.loss.row_layout import as_given, padding_facts, run_backbone, take_columns, unpadded
from fastgrpo.ops.fused_linear import BACKENDS, fused_linear_logprobs, resolve_backend
from fastgrpo.patching import patch_model
from fastgrpo.patching.liger import liger_patched_problem
from fastgrpo.patching.patch import SUMMARY_ATTR, check_offload_options

# The TRL releases whose GRPOTrainer contracts (the two methods' signatures, the `inputs` keys, the attributes read
# below) this module was checked against; pyproject's `trl` extra says the same (tests/test_trl.py compares them).
SUPPORTED_TRL = SpecifierSet(">=1.15,<1.17")


def _import_trl():
    try:
        import trl
    except ImportError as err:
        raise ImportError('fastgrpo.integrations.trl needs TRL: pip install "fastgrpo[trl]"') from err
    if not SUPPORTED_TRL.contains(trl.__version__, prereleases=True):
        raise ImportError(
            f"fastgrpo.integrations.trl supports trl {SUPPORTED_TRL} (it overrides GRPOTrainer methods whose "
            f"contracts it mirrors); trl {trl.__version__} is installed: pip install \"fastgrpo[trl]\""
        )
    return trl


trl = _import_trl()

CLIP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
TOKEN_SUM_TYPES = ("cispo", "dapo", "vespo")  # normalized by the generation batch's tokens (num_items_in_batch)
LOGIT_SCALES = ("logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")
# patch_model's options a reference model shares with the policy: the math of its forward (fp8_base: a full
# fine-tuning's reference multiplies in FP8 too; a LoRA policy has no reference model, TRL disables the adapters)
FORWARD_SWITCHES = ("rms_norm", "rope", "swiglu", "fp8_base")


def _refusals(args, patch: bool) -> list[str]:
    """What a trl.GRPOConfig asks that FastGRPOTrainer cannot do as TRL does."""
    found = []
    # TRL applies only Liger's layer kernels (its loss never runs here): with patch=False they replace nothing
    if args.use_liger_kernel and patch:
        found.append("use_liger_kernel: HF's Trainer would put Liger's layer kernels over the ones "
                     "fastgrpo.patch_model binds; set use_liger_kernel=False, or patch=False to run Liger's layers "
                     "under fastgrpo's loss")
    if args.torch_compile:  # HF compiles the model's forward, which FastGRPOTrainer's loss never calls
        found.append("torch_compile: FastGRPOTrainer runs the backbone and fastgrpo's fused lm_head outside the "
                     "compiled model, so nothing would be compiled; set torch_compile=False")
    wrapper = _wrapper_asked(args)
    if wrapper is not None:
        found.append(f"{wrapper}: one process only, without DeepSpeed or FSDP (fastgrpo's loss reads the lm_head "
                     "weight and runs the backbone outside the DDP / DeepSpeed / FSDP wrapper); launch a single "
                     "process without it, use trl.GRPOTrainer, or for several GPUs `torchrun -m fastgrpo train` "
                     "(FSDP2 / DDP)")
    return found


def _wrapper_asked(args) -> str | None:
    """The setting of a trl.GRPOConfig that asks for a DeepSpeed / FSDP / multi-process run, as the refusal names it."""
    if args.deepspeed:
        return "deepspeed"
    if args.deepspeed_plugin is not None:  # made from the environment: args.deepspeed is unset
        return "ACCELERATE_USE_DEEPSPEED (accelerate launch --use_deepspeed, or its config)"
    if args.fsdp:
        return "fsdp"
    return f"world_size: {args.world_size} processes" if args.world_size > 1 else None


def _model_refusals(trainer, patch: bool) -> list[str]:
    """What the model and processing class ask that FastGRPOTrainer cannot do as TRL does."""
    found = []
    model_type = getattr(getattr(unwrap_peft(trainer.model), "config", None), "model_type", None)
    if patch and model_type not in ARCHITECTURES:  # here, not patch_model's error after TRL's whole set-up
        found.append(f"patch: fastgrpo.patch_model has no fused layers for model_type {model_type!r} (it has: "
                     f"{sorted(ARCHITECTURES)}); pass patch=False to train it on fastgrpo's loss alone")
    liger = liger_patched_problem(unwrap_peft(trainer.model)) if patch else None
    if liger is not None:  # patch_model would refuse it after TRL's whole set-up
        found.append(liger)
    if isinstance(trainer.processing_class, ProcessorMixin):
        found.append("processing_class: vision-language models (a processor) are not supported; their forward "
                     "takes pixel inputs fastgrpo's text-only loss path does not pass")
    if getattr(trainer, "aux_loss_enabled", False):
        found.append("router_aux_loss_coef: the MoE load-balancing loss is not computed by fastgrpo's loss; set "
                     "router_aux_loss_coef=0 or output_router_logits=False")
    config = getattr(unwrap_peft(trainer.model), "config", None)
    for name in LOGIT_SCALES:
        value = getattr(getattr(config, "get_text_config", lambda: config)(), name, None)
        if value not in (None, 1, 1.0):
            found.append(f"model: config.{name}={value} scales the logits, which fastgrpo's lm_head kernels don't")
    if is_peft_model(trainer.model) and any(c.is_prompt_learning for c in trainer.model.peft_config.values()):
        found.append("peft_config: prompt-learning adapters (prefix / prompt tuning) change the model's forward, "
                     "which fastgrpo bypasses to run the backbone; use LoRA")
    try:
        backbone_and_head(trainer.model)
    except ValueError as err:
        found.append(str(err))
    return found


def _offload_problems(patch, offload_activations, recompute_layers) -> list[str]:
    """patch_model's checks of the offload keywords, run before TRL loads the model (minutes for a large one)."""
    try:
        check_offload_options(offload_activations, recompute_layers)
    except ValueError as err:
        return [str(err)]
    if offload_activations is not False and not patch:
        return ["offload_activations: offload runs in fastgrpo.patch_model's layers; keep patch=True"]
    if recompute_layers is not None and offload_activations is False:
        return ["recompute_layers: chooses the layers offload_activations checkpoints, and it is off "
                "(TRL's gradient_checkpointing covers every layer)"]
    return []


def _fp8_base_problems(fp8_base, patch, model, peft_config, args) -> list[str]:
    """fp8_base's keyword checks, before TRL loads the model: patch_model runs it, on a LoRA model's frozen base or
    (full fine-tuning) on every decoder linear, outside autocast: fastgrpo's LoRA forward leaves an autocast pass to
    PEFT's, its FP8 linears to F.linear, both multiplying in the autocast dtype."""
    if not isinstance(fp8_base, bool):
        return [f"fp8_base: expected True or False, got {fp8_base!r}"]
    if not fp8_base:
        return []
    if not patch:
        return ["fp8_base: runs in fastgrpo.patch_model's layers; keep patch=True"]
    if getattr(peft_config, "use_dora", False):  # patch_model's refusals, before TRL loads the model
        return ["fp8_base: runs in fastgrpo's LoRA forward, which takes plain LoRA adapters, and peft_config has "
                "use_dora=True (PEFT's forward runs DoRA, the base in bf16); set use_dora=False"]
    if getattr(peft_config, "lora_dropout", 0):
        return [f"fp8_base: runs in fastgrpo's LoRA forward, which takes no adapter dropout, and peft_config has "
                f"lora_dropout {peft_config.lora_dropout} (training would run PEFT's forward, the base in bf16); set "
                "lora_dropout=0"]
    if args is not None and (args.bf16 or args.fp16):
        precision = "bf16" if args.bf16 else "fp16"
        if peft_config is not None or is_peft_model(model):
            where = ("fastgrpo's LoRA forward, which leaves TRL's mixed precision to PEFT's (the backbone under "
                     f"autocast, the base in {precision})")
        else:  # full fine-tuning: TRL makes no PEFT model without a peft_config
            where = ("fastgrpo's FP8 linears, which leave TRL's mixed precision to F.linear (the backbone under "
                     f"autocast, every decoder linear in {precision})")
        return [f"fp8_base: runs in {where}; set {precision}=False and load the model in bf16 (model_init_kwargs="
                "{'dtype': torch.bfloat16})"]
    return []


def _patch_arguments(model) -> dict | None:
    """The arguments fastgrpo.patch_model was given on `model` (a module, or a path TRL loads), None where unpatched."""
    summary = getattr(unwrap_peft(model), SUMMARY_ATTR, None) if isinstance(model, torch.nn.Module) else None
    return None if summary is None else summary["arguments"]


def _policy_patch_options(model, offload_activations, recompute_layers, fp8_base: bool) -> dict:
    """patch_model's arguments for the policy: those the model was patched with before the trainer got it (the user's
    `fastgrpo.patch_model(model, ...)`; the trainer patches again, PEFT may have wrapped it since), the trainer's
    keywords over them where set, and no fused labels= loss (the trainer's loss never calls the model's forward)."""
    options = dict(_patch_arguments(model) or patch_model.__kwdefaults__)
    options["fused_loss"] = False
    if offload_activations is not False:
        options["offload_activations"] = offload_activations
    if recompute_layers is not None:
        options["recompute_layers"] = recompute_layers
    if fp8_base:
        options["fp8_base"] = True
    return options


def _no_autocast(tensor: torch.Tensor):
    """The fused lm_head runs in its inputs' dtype with fp32 accumulation (an fp32 dW accumulator among them), which
    an enclosing autocast (mixed precision) would recast."""
    return torch.autocast(tensor.device.type, enabled=False)


class FastGRPOTrainer(trl.GRPOTrainer):
    """trl.GRPOTrainer on fastgrpo's kernels: same constructor and trl.GRPOConfig, plus

    patch: fastgrpo.patch_model the policy (and a reference copy) before training (fused RMSNorm, RoPE, SwiGLU,
    LoRA); a model patched already keeps the options it was patched with, the keywords below going over them.
    patch=False with use_liger_kernel=True runs Liger's layer kernels under fastgrpo's loss.
    offload_activations: True or a fastgrpo.offload.ActivationOffloader checkpoints every decoder layer with its input
    kept in pinned CPU memory (needs patch). It replaces TRL's gradient checkpointing, whose flag is set to
    False on the trainer's args: HF's Trainer would turn HF's checkpointing on again at train(), and TRL around each
    generation, and the layers would then be checkpointed without offload. recompute_layers (with
    offload_activations): only the first N decoder layers are checkpointed, the later ones keep their activations
    (patch_model's). fp8_base (needs patch, and bf16=False / fp16=False: TRL's autocast would turn it off): the GEMMs
    in FP8 (patch_model's): with peft_config (or a PEFT model) those of the LoRA layers' frozen bases, in full
    fine-tuning those of every decoder linear, the reference model's too (beta > 0). backend: "auto" (Triton on
    CUDA, chunked PyTorch on the CPU), "triton" or "torch".
    """

    def __init__(self, *args, patch: bool = True, offload_activations=False, recompute_layers: int | None = None,
                 fp8_base: bool = False, backend: str = "auto", **kwargs):
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        problems = _refusals(config, patch) if config is not None else []
        if not isinstance(patch, bool):  # "no" is truthy: it would patch
            problems.append(f"patch: expected True or False, got {patch!r}")
        if backend not in BACKENDS:  # here, not at the first step after the model is loaded and patched
            problems.append(f"backend: expected one of {', '.join(BACKENDS)}, got {backend!r}")
        elif config is not None:  # 'triton' on a CPU-only run, the same way
            try:
                resolve_backend(backend, config.device)
            except ValueError as err:
                problems.append(str(err))
        model = kwargs.get("model", args[0] if args else None)
        offloaded = offload_activations
        if offloaded is False and patch:  # recompute_layers alone chooses among a user-patched model's offloaded layers
            offloaded = (_patch_arguments(model) or {}).get("offload_activations", False)
        problems += _offload_problems(patch, offloaded, recompute_layers)
        problems += _fp8_base_problems(fp8_base, patch, model, kwargs.get("peft_config"), config)
        if problems:  # before TRL loads any model
            raise ValueError("FastGRPOTrainer cannot honour: " + "; ".join(problems))
        super().__init__(*args, **kwargs)
        problems = _refusals(self.args, patch) + _model_refusals(self, patch)
        options = _policy_patch_options(self.model, offload_activations, recompute_layers, fp8_base)
        if config is None or options["fp8_base"] != fp8_base:  # TRL's own GRPOConfig (bf16=True), or the user's patch
            problems += _fp8_base_problems(options["fp8_base"], True, self.model, None, self.args)
        if problems:
            raise ValueError("FastGRPOTrainer cannot honour: " + "; ".join(problems))
        self.fastgrpo_backend = backend
        if patch:  # draws no random numbers: TRL's seeding at the end of its __init__ still decides the run
            patch_model(self.model, **options)
            # The reference: the policy's forward math, the rest acts on training only. TRL 1.15 / 1.16 load it with
            # weights that require grad, so fp8_base's copies are keyed on optimizer steps too: made again after
            # sync_ref_model writes the weights through .data, which moves no version counter
            if self.ref_model is not None:
                patch_model(self.ref_model, fused_loss=False, **{name: options[name] for name in FORWARD_SWITCHES})
        if options["offload_activations"] is not False:
            for name in ("gradient_checkpointing", "activation_checkpointing"):  # newer transformers have both
                if getattr(self.args, name, None):
                    setattr(self.args, name, False)

    @property
    def compute_metrics(self):
        """Always None: GRPO evaluation's prediction_step (TRL's) returns the loss alone, so HF's Trainer would skip
        a compute_metrics without a word; setting one is refused where it is set."""
        return None

    @compute_metrics.setter
    def compute_metrics(self, function) -> None:
        if function is not None:
            raise ValueError(
                "FastGRPOTrainer cannot honour: compute_metrics: GRPO evaluation (trl.GRPOTrainer's too) returns the "
                "loss alone, no logits or labels, so compute_metrics would never be called; score completions with a "
                "reward function of weight 0 (GRPOConfig.reward_weights), which logs rewards/<name>/mean"
            )

    def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep):
        """hidden [B, T, H] of the positions that predict the last T = logits_to_keep tokens, in the lm_head's dtype
        (an fp32 head with cast_lm_head_to_fp32), and the lm_head."""
        backbone, head = backbone_and_head(model)
        T = input_ids.shape[1]
        targets = torch.zeros_like(attention_mask)
        targets[:, T - logits_to_keep:] = attention_mask[:, T - logits_to_keep:]
        # TRL's [left-padded prompt | completion | padding] rows run without their mask (fastgrpo.loss.row_layout);
        # not under NEFTune, whose noise is drawn for, and scaled by, the padded rows' shape
        if self.args.neftune_noise_alpha is None:
            layout = unpadded(attention_mask, *read_ints(*padding_facts(attention_mask, targets)))
        else:
            layout = as_given(attention_mask)
        with self.accelerator.autocast():
            hidden = take_columns(run_backbone(backbone, input_ids, layout), layout,
                                  slice(T - logits_to_keep - 1, T - 1))
        return hidden.to(head.weight.dtype), head

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """TRL's contract: (log-probs [B, T], entropies [B, T] or None, None) of the last T = logits_to_keep tokens
        at temperature self.temperature, 0 where attention_mask is 0; differentiable when grad is on."""
        if compute_aux_loss or any(value is not None for value in multimodal.values()):
            raise ValueError("FastGRPOTrainer: MoE auxiliary losses and multimodal inputs are not supported")
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            hidden, head = self._completion_hidden(model, input_ids[rows], attention_mask[rows], logits_to_keep)
            with _no_autocast(hidden):
                out = fused_linear_logprobs(
                    hidden, head.weight, input_ids[rows, -logits_to_keep:], temperature=self.temperature,
                    bias=head_bias(head), softcap=logit_softcap(model), return_entropy=compute_entropy,
                    backend=self.fastgrpo_backend,
                )
            valid = attention_mask[rows, -logits_to_keep:].bool()
            lp, ent = out if compute_entropy else (out, None)
            logps.append(torch.where(valid, lp, 0.0))
            if compute_entropy:
                entropies.append(torch.where(valid, ent, 0.0))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _loss_config(self, model, mode: str, inputs) -> GRPOLossConfig:
        """TRL's options for this micro-batch (TRL 1.16 GRPOTrainer._compute_loss's normalizers)."""
        args = self.args
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        num_items, coef = None, 0.0
        if self.loss_type in TOKEN_SUM_TYPES:  # num_items_in_batch spans the generation batch: one window's share
            num_items = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                num_items = num_items * accumulation / args.steps_per_generation
        if self._entropy_bonus_enabled:  # the bonus is a mean / accumulation whatever the loss type normalizes by
            coef = self.entropy_coef
            if self.use_adaptive_entropy and not self._last_world_entropy <= args.entropy_target:
                coef = 0.0
            coef = coef / accumulation if self.loss_type in TOKEN_SUM_TYPES else coef
        return GRPOLossConfig(
            beta=self.beta, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high, delta=args.delta,
            loss_type=self.loss_type, importance_sampling_level=self.importance_sampling_level,
            temperature=self.temperature, max_completion_length=self.max_completion_length,
            num_items_in_batch=num_items, softcap=logit_softcap(model),
            sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
            vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg, top_entropy_quantile=self.top_entropy_quantile,
            off_policy_mask_threshold=self.off_policy_mask_threshold,
            use_bias_correction_kl=args.use_bias_correction_kl, entropy_coef=coef,
        )

    def _compute_loss(self, model, inputs):
        """TRL's contract: the micro-batch loss, scaled for gradient accumulation, with TRL's metrics logged."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        completion_mask = inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], completion_mask], dim=1)
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        mode = "train" if self.model.training else "eval"
        config = self._loss_config(model, mode, inputs)
        B, T = completion_ids.shape
        # TRL multiplies the policy term by the rollout correction with vLLM (vespo folds it into its weight).
        weights = None
        if (self.use_vllm and self.vllm_importance_sampling_correction) or self.loss_type == "vespo":
            weights = inputs.get("importance_sampling_ratio")
            weights = None if weights is None else weights.expand(B, T)
        hidden, head = self._completion_hidden(model, input_ids, attention_mask, T)
        with _no_autocast(hidden):
            loss, metrics = fused_linear_grpo_loss(
                hidden, head.weight, completion_ids, mask, inputs["advantages"],
                old_logps=inputs.get("old_per_token_logps"),
                ref_logps=inputs.get("ref_per_token_logps") if self.beta != 0.0 else None, config=config,
                bias=head_bias(head), return_entropy=True, token_weights=weights,
                sampling_logps=inputs.get("sampling_per_token_logps"), backend=self.fastgrpo_backend,
            )
        policy_loss = metrics.get("policy_loss", loss.detach())
        if self.loss_type not in TOKEN_SUM_TYPES:
            loss = loss / (self.current_gradient_accumulation_steps if mode == "train" else 1.0)
        self._log_loss_metrics(mode, metrics, mask, policy_loss)
        return loss

    def _log_loss_metrics(self, mode: str, metrics: dict, mask: torch.Tensor, policy_loss: torch.Tensor) -> None:
        """TRL 1.16 _compute_loss's metrics (one process: its reduce / gather are the identity) and its adaptive
        entropy controller, whose state (entropy_coef, _last_world_entropy) TRL saves with each checkpoint."""
        logged = self._metrics[mode]
        if self._entropy_bonus_enabled:
            logged["policy_loss"].append(policy_loss.item())
            if self.use_adaptive_entropy and mode == "train":
                count = mask.sum() * metrics.get("entropy_mask_ratio", 1.0)
                stats = torch.stack([metrics.get("entropy_kept", metrics["entropy"]) * count, count]).detach()
                self._entropy_window_stats = stats if self._entropy_window_stats is None else (
                    self._entropy_window_stats + stats)
                if self.accelerator.sync_gradients:
                    window = self._entropy_window_stats
                    world_entropy = (window[0] / window[1].clamp(min=1.0)).item()
                    step = self.args.entropy_coef_delta
                    if world_entropy <= self.args.entropy_target:
                        self.entropy_coef = min(self.entropy_coef + step, self.args.entropy_coef_max)
                    else:
                        self.entropy_coef = max(self.entropy_coef - step, self.args.entropy_coef_min)
                    self._last_world_entropy, self._entropy_window_stats = world_entropy, None
            if mode == "train" and self.accelerator.sync_gradients:
                logged["entropy_coef"].append(self.entropy_coef)
        if self.beta != 0.0:
            logged["kl"].append(metrics["kl"].item())
        logged["entropy"].append(metrics["entropy"].item())
        if self.loss_type in CLIP_LOSS_TYPES:
            low, high = metrics["clip_ratio_low"].item(), metrics["clip_ratio_high"].item()
            logged["clip_ratio/low_mean"].append(low)
            logged["clip_ratio/high_mean"].append(high)
            logged["clip_ratio/region_mean"].append(low + high)  # disjoint: A < 0 and A > 0
            # TRL's per-sequence shares are NaN for a sequence without tokens at token level: all NaN, NaN.
            empty = self.importance_sampling_level == "token" and not bool(mask.any())
            logged["clip_ratio/low_min"].append(math.nan if empty else metrics["clip_ratio_low_min"].item())
            logged["clip_ratio/high_max"].append(math.nan if empty else metrics["clip_ratio_high_max"].item())
        elif self.loss_type == "cispo":
            logged["cispo_clip_ratio"].append(metrics["clip_ratio_high"].item())
        elif self.loss_type == "vespo":
            logged["vespo/phi_seq_mean"].append(metrics["vespo_phi"].item())


__all__ = ["FastGRPOTrainer", "SUPPORTED_TRL"]
