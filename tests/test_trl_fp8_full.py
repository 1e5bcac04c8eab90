"""FastGRPOTrainer(fp8_base=True) on full fine-tuning (no peft_config): patch_model's FP8 linears in the policy and in
TRL's reference model (beta > 0), through TRL's own training loop (tests/test_fp8_trained.py checks their math).

- Two TRL steps with beta > 0, TRL's gradient checkpointing and sync_ref_model (TRL writes the reference's weights
  through .data after each step): every call of every decoder linear of the policy (rollout, update, recompute) and
  of the reference gives fp8_base_product's output over the e4m3 copy of the weight it has at that call, bit for bit,
  never F.linear's; the weights moved; the first step's kl is 0 (the reference's numbers are the policy's).
- A model the user patched with fp8_base before handing it over keeps it, its reference too; under TRL's bf16 it is
  refused as the trainer's own keyword is.
- What still cannot run in FP8 is refused before TRL loads the model, in one whole line: patch=False, and TRL's
  bf16 / fp16 mixed precision (the FP8 linears leave an autocast pass to F.linear).
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import fastgrpo  # noqa: E402
from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402
from fastgrpo.ops.fp8_base import FP8_WEIGHT_ATTR, fp8_base_product  # noqa: E402
from fastgrpo.ops.fp8_linear import quantize_fp8  # noqa: E402
from fastgrpo.ops.fp8_trained import fp8_linears  # noqa: E402
from tests.test_fp8_trained import cpu_scaled_mm  # noqa: E402
from tests.test_trl import build_tokenizer, grpo_config, model_dir, vowel_reward  # noqa: E402,F401 (a fixture)

LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down: test_trl's Qwen2 has every side a multiple of 16


def decoder_linears(model) -> list[torch.nn.Linear]:
    return [m for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]


def record_fp8_calls(model) -> tuple[dict, list]:
    """Forward hooks on the decoder linears: for each call, whether its output is fp8_base_product's over the e4m3
    copy of the weight as it is at that call (a copy kept past a weight change fails it) and not F.linear's."""
    calls = defaultdict(list)

    def check(layer, args, out):
        with torch.no_grad():
            x = args[0]
            want = fp8_base_product(x.reshape(-1, x.shape[-1]), *quantize_fp8(layer.weight.detach()), layer.bias)
            calls[layer].append(torch.equal(out, want.view(out.shape))
                                and not torch.equal(out, F.linear(x, layer.weight, layer.bias)))

    return calls, [layer.register_forward_hook(check) for layer in decoder_linears(model)]


@cpu_scaled_mm
def test_full_fine_tuning_trains_every_linear_in_fp8(model_dir, tmp_path):
    args = grpo_config(tmp_path, beta=0.04, gradient_checkpointing=True, sync_ref_model=True, ref_model_sync_steps=1,
                       ref_model_mixup_alpha=0.5)
    trainer = FastGRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["2+2=", "abc"] * 4}),
                              processing_class=build_tokenizer(), fp8_base=True)
    models = {"policy": trainer.model, "reference": trainer.ref_model}
    for name, model in models.items():
        linears = decoder_linears(model)
        assert len(linears) == LINEARS_PER_LAYER * model.config.num_hidden_layers
        assert set(fp8_linears(model)) == set(linears), name
        assert model.fastgrpo_patch_summary["arguments"]["fp8_base"] is True, name
    before = {name: [layer.weight.detach().clone() for layer in decoder_linears(model)]
              for name, model in models.items()}
    recorded = {name: record_fp8_calls(model) for name, model in models.items()}
    trainer.train()
    for name, model in models.items():
        calls, handles = recorded[name]
        for handle in handles:
            handle.remove()
        linears = decoder_linears(model)
        assert set(calls) == set(linears), f"{name}: {len(calls)} of {len(linears)} linears ran"
        # two generations: a reference pass each, the second over the weights TRL's sync wrote after step 1
        assert all(len(calls[layer]) >= 2 for layer in linears), name
        not_fp8 = {i: calls[layer].count(False) for i, layer in enumerate(linears) if not all(calls[layer])}
        assert not not_fp8, f"{name}: calls not FP8 over the current weight, per linear: {not_fp8}"
        assert all(FP8_WEIGHT_ATTR in layer.__dict__ for layer in linears), name
        moved = [not torch.equal(old, layer.weight) for old, layer in zip(before[name], linears)]
        assert all(moved), f"{name}: weights moved by training (the reference by TRL's sync): {moved}"
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in logged] == [1, 2]
    # before the first update the reference computes the policy's numbers, FP8 in both (one without FP8: kl > 0)
    assert logged[0]["kl"] == 0.0 and logged[1]["kl"] > 0, logged


BF16_REFUSAL = ("fp8_base: runs in fastgrpo's FP8 linears, which leave TRL's mixed precision to F.linear (the backbone "
                "under autocast, every decoder linear in bf16); set bf16=False and load the model in bf16 "
                "(model_init_kwargs={'dtype': torch.bfloat16})")


def prepatched_trainer(model_dir, tmp_path, **fields) -> FastGRPOTrainer:
    model = fastgrpo.patch_model(AutoModelForCausalLM.from_pretrained(model_dir), fp8_base=True)
    return FastGRPOTrainer(model=model, reward_funcs=vowel_reward, args=grpo_config(tmp_path, beta=0.04, **fields),
                           train_dataset=Dataset.from_dict({"prompt": ["2+2="] * 4}),
                           processing_class=build_tokenizer())


@cpu_scaled_mm
def test_a_model_patched_with_fp8_base_keeps_it(model_dir, tmp_path):
    trainer = prepatched_trainer(model_dir, tmp_path)
    for model in (trainer.model, trainer.ref_model):
        assert set(fp8_linears(model)) == set(decoder_linears(model))
    with pytest.raises(ValueError) as caught:
        prepatched_trainer(model_dir, tmp_path, bf16=True)
    assert str(caught.value) == "FastGRPOTrainer cannot honour: " + BF16_REFUSAL


@pytest.mark.parametrize("fields, kwargs, message", ids=["patch", "bf16", "fp16"], argvalues=[
    ({}, dict(patch=False), "fp8_base: runs in fastgrpo.patch_model's layers; keep patch=True"),
    (dict(bf16=True), {}, BF16_REFUSAL),
    (dict(fp16=True), {}, "fp8_base: runs in fastgrpo's FP8 linears, which leave TRL's mixed precision to F.linear "
                          "(the backbone under autocast, every decoder linear in fp16); set fp16=False and load the "
                          "model in bf16 (model_init_kwargs={'dtype': torch.bfloat16})"),
])
def test_what_cannot_run_in_fp8_is_refused_before_loading(tmp_path, fields, kwargs, message):
    with pytest.raises(ValueError) as caught:
        FastGRPOTrainer(model="/nonexistent/model", reward_funcs=vowel_reward, args=grpo_config(tmp_path, **fields),
                        train_dataset=Dataset.from_dict({"prompt": ["2+2="] * 4}), processing_class=build_tokenizer(),
                        fp8_base=True, **kwargs)
    assert str(caught.value) == "FastGRPOTrainer cannot honour: " + message
