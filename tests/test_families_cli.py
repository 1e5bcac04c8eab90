"""The CLI as a user runs it on a local model folder of each supported family (tiny random weights from the configs
of tests/test_patching.py, the built-in tokenizer beside them): train (full and LoRA) and sft finish patched, their
exported final/ reloads in plain transformers with the trained model's logits, and eval runs on it."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import fastgrpo.train.sft as sft_module
import fastgrpo.train.trainer as trainer_module
from fastgrpo.hf.models import unwrap_peft
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from test_patching import CONFIGS

COMMON = ["--dtype", "float32", "--device", "cpu", "--max-steps", "2"]
RUNS = {
    # "length": completions of unequal lengths give nonzero advantages, so the weights move
    "train": ["train", "--max-prompt-length", "16", "--max-completion-length", "8", "--batch-size", "4",
              "--num-generations", "2", "--micro-batch-size", "4", "--reward-funcs", "length", "--no-progress-bar"],
    "lora": ["train", "--lora-rank", "4", "--max-prompt-length", "16", "--max-completion-length", "8",
             "--batch-size", "4", "--num-generations", "2", "--micro-batch-size", "4", "--reward-funcs", "length",
             "--no-progress-bar"],
    "sft": ["sft", "--max-seq-length", "16", "--batch-size", "4", "--micro-batch-size", "4", "--no-progress-bar"],
}
IDS = torch.tensor([[5, 9, 13, 7, 22, 3, 11, 30, 4, 8]])


def model_folder(model_type: str, folder):
    config = CONFIGS[model_type]()
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    default_task.build_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture
def exported(monkeypatch):
    """What each export saw: the patch summary of the model it was given and that model's logits on IDS."""
    seen = []

    def spying(export):
        def export_and_record(model, tokenizer, path, **kwargs):
            was_training = model.training
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=IDS).logits
            model.train(was_training)
            seen.append((getattr(unwrap_peft(model), "fastgrpo_patch_summary", None), logits))
            return export(model, tokenizer, path, **kwargs)

        return export_and_record

    for module in (trainer_module, sft_module):
        monkeypatch.setattr(module, "export_model", spying(module.export_model))
    return seen


# Every family through LoRA (patching, the fused LoRA, the merge in the export, eval); full training and sft on the
# families whose layouts differ most (Gemma-2's soft-capping, which SDPA refuses; Phi-3's fused qkv and gate_up;
# Qwen3's q/k norms): each case takes ~7 s on 2 cores.
CASES = [(model_type, "lora") for model_type in sorted(CONFIGS)] + [
    ("gemma2", "train"), ("gemma2", "sft"), ("phi3", "train"), ("qwen3", "sft")]


@pytest.mark.parametrize("model_type, run", CASES)
def test_a_family_trains_exports_and_evaluates_from_the_cli(tmp_path, exported, model_type, run):
    folder = model_folder(model_type, tmp_path / "model")
    out = tmp_path / "run"
    assert main([*RUNS[run], "--model", str(folder), "--output-dir", str(out), *COMMON]) == 0
    (summary, trained_logits), = exported
    assert summary["skipped"] == {} and {"rms_norm", "rope", "swiglu"} <= set(summary["patched"])
    assert ("fused_lora" in summary["patched"]) == (run == "lora")
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        final_logits, base_logits = final(input_ids=IDS).logits, base(input_ids=IDS).logits
    assert not torch.equal(final_logits, base_logits)  # trained
    torch.testing.assert_close(final_logits, trained_logits, rtol=1e-5, atol=1e-5)  # fp32: the LoRA merge rounds
    assert main(["eval", "--model", str(out / "final"), "--output-dir", str(tmp_path / "eval"), "--max-examples", "2",
                 "--max-new-tokens", "4", "--dtype", "float32", "--device", "cpu"]) == 0
