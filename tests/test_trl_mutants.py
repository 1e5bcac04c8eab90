"""What tests/test_trl*.py let through when FastGRPOTrainer's code was changed one small bug at a time (a mutation
audit): refusals that no longer fire (FSDP, a vision-language processor, configs that scale the logits, the MoE
auxiliary loss, prompt-learning adapters, recompute_layers=0 without offload, a positional GRPOConfig read only after
the model loads), the reference model left unpatched, an ActivationOffloader handed over without taking TRL's
checkpointing over, log-probs at the wrong temperature, not 0 at padding or of a bf16 backbone under an fp32 head, the
off-policy mask fed the old log-probs instead of the sampler's, and TRL's adaptive entropy controller over an
accumulation window (its window sums, its caps, its state in eval). Each against trl.GRPOTrainer on the same
micro-batches where TRL computes it; tolerances are tests/test_trl.py's (the bf16 one: TRL's own bf16 error).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from transformers import GraniteConfig, GraniteForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fastgrpo.hf.models import unwrap_peft  # noqa: E402
from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402
from tests.test_trl import (  # noqa: E402,F401 (model_dir and trainer_pair are fixtures)
    ABS, REL, build, build_tokenizer, close, configure, grpo_config, micro_batch, model_dir, trainer_pair, vowel_reward,
)

PROMPTS = Dataset.from_dict({"prompt": ["2+2=", "abc"] * 2})
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def fast_trainer(model, tmp_path, args=None, **kwargs) -> FastGRPOTrainer:
    return FastGRPOTrainer(model=model, reward_funcs=vowel_reward, args=args or grpo_config(tmp_path),
                           train_dataset=PROMPTS, processing_class=build_tokenizer(), **kwargs)


# ---- refusals ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, kwargs, match", [
    (dict(fsdp="full_shard"), {}, "fsdp: one process only, "),
    (dict(gradient_checkpointing=True), dict(recompute_layers=0), "recompute_layers: chooses the layers "),
], ids=["fsdp", "recompute_layers=0-without-offload"])
def test_refused_before_the_model_loads(tmp_path, fields, kwargs, match):
    """The model path does not exist: a refusal checked only after loading would surface TRL's loading error."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                      num_generations=4, **fields)
    with pytest.raises(ValueError, match=f"^FastGRPOTrainer cannot honour: {match}"):
        fast_trainer(str(tmp_path / "no-such-model"), tmp_path, args=args, **kwargs)


@pytest.mark.parametrize("asked, named", [
    ("deepspeed", "deepspeed"),
    ("deepspeed_plugin", "ACCELERATE_USE_DEEPSPEED (accelerate launch --use_deepspeed, or its config)"),
])
def test_a_deepspeed_setup_is_refused_naming_where_it_came_from(tmp_path, asked, named):
    """What TrainingArguments leaves for GRPOConfig(deepspeed="ds_zero3.json") (args.deepspeed and a DeepSpeedPlugin)
    or for `accelerate launch --use_deepspeed` (a DeepSpeedPlugin alone: args.deepspeed unset, which was all that was
    checked, so that run was not refused). TrainingArguments builds neither without DeepSpeed installed: they are set
    on a built config here. The refusal was 'one process only: ...', naming no setting."""
    from accelerate.utils import DeepSpeedPlugin

    args = grpo_config(tmp_path)
    args.deepspeed_plugin = DeepSpeedPlugin(zero_stage=3)
    if asked == "deepspeed":
        args.deepspeed = "ds_zero3.json"
    with pytest.raises(ValueError) as refused:
        fast_trainer(str(tmp_path / "no-such-model"), tmp_path, args=args)
    assert str(refused.value) == (
        f"FastGRPOTrainer cannot honour: {named}: one process only, without DeepSpeed or FSDP (fastgrpo's loss reads "
        "the lm_head weight and runs the backbone outside the DDP / DeepSpeed / FSDP wrapper); launch a single "
        "process without it, use trl.GRPOTrainer, or for several GPUs `torchrun -m fastgrpo train` (FSDP2 / DDP)")


