"""FastGRPOTrainer with Liger-Kernel: use_liger_kernel=True with and without patch, and a model Liger has patched
(real liger-kernel and TRL, the tiny Qwen2 of tests/test_trl.py)."""
import pytest

pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed (pip install liger-kernel)")
pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")

from datasets import Dataset  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from fastgrpo.integrations.trl import FastGRPOTrainer  # noqa: E402
from tests.test_liger import liger_instance, liger_undone  # noqa: E402,F401 (liger_undone is an autouse fixture)
from tests.test_trl import build_tokenizer, grpo_config, model_dir, vowel_reward  # noqa: E402,F401 (model_dir: fixture)


def build(model, tmp_path, use_liger_kernel=False, **kwargs):
    return FastGRPOTrainer(model=model, reward_funcs=vowel_reward,
                           args=grpo_config(tmp_path, use_liger_kernel=use_liger_kernel),
                           train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=build_tokenizer(),
                           **kwargs)


def test_patch_false_runs_ligers_layers_under_fastgrpos_loss(model_dir, tmp_path):
    """Before, use_liger_kernel=True was refused with patch=False too, where Liger's layer kernels replace nothing of
    fastgrpo's: TRL applies them without Liger's loss, and FastGRPOTrainer computes its own."""
    trainer = build(model_dir, tmp_path, use_liger_kernel=True, patch=False)
    assert trainer.args.use_liger_kernel and trainer.args.liger_kernel_config["fused_linear_cross_entropy"] is False
    assert "fastgrpo_patch_summary" not in trainer.model.__dict__


def test_patch_true_refuses_use_liger_kernel_naming_the_ways_out(model_dir, tmp_path):
    with pytest.raises(ValueError, match="^FastGRPOTrainer cannot honour: use_liger_kernel: HF's Trainer would put "
                                         "Liger's layer kernels over the ones fastgrpo.patch_model binds; set "
                                         "use_liger_kernel=False, or patch=False to run Liger's layers under "
                                         "fastgrpo's loss$"):
        build(model_dir, tmp_path, use_liger_kernel=True)


def test_a_liger_patched_model_is_refused_before_it_is_patched(model_dir, tmp_path):
    """Before, patch_model replaced the Liger forwards of the model it was handed without a word. (Its own forward
    is TRL's fused lm_head by then, which calls Liger's.)"""
    model = liger_instance(Qwen2ForCausalLM.from_pretrained(model_dir))
    with pytest.raises(ValueError, match="^FastGRPOTrainer cannot honour: model: Liger-Kernel's forwards already run "
                                         "in its Qwen2MLP, Qwen2RMSNorm modules"):
        build(model, tmp_path)
    assert "fastgrpo_patch_summary" not in model.__dict__
