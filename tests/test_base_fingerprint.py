"""A run records a fingerprint of its base model folder: a LoRA run whose base (another run's final/) was exported
again since is refused on --resume and on eval --checkpoint (its adapter went on the new weights without a word,
mixing two runs); the same base moved or copied, given as --model, is taken; a full fine-tune's checkpoint holds
every weight and is not checked."""
import json
import os
import logging
import shutil

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.base_fingerprint import FINGERPRINT_KEY, base_change, fingerprint
from fastgrpo.train.cli import main
from fastgrpo.train.config import config_changes
from fastgrpo.train.loading import load_inference_model
from fastgrpo.train.sft_config import SFTConfig

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
SFT = ["sft", "--max-seq-length", "16", "--batch-size", "8", "--micro-batch-size", "8", "--dtype", "float32",
       "--device", "cpu", *QUIET]
EVAL = ["eval", "--max-examples", "4", "--max-new-tokens", "8"]


def _base(folder, seed=0):
    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer, seed=seed).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_fingerprint_follows_the_bytes_not_the_place(tmp_path, caplog):
    base = _base(tmp_path / "base")
    recorded = fingerprint(str(base))
    assert set(recorded) == {"model.safetensors", "config.json"}
    shutil.copytree(base, tmp_path / "copy")
    base.rename(tmp_path / "moved")
    assert fingerprint(str(tmp_path / "copy")) == fingerprint(str(tmp_path / "moved")) == recorded
    assert fingerprint("Qwen/Qwen2.5-0.5B") is None and fingerprint(None) is None  # a Hub name, the built-in model
    # one trained tensor in the middle of the file (a LoRA of one projection, merged) is seen
    model = default_task.build_model(default_task.build_tokenizer())
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "layers.0.self_attn.q_proj" in n)[-1, -1] += 0.5
    model.save_pretrained(tmp_path / "copy")
    record = {"lora_rank": 4, FINGERPRINT_KEY: recorded}
    assert base_change(record, str(tmp_path / "copy"), resuming=False) == "model.safetensors differs"
    full = {**record, "lora_rank": 0, "beta": 0.04}
    assert base_change(full, str(tmp_path / "copy"), resuming=False) is None  # a full fine-tune's weights are its own
    assert base_change(full, str(tmp_path / "copy"), resuming=True) == "model.safetensors differs"  # its KL reference
    with caplog.at_level(logging.INFO, logger="fastgrpo.train.base_fingerprint"):  # a run recorded before them
        assert base_change({"lora_rank": 4}, str(tmp_path / "copy"), resuming=False) is None
    assert "recorded no fingerprint of its base model" in caplog.text


def test_a_record_of_a_local_base_holds_its_fingerprint_and_feeds_back(tmp_path):
    base = _base(tmp_path / "base")
    record = SFTConfig(model=str(base)).to_dict()
    assert record[FINGERPRINT_KEY] == fingerprint(str(base))
    # the record keeps output_dir absolute (a resume from another folder finds the run)
    assert SFTConfig.from_dict(record) == SFTConfig(model=str(base), output_dir=os.path.abspath(SFTConfig().output_dir))
    path = tmp_path / "run_config.json"
    path.write_text(json.dumps(record))
    assert FINGERPRINT_KEY not in SFTConfig.file_settings(path)
    shutil.copytree(base, tmp_path / "copy")  # the same weights at another path: no change of setting
    assert config_changes(record, SFTConfig(model=str(tmp_path / "copy"))) == []
    assert config_changes(record, SFTConfig(model=str(_base(tmp_path / "other", seed=1)))) != []


def test_a_lora_run_on_a_base_exported_again_is_refused_and_on_a_copy_taken(tmp_path, capsys):
    first, run, copy = tmp_path / "first", tmp_path / "run", tmp_path / "copy"
    assert main([*SFT, "--max-steps", "1", "--output-dir", str(first)]) == 0
    base = first / "final"
    lora = [*SFT, "--model", str(base), "--lora-rank", "4", "--output-dir", str(run)]
    assert main([*lora, "--max-steps", "1"]) == 0
    assert json.loads((run / "checkpoint-1" / "run_config.json").read_text())[FINGERPRINT_KEY] == fingerprint(base)
    shutil.copytree(base, copy)
    assert main([*SFT, "--max-steps", "2", "--output-dir", str(first), "--resume"]) == 0  # final/ exported again
    capsys.readouterr()

    assert main([*lora, "--max-steps", "2", "--resume"]) == 2
    assert capsys.readouterr().err == (
        f"fastgrpo sft: error: model: {base} is not the base model checkpoint-1 was trained on (its files changed "
        "since: model.safetensors, export.json differ); pass that base (or a copy of it) as --model, or "
        "--resume-allow-changes to continue on these weights\n")
    assert main([*EVAL, "--checkpoint", str(run), "--output-dir", str(tmp_path / "eval")]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"fastgrpo eval: error: model: {base} is not the base model the run of {run / 'checkpoint-1'} trained on (its "
        "files changed since: model.safetensors, export.json differ); pass that base (or a copy of it) as --model")
    assert not (tmp_path / "eval").exists()
    exported = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(run), "--output-dir", str(exported)]) == 2
    assert f"model: {base} is not the base model the run of" in capsys.readouterr().err and not exported.exists()
    with pytest.raises(ValueError, match=f"^model: {base} is not the base model the run of"):  # the Python API's
        load_inference_model(model=None, dtype="float32", device="cpu", checkpoint=run / "checkpoint-1")

    # the base it trained on, at another path
    assert main([*EVAL, "--checkpoint", str(run), "--model", str(copy), "--output-dir", str(tmp_path / "eval")]) == 0
    assert main(["export", "--checkpoint", str(run), "--model", str(copy), "--output-dir", str(exported)]) == 0
    resumed = [*SFT, "--model", str(copy), "--lora-rank", "4", "--output-dir", str(run)]
    assert main([*resumed, "--max-steps", "2", "--resume"]) == 0
    assert json.loads((run / "checkpoint-2" / "run_config.json").read_text())[FINGERPRINT_KEY] == fingerprint(copy)