def test_a_positional_grpo_config_is_checked_before_the_model_loads(tmp_path):
    """GRPOTrainer(model, reward_funcs, args, ...): the config is the third positional argument too."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], per_device_train_batch_size=4,
                      num_generations=4, torch_compile=True)
    with pytest.raises(ValueError, match="^FastGRPOTrainer cannot honour: torch_compile: "):
        FastGRPOTrainer(str(tmp_path / "no-such-model"), vowel_reward, args, PROMPTS)


def saved(tmp_path, model) -> str:
    model.save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def granite(logits_scaling: float):
    return GraniteForCausalLM(GraniteConfig(**SIZES, logits_scaling=logits_scaling))


def qwen2_moe():  # TRL enables the auxiliary loss: the config has output_router_logits, router_aux_loss_coef 0.001
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**SIZES, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                              num_experts=2, num_experts_per_tok=1))


@pytest.mark.parametrize("build, kwargs, match", [
    (lambda: granite(2.0), {}, r"model: config.logits_scaling=2.0 scales the logits"),
    (qwen2_moe, {}, "router_aux_loss_coef: the MoE load-balancing loss is not computed"),
    (None, "prompt_tuning", "peft_config: prompt-learning adapters"),
], ids=["granite-logits_scaling", "qwen2_moe-aux_loss", "prompt_tuning"])
def test_what_the_model_asks_is_refused_after_it_loads(model_dir, tmp_path, build, kwargs, match):
    if kwargs == "prompt_tuning":
        from peft import PromptTuningConfig

        kwargs = dict(peft_config=PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    model = model_dir if build is None else saved(tmp_path, build())
    with pytest.raises(ValueError, match=f"^FastGRPOTrainer cannot honour: {match}"):
        fast_trainer(model, tmp_path, patch=False, **kwargs)


def test_a_vision_language_processor_is_refused(tmp_path):
    """A tiny Llava (CLIP vision tower, Qwen2 text model) with its processor: fastgrpo runs the text backbone on
    input_ids alone, so the images would be dropped without a word."""
    from transformers import (
        CLIPImageProcessor, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor, Qwen2Config,
    )

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=16)
    config = LlavaConfig(vision_config=vision, text_config=Qwen2Config(**SIZES),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    path = saved(tmp_path, LlavaForConditionalGeneration(config))
    processor = LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 28},
                                                                  crop_size={"height": 28, "width": 28}),
                               tokenizer=tokenizer, image_token="<image>", patch_size=14)
    with pytest.raises(ValueError, match="^FastGRPOTrainer cannot honour: processing_class: vision-language models"):
        FastGRPOTrainer(model=path, reward_funcs=vowel_reward, args=grpo_config(tmp_path), train_dataset=PROMPTS,
                        processing_class=processor, patch=False)

def test_a_logit_scale_of_one_is_not_refused(tmp_path):
    """Granite's default logits_scaling is 1.0: its logits are the lm_head's, as fastgrpo computes them."""
    fast_trainer(saved(tmp_path, granite(1.0)), tmp_path, patch=False)


# ---- what FastGRPOTrainer sets up -------------------------------------------------------------------------------

def test_the_reference_model_is_patched_too(model_dir, tmp_path):
    """beta > 0 without PEFT: TRL loads a reference copy, which computes ref_per_token_logps on patch_model's layers
    (README: "fastgrpo.patch_model on the policy and a reference copy")."""
    trainer = fast_trainer(model_dir, tmp_path, args=grpo_config(tmp_path, beta=0.04))
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    for model in (trainer.model, trainer.ref_model):
        assert unwrap_peft(model).__dict__.get("fastgrpo_patch_summary"), type(model).__name__


def test_an_activation_offloader_takes_over_trls_checkpointing(model_dir, tmp_path):
    """offload_activations=ActivationOffloader(...) is offload as much as True is: TRL's flag must be off, or HF's
    Trainer turns HF's checkpointing on again at train() and the offload steps aside for the whole run."""
    from fastgrpo.offload import ActivationOffloader

    trainer = fast_trainer(model_dir, tmp_path, args=grpo_config(tmp_path, gradient_checkpointing=True),
                           offload_activations=ActivationOffloader("cpu"))
    assert trainer.args.gradient_checkpointing is False
    assert all("_fastgrpo_offload" in layer.__dict__ for layer in unwrap_peft(trainer.model).model.layers)


