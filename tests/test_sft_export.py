"""`fastgrpo sft --lora-rank` then `fastgrpo eval --model <run>/final`: the export is a plain transformers model
folder (the adapter merged) that reloads with AutoModelForCausalLM and gives the trained adapter's logits (merged in
the export's dtype, bf16), and that `eval` loads and prompts as the run did."""
from __future__ import annotations

import json

import torch

from fastgrpo.train import default_task
from fastgrpo.train.cli import main


def test_a_lora_run_exports_a_plain_model_that_eval_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = default_task.build_tokenizer()
    base = tmp_path / "base"
    default_task.build_model(tokenizer, seed=2).save_pretrained(base)
    tokenizer.save_pretrained(base)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in default_task.build_sft_dataset(num_rows=8)))
    out = tmp_path / "run"
    assert main(["sft", "--model", str(base), "--dataset", str(rows), "--output-dir", str(out), "--lora-rank", "4",
                 "--learning-rate", "1e-2", "--batch-size", "4", "--micro-batch-size", "2", "--max-steps", "2",
                 "--max-seq-length", "32", "--dtype", "float32", "--device", "cpu", "--no-progress-bar",
                 "--logging-steps", "0"]) == 0

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert not (out / "final" / "adapter_config.json").exists()
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / "checkpoint-2")
    ids = torch.tensor([AutoTokenizer.from_pretrained(out / "final")("417 say c")["input_ids"]])
    with torch.no_grad():  # the trained model's logits, up to the export's bf16 rounding
        expected = trained(input_ids=ids).logits
        merged = trained.merge_and_unload().to(final.dtype).state_dict()
        assert all(torch.equal(value, merged[name]) for name, value in final.state_dict().items())
        torch.testing.assert_close(final(input_ids=ids).logits.float(), expected, rtol=0, atol=1e-2)
        untrained = AutoModelForCausalLM.from_pretrained(base)(input_ids=ids).logits
        assert (untrained - expected).abs().max() > 0.1  # the adapter trained something the check can see

    # the run's rows are the built-in task's, so its held-out rows (--dataset none) test what it learned
    assert main(["eval", "--model", str(out / "final"), "--dataset", "none", "--max-examples", "4",
                 "--max-new-tokens", "8", "--output-dir", str(tmp_path / "eval"), "--device", "cpu"]) == 0
    assert (tmp_path / "eval").is_dir()