def test_a_full_fine_tune_holds_every_weight_and_is_not_checked(tmp_path):
    first, run = tmp_path / "first", tmp_path / "run"
    assert main([*SFT, "--max-steps", "1", "--output-dir", str(first)]) == 0
    full = [*SFT, "--model", str(first / "final"), "--output-dir", str(run), "--no-export"]
    assert main([*full, "--max-steps", "1"]) == 0
    assert main([*SFT, "--max-steps", "2", "--output-dir", str(first), "--resume"]) == 0  # final/ exported again
    assert main([*full, "--max-steps", "2", "--resume"]) == 0
    assert main([*EVAL, "--checkpoint", str(run), "--output-dir", str(tmp_path / "eval")]) == 0


def test_a_finished_lora_run_on_a_changed_base_has_nothing_to_train_and_its_export_is_refused(tmp_path, capsys):
    """--resume of a finished LoRA run whose base was exported again since refused on the fingerprint, where there
    was nothing to train and no weights to put on the base: it says so now. The export still left (final/ missing)
    puts the adapter on the base: refused, or done with a warning under --resume-allow-changes."""
    first, run = tmp_path / "first", tmp_path / "run"
    assert main([*SFT, "--max-steps", "1", "--output-dir", str(first)]) == 0
    base = first / "final"
    lora = [*SFT, "--model", str(base), "--lora-rank", "4", "--output-dir", str(run), "--max-steps", "1"]
    assert main(lora) == 0
    assert main([*SFT, "--max-steps", "2", "--output-dir", str(first), "--resume"]) == 0  # final/ exported again
    capsys.readouterr()

    assert main([*lora, "--resume"]) == 0
    assert capsys.readouterr().out == (
        f"fastgrpo sft: nothing to train: the run in {run} is at step 1 (checkpoint-1) of 1 (--max-steps 1), exported "
        f"to {run / 'final'}; pass a larger --max-steps to train on\n")
    shutil.rmtree(run / "final")  # stopped before its export: the resume would merge the adapter into the new base
    assert main([*lora, "--resume"]) == 2
    assert f"error: model: {base} is not the base model checkpoint-1 was trained on" in capsys.readouterr().err
    assert not (run / "final").exists()
    assert main([*lora, "--resume", "--resume-allow-changes"]) == 0
    assert "resume: continuing checkpoint-1 on other base weights" in capsys.readouterr().err
    assert (run / "final" / "config.json").is_file()


def _python_run(command, base, run, **fields):
    """The trainer of `command` from the Python API: a LoRA run of one step (round) on `base`, as the user builds it."""
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration
    from fastgrpo.train.loading import load_model_and_tokenizer
    from fastgrpo.train.sft import SFTTrainer
    from fastgrpo.train.trainer import GRPOTrainer

    common = dict(model=str(base), output_dir=str(run), lora_rank=4, dtype="float32", device="cpu",
                  progress_bar=False, logging_steps=0, **fields)
    if command == "train":
        config = GRPOConfig(**{**default_task.PRESET, "batch_size": 8, "num_generations": 4, "micro_batch_size": 8,
                               "max_completion_length": 4, "max_steps": 1, **common})
    elif command == "sft":
        config = SFTConfig(**{**default_task.SFT_PRESET, "batch_size": 8, "micro_batch_size": 8, "max_steps": 1,
                              **common})
    else:
        config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                             "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "sft_epochs": 1,
                             "ei_steps": 1, **common})
    model, tokenizer = load_model_and_tokenizer(config)
    if command == "train":
        return GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(32), config)
    if command == "sft":
        return SFTTrainer(model, tokenizer, default_task.build_sft_dataset(32), config)
    return ExpertIteration(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(8), config)


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_finished_lora_run_on_a_changed_base_from_python_has_nothing_to_train(tmp_path, caplog, command):
    """resume=True from Python refused a finished LoRA run on its base's fingerprint, where the CLI says there is
    nothing to train: it says so too now. A resume that exports (final/ missing) puts the adapter on the base: refused."""
    base, run = _base(tmp_path / "base"), tmp_path / "run"
    _python_run(command, base, run).train()
    _base(base, seed=1)  # the base folder exported again since: other weights
    with caplog.at_level(logging.WARNING):
        assert _python_run(command, base, run, resume=True).train() == []
    assert f"nothing to train: the run in {run} is at" in caplog.text
    shutil.rmtree(run / "final")
    with pytest.raises(ValueError, match=f"model: {base} is not the base model checkpoint-1 was trained on"):
        _python_run(command, base, run, resume=True).train()
    assert not (run / "final").exists()