# ---- log-probs --------------------------------------------------------------------------------------------------

def test_log_probs_and_entropies_are_trls_at_its_temperature(model_dir, tmp_path):
    """_get_per_token_logps_and_entropies (the old and reference log-probs) of trainers built with temperature 0.7
    (TRL binds it to its fused lm_head then), in batches of 3 rows, on left-padded prompts and padded completions:
    TRL's values, and 0 at padding (TRL's)."""
    pair = [build(cls, model_dir, tmp_path / cls.__name__, patch=False, temperature=0.7)
            for cls in (GRPOTrainer, FastGRPOTrainer)]
    inputs = micro_batch(pair[0], None, False, False)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]
    results = []
    for trainer in pair:
        with torch.no_grad():
            logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, input_ids, attention_mask, T, batch_size=3, compute_entropy=True)
        results.append((logps, entropies))
    (want_logps, want_entropies), (logps, entropies) = results
    padding = inputs["completion_mask"] == 0
    assert bool(padding.any()) and bool((want_logps[padding] == 0).all()), "TRL's padding is 0: nothing compared"
    for name, want, got in (("logps", want_logps, logps), ("entropies", want_entropies, entropies)):
        err = (got - want).abs().max().item()
        assert err <= ABS + REL * want.abs().max().item(), f"{name}: max |fastgrpo - trl| {err:.2e}"
    assert bool((logps[padding] == 0).all()) and bool((entropies[padding] == 0).all())


def test_a_bf16_model_with_an_fp32_head_scores_as_trls(trainer_pair, model_dir, tmp_path):
    """model_init_kwargs dtype bf16 with cast_lm_head_to_fp32=True: a bf16 backbone under an fp32 lm_head (the head's
    dtype is what the fused lm_head takes). Against TRL's fp32 trainer, fastgrpo's log-probs are no further off than
    TRL's own bf16 trainer's (the bf16 backbone's rounding dominates, ~1e-3 here), as in
    test_trl_parity_more.test_bf16_autocast_is_no_less_precise_than_trls."""
    inputs = micro_batch(trainer_pair[0], None, False, False)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    T = inputs["completion_ids"].shape[1]

    def logps_of(trainer):
        with torch.no_grad():
            return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, T)[0]

    want = logps_of(trainer_pair[0])
    errors = []
    for cls in (GRPOTrainer, FastGRPOTrainer):
        trainer = build(cls, model_dir, tmp_path / cls.__name__, patch=False, cast_lm_head_to_fp32=True,
                        model_init_kwargs={"dtype": torch.bfloat16})
        assert (trainer.model.lm_head.weight.dtype, trainer.model.model.norm.weight.dtype) == \
            (torch.float32, torch.bfloat16)
        errors.append((logps_of(trainer) - want).abs().max().item())
    trl_error, fast_error = errors
    assert trl_error > 1e-4, "the bf16 backbone did not apply: nothing is compared"
    assert fast_error <= 1.25 * trl_error, errors

def test_the_off_policy_mask_reads_the_samplers_log_probs(trainer_pair):
    """With vLLM, TRL's off-policy mask compares the policy with the sampler's log-probs (sampling_per_token_logps),
    not the old ones: a sampler 1 nat above the old log-probs drops the negative-advantage sequence at a threshold of
    0.5 that the old log-probs (0.3 nat of noise) keep."""
    inputs = micro_batch(trainer_pair[0], None, True, False)
    inputs = {**inputs, "sampling_per_token_logps": inputs["old_per_token_logps"] + 1.0}
    without_sampler = {k: v for k, v in inputs.items() if k != "sampling_per_token_logps"}
    losses = []
    for trainer, batch in ((trainer_pair[0], without_sampler), *((t, inputs) for t in trainer_pair)):
        configure(trainer, dict(loss_type="grpo", off_policy_mask_threshold=0.5))
        losses.append(trainer._compute_loss(trainer.model, batch).item())
    trl_without_sampler, want, got = losses
    assert not close(trl_without_sampler, want), "the sampler's log-probs changed nothing in TRL: nothing compared"
    assert close(want, got), f"loss: trl {want!r}, fastgrpo {got!r}"

