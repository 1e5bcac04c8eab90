"""FastGRPOTrainer given a model the user patched first, as the README's two usages combine: `model =
fastgrpo.patch_model(model, ...)` in their script, then the TRL swap. The trainer patches the policy again (its loss
never calls the model's forward, so fused_loss=False); before, that re-patch used patch_model's defaults and dropped
the user's options without a word (offload_activations=True: the run trained with HF's checkpointing, the memory
gone; lora_dtype="adapter": other numbers; rms_norm=False: the kernel the user switched off back on). And a causal
LM outside patch_model's table, which the default patch=True cannot patch: one line naming patch=False.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from fastgrpo.hf.models import unwrap_peft  # noqa: E402
from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402
from fastgrpo.patching import patch_model  # noqa: E402
from tests.test_trl import build_tokenizer, model_dir, vowel_reward  # noqa: E402,F401 (model_dir is a fixture)
from tests.test_trl_parity_more import grpo_config  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
KERNELS = ("rms_norm", "rope", "swiglu")  # the options the reference shares with the policy
PATCH_DEFAULTS = dict(patch_model.__kwdefaults__)


def prepatched_trainer(model_dir, tmp_path, options: dict, peft: bool, **kwargs) -> FastGRPOTrainer:
    model = patch_model(AutoModelForCausalLM.from_pretrained(model_dir), **options)
    return FastGRPOTrainer(model=model, reward_funcs=vowel_reward,
                           args=grpo_config(tmp_path, gradient_checkpointing=True, max_steps=1, beta=0.04),
                           train_dataset=Dataset.from_dict({"prompt": ["2+2=", "abc"] * 4}),
                           processing_class=build_tokenizer(), peft_config=LoraConfig(**LORA) if peft else None,
                           **kwargs)


def summary(model) -> dict:
    return unwrap_peft(model).fastgrpo_patch_summary


def arguments(model) -> dict:
    return summary(model)["arguments"]


@pytest.mark.parametrize("options, peft", [
    (dict(rms_norm=False), False),  # a separate reference model (beta > 0, full fine-tuning)
    (dict(swiglu=False, offload_activations=True, recompute_layers=1), False),  # the reference: no offload
    (dict(lora_dtype="adapter", swiglu=False), True),  # PEFT wraps the patched model: patched again
    (dict(offload_activations=True, recompute_layers=1), True),
], ids=str)
def test_a_model_patched_before_the_trainer_keeps_its_options(model_dir, tmp_path, options, peft):
    trainer = prepatched_trainer(model_dir, tmp_path, options, peft)
    kept = arguments(trainer.model)
    assert {name: kept[name] for name in options} == options, kept
    assert kept["fused_loss"] is False
    # patched again, not only its record of the arguments: the fused labels= loss is unbound
    assert summary(trainer.model)["options"]["fused_loss"] is False
    assert "fused_loss" not in summary(trainer.model)["patched"], summary(trainer.model)
    if trainer.ref_model is not None:  # the reference runs the kernels the policy runs, and nothing for training
        reference = arguments(trainer.ref_model)
        assert all(reference[name] == kept[name] for name in KERNELS), reference
        training_only = {name: value for name, value in PATCH_DEFAULTS.items() if name not in KERNELS}
        assert {name: reference[name] for name in training_only} == {**training_only, "fused_loss": False}, reference
    if options.get("offload_activations"):  # handed over from TRL's checkpointing, as offload_activations=True does
        assert trainer.args.gradient_checkpointing is False
        trainer.train()
        layers = unwrap_peft(trainer.model).model.layers
        assert [("_fastgrpo_offload" in layer.__dict__, bool(layer.gradient_checkpointing)) for layer in layers] == \
            [(True, False), (False, False)]


@pytest.mark.parametrize("recompute_layers", [1, 0])  # 0: no layer checkpointed, so no MLP tiled either
def test_the_trainers_keywords_go_over_the_users_patch(model_dir, tmp_path, recompute_layers):
    """The user's offload of every layer sized the tiled MLP's chunks; the trainer's recompute_layers=0 leaves no MLP
    tiled, and the size patch_model had resolved is not passed back as though the user had set it (a refusal)."""
    trainer = prepatched_trainer(model_dir, tmp_path, dict(rope=False, offload_activations=True), True,
                                 offload_activations=True, recompute_layers=recompute_layers)
    kept = arguments(trainer.model)
    assert (kept["rope"], kept["offload_activations"], kept["recompute_layers"]) == (False, True, recompute_layers)
    assert (kept["tiled_mlp"], kept["mlp_chunk_tokens"]) == (None, None)  # as the user gave them
    tiled = summary(trainer.model)["patched"].get("tiled_mlp", 0)
    assert tiled == recompute_layers, summary(trainer.model)  # the checkpointed layers' MLPs alone


def test_an_unpatched_model_leaves_patch_models_defaults_as_they_were(model_dir, tmp_path):
    """The trainer's options start from patch_model's defaults for a model nobody patched: a copy of them, which its
    keywords go over (written into patch_model's own, every later patch_model call would take them)."""
    trainer = FastGRPOTrainer(model=model_dir, reward_funcs=vowel_reward, args=grpo_config(tmp_path, max_steps=1),
                              train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
                              processing_class=build_tokenizer(), offload_activations=True, recompute_layers=1)
    assert (arguments(trainer.model)["offload_activations"], arguments(trainer.model)["recompute_layers"]) == (True, 1)
    assert patch_model.__kwdefaults__ == PATCH_DEFAULTS


def test_recompute_layers_alone_chooses_among_the_users_offloaded_layers(model_dir, tmp_path):
    """Before, recompute_layers without offload_activations=True was refused as though offload were off."""
    trainer = prepatched_trainer(model_dir, tmp_path, dict(offload_activations=True), False, recompute_layers=1)
    assert (arguments(trainer.model)["offload_activations"], arguments(trainer.model)["recompute_layers"]) == (True, 1)


def test_recompute_layers_without_patch_is_refused_naming_it(model_dir, tmp_path):
    """patch=False leaves a user-patched model as it is: recompute_layers, which only a patch applies, is the keyword
    refused (not offload_activations, which the user did not pass)."""
    with pytest.raises(ValueError, match=r"^FastGRPOTrainer cannot honour: recompute_layers: "):
        prepatched_trainer(model_dir, tmp_path, dict(offload_activations=True), False, recompute_layers=1, patch=False)


def test_an_fp8_base_patched_before_a_bf16_trainer_is_refused(model_dir, tmp_path):
    """The user's fp8_base under TRL's bf16 autocast would run PEFT's forward, the base in bf16: the trainer's own
    fp8_base=True is refused there, and so is a model patched with it."""
    from peft import get_peft_model

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(**LORA, lora_dropout=0.0))
    patch_model(model, fp8_base=True)
    with pytest.raises(ValueError, match=r"^FastGRPOTrainer cannot honour: fp8_base: .*set bf16=False"):
        FastGRPOTrainer(model=model, reward_funcs=vowel_reward, args=grpo_config(tmp_path, bf16=True),
                        train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=build_tokenizer())


def test_a_model_type_without_fused_layers_names_patch_false(tmp_path):
    """A causal LM outside patch_model's table (GPT-2 here) trains on fastgrpo's loss with patch=False; with the
    default patch=True it was patch_model's own error, naming neither the trainer nor the way out."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, pad_token_id=0, eos_token_id=1))
    kwargs = dict(model=model, reward_funcs=vowel_reward, args=grpo_config(tmp_path),
                  train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=build_tokenizer())
    match = (r"^FastGRPOTrainer cannot honour: patch: fastgrpo.patch_model has no fused layers for model_type "
             r"'gpt2' \(it has: \[.*'llama'.*\]\); pass patch=False to train it on fastgrpo's loss alone$")
    with pytest.raises(ValueError, match=match):
        FastGRPOTrainer(**kwargs)
    assert "fastgrpo_patch_summary" not in FastGRPOTrainer(**kwargs, patch=False).model.__dict__
