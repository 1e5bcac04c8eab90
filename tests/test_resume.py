"""Checkpoint / resume: 6 steps straight and 3 + resume + 3 give bit-identical losses and rewards (the newest
checkpoint torn by a kill is skipped with a warning); LoRA export merges the adapter into the base."""
import logging

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fastgrpo.train.final_export import export_model
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer

KEYS = ("reward", "reward_std", "loss", "grad_norm", "kl", "kl_p95", "beta", "entropy", "clip_ratio", "lr",
        "completion_length", "entropy_coef")
# The full run adapts an entropy bonus too: its coefficient rises every update (entropy under the target).
ADAPTIVE_ENTROPY = {"entropy_coef": 0.01, "use_adaptive_entropy": True, "entropy_target": 100.0,
                    "entropy_coef_delta": 0.01}


def _trainer(tmp_path, lora: bool, **fields):
    config = GRPOConfig(**{
        **default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 2,
        "num_minibatches": 2, "num_iterations": 2, "max_completion_length": 6, "max_steps": 6, "save_steps": 3,
        "beta": 0.05, "kl_target": 0.01, "lr_scheduler": "cosine", "warmup_steps": 2, "learning_rate": 1e-2,
        "output_dir": str(tmp_path), "export": False, "progress_bar": False, **fields,
    })
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=1)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(2)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.1))
    return GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(64), config)


@pytest.mark.parametrize("lora, one_update", [(False, False), (True, False), (True, True)],
                         ids=["full", "lora", "lora-one-update"])
def test_resume_is_bit_identical(tmp_path, lora, one_update, caplog):
    fields = {} if lora else ADAPTIVE_ENTROPY
    if one_update:  # one optimizer step per GRPO step: the KL comes from the loss's log-probs, no old pass
        fields = {**fields, "num_minibatches": 1, "num_iterations": 1}
    straight = _trainer(tmp_path, lora, **fields).train()
    assert [m["step"] for m in straight] == list(range(1, 7))
    state = tmp_path / "checkpoint-6" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # torn, as by a file system without rename
    assert latest_checkpoint(tmp_path).name == "checkpoint-6"
    torch.manual_seed(12345)  # a different global RNG state: the checkpoint's must be restored
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.checkpoint"):
        resumed = _trainer(tmp_path, lora, resume=True, **fields).train()
    assert "skipped checkpoint-6, which is incomplete or damaged" in caplog.text
    assert [m["step"] for m in resumed] == [4, 5, 6]
    for a, b in zip(straight[3:], resumed):
        assert {k: a[k] for k in KEYS} == {k: b[k] for k in KEYS}
    assert straight[0]["kl"] == 0.0 and straight[-1]["kl"] > 0  # the reference is the initial policy
    assert straight[-1]["beta"] != 0.05  # adaptive beta moved, and was restored on resume
    if not lora:
        assert straight[-1]["entropy_coef"] > straight[3]["entropy_coef"] > 0.01  # moved, and restored on resume
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 6  # the resumed run replaced steps 4-6, it did not append a second copy


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="resume: no checkpoint"):
        _trainer(tmp_path, False, resume=True).train()
    missing = tmp_path / "never_made"
    with pytest.raises(ValueError, match="resume: no checkpoint"):
        _trainer(missing, False, resume=True).train()
    assert not missing.exists()  # the lock's folder goes again: nothing was written there


def test_checkpoint_of_another_model_is_an_error(tmp_path):
    from peft import LoraConfig, get_peft_model

    tokenizer = default_task.build_tokenizer()

    def lora(rank, targets):
        model = default_task.build_model(tokenizer)
        return get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=targets))

    save_checkpoint(tmp_path / "a", lora(1, ["q_proj"]), {"step": 1})
    with pytest.raises(ValueError, match=r"checkpoint: parameter .*lora_A.* has shape \(1, 64\)"):
        load_checkpoint(tmp_path / "a", lora(4, ["q_proj"]))  # [1, 64] would broadcast into [4, 64]
    with pytest.raises(ValueError, match="checkpoint: lacks the model's trainable parameters .*v_proj"):
        load_checkpoint(tmp_path / "a", lora(1, ["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="checkpoint: parameters .* are not in the model"):
        load_checkpoint(tmp_path / "a", lora(1, ["v_proj"]))


def test_lora_export_merges_into_the_base(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    tokenizer = default_task.build_tokenizer()
    model = get_peft_model(default_task.build_model(tokenizer), LoraConfig(r=4, lora_alpha=8,
                                                                           target_modules="all-linear"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # a non-zero update to merge
    ids = torch.randint(3, len(tokenizer), (2, 9))
    with torch.no_grad():
        expected = model(ids).logits.double()
        base = model.get_base_model()
        with model.disable_adapter():
            unmerged = model(ids).logits.double()
    assert (expected - unmerged).abs().max() > 1e-3
    export_model(model, tokenizer, tmp_path / "fp32", dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    with torch.no_grad():
        got = merged(ids).logits.double()
    assert (got - expected).abs().max() < 1e-4
    assert any("lora" in n for n, _ in base.named_parameters())  # the trained model is left as it was
    export_model(model, tokenizer, tmp_path / "bf16", dtype=torch.bfloat16)  # default: the base's (test_export_lora)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert (tmp_path / "bf16" / "tokenizer.json").exists()