# ---- TRL's adaptive entropy controller ---------------------------------------------------------------------------

def second_micro_batch(inputs: dict) -> dict:
    """Another micro-batch of the window: fewer and an odd number of valid tokens (another share kept by the
    entropy mask, so a window mean weighted by the wrong counts differs), other advantages."""
    mask = inputs["completion_mask"].clone()
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    return {**inputs, "completion_mask": mask, "advantages": torch.tensor([-0.3, 0.9, -1.1, 0.5])}


@pytest.mark.parametrize("coef, target, bound", [
    (0.98, 10.0, dict(entropy_coef_max=1.0)),  # entropy under the target: coef + delta, capped at the maximum
    (0.03, 0.0, dict(entropy_coef_min=0.0)),  # over it: coef - delta, floored at the minimum
], ids=["raised-to-max", "lowered-to-min"])
def test_adaptive_entropy_over_an_accumulation_window_is_trls(trainer_pair, coef, target, bound):
    """Two micro-batches of one window (the first without sync_gradients), the entropy mask on, then an evaluation:
    the same losses and metrics, the window's token-weighted mean entropy, the coefficient's update (with its cap)
    and no update from the evaluation."""
    first = micro_batch(trainer_pair[0], None, False, False)
    results = []
    for trainer in trainer_pair:
        configure(trainer, dict(loss_type="grpo", top_entropy_quantile=0.3, entropy_coef=coef,
                                use_adaptive_entropy=True, entropy_target=target))
        saved_args = {name: getattr(trainer.args, name) for name in ("entropy_coef_delta", *bound)}
        trainer.args.entropy_coef_delta = 0.05
        for name, value in bound.items():
            setattr(trainer.args, name, value)
        state = trainer.accelerator.gradient_state
        losses = []
        try:
            for sync, inputs in ((False, first), (True, second_micro_batch(first))):
                state._set_sync_gradients(sync)
                losses.append(trainer._compute_loss(trainer.model, inputs).item())
            after_window = (trainer.entropy_coef, trainer._last_world_entropy)
            trainer.model.eval()
            trainer._metrics["eval"].clear()
            losses.append(trainer._compute_loss(trainer.model, first).item())
        finally:
            state._set_sync_gradients(True)
            trainer.model.train()
            for name, value in saved_args.items():
                setattr(trainer.args, name, value)
        metrics = {f"{mode}/{k}": list(v) for mode in ("train", "eval") for k, v in trainer._metrics[mode].items()}
        results.append((losses, after_window, (trainer.entropy_coef, trainer._last_world_entropy), metrics))
    (want_losses, want_window, want_end, want_metrics), (losses, window, end, metrics) = results
    assert want_window[0] != coef, "the coefficient did not move: nothing is compared"
    assert all(close(a, b) for a, b in zip(want_losses, losses)), (want_losses, losses)
    assert window[0] == pytest.approx(want_window[0], abs=1e-12), f"entropy_coef: trl {want_window}, fastgrpo {window}"
    assert close(want_window[1], window[1]), f"window entropy: trl {want_window[1]!r}, fastgrpo {window[1]!r}"
    assert end == pytest.approx(want_end), f"after evaluation: trl {want_end}, fastgrpo {end}"
    assert set(metrics) == set(want_metrics), set(metrics) ^ set(want_metrics)
    for key, values in want_metrics.items():
        assert len(values) == len(metrics[key]) and all(close(a, b) for a, b in zip(values, metrics[key])), \
            f"{key}: trl {values}, fastgrpo {metrics[key]}"
