"""A LoRA checkpoint evaluated (or exported) over another base than its run trained on, named as --model: the user's
choice, as PEFT puts an adapter on any base (the base re-saved in bfloat16, a quantized copy), was refused by the
base's fingerprint with no way through; it is taken now with a warning naming both folders. The folder the run
recorded, changed since (another run's final/ exported again there), is still refused, named or not."""
import json

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.loading import load_inference_model

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
SFT = ["sft", "--max-seq-length", "16", "--batch-size", "8", "--micro-batch-size", "8", "--dtype", "float32", *QUIET]
EVAL = ["eval", "--max-examples", "4", "--max-new-tokens", "8", "--dtype", "float32"]


def _base(folder, dtype=torch.float32, seed=0):
    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer, seed=seed).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_lora_checkpoint_goes_on_another_base_named_as_model_with_a_warning(tmp_path, capsys):
    base, run = _base(tmp_path / "base"), tmp_path / "run"
    assert main([*SFT, "--model", str(base), "--lora-rank", "4", "--max-steps", "1", "--output-dir", str(run)]) == 0
    resaved = _base(tmp_path / "base-bf16", torch.bfloat16)  # the same weights, re-saved in another dtype
    checkpoint = run / "checkpoint-1"

    capsys.readouterr()
    assert main([*EVAL, "--checkpoint", str(run), "--model", str(resaved), "--output-dir", str(tmp_path / "e")]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "as --model asks" in line]
    assert warned == [f"fastgrpo eval: warning: model: putting the weights of {checkpoint} on {resaved} as --model "
                      f"asks, not on the base its run trained on, {base} (model.safetensors, config.json differ)"]
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["model"] == str(resaved)

    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(run), "--model", str(resaved), "--output-dir", str(out),
                 "--dtype", "bfloat16"]) == 0
    warned = f"fastgrpo export: warning: model: putting the weights of {checkpoint} on {resaved} as --model asks"
    assert warned in capsys.readouterr().err
    with safe_open(out / "model.safetensors", "pt") as weights:
        assert {weights.get_slice(name).get_dtype() for name in weights.keys()} == {"BF16"}
    model, _ = load_inference_model(model=str(resaved), dtype="bfloat16", device="cpu", checkpoint=checkpoint)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        # the adapter merged into that base (in bfloat16: merging rounds once more than adding the adapter's output)
        torch.testing.assert_close(exported(ids).logits, model(ids).logits, atol=1e-2, rtol=0)


def test_the_recorded_base_changed_since_is_refused_named_or_not(tmp_path, capsys):
    base, run = _base(tmp_path / "base"), tmp_path / "run"
    assert main([*SFT, "--model", str(base), "--lora-rank", "4", "--max-steps", "1", "--output-dir", str(run)]) == 0
    _base(base, seed=1)  # another model saved over it
    capsys.readouterr()
    for model in ([], ["--model", str(base)]):
        assert main([*EVAL, "--checkpoint", str(run), *model, "--output-dir", str(tmp_path / "e")]) == 2
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"fastgrpo eval: error: model: {base} is not the base model the run of {run / 'checkpoint-1'} trained on "
            "(its files changed since: model.safetensors differs); pass that base (or a copy of it) as --model")
