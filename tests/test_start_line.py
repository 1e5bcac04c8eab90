"""The line train / sft / ei log as their loop starts: the model (its parameters, dtype, what is trained), the device,
and the steps to run with their batch; none when there is nothing to run. eval's: the model, the examples."""
import logging

import pytest
import torch
import torch.distributed as dist

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.start_line import count, describe_device, describe_model

TRAIN = ["train", "--max-completion-length", "4", "--batch-size", "8", "--num-generations", "4",
         "--micro-batch-size", "8", "--no-progress-bar"]


ONE_STEP = dict(save_steps=1, export=False, progress_bar=False, logging_steps=0)


def _started(err: str, prog: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(f"{prog}: ") and " on cpu: " in line]


def test_train_says_what_it_trains_before_its_first_step_and_where_a_resume_begins(tmp_path, capsys):
    run = ["--output-dir", str(tmp_path / "run")]
    assert main([*TRAIN, *run, "--max-steps", "2"]) == 0
    out = capsys.readouterr()
    parameters = count(sum(p.numel() for p in default_task.build_model(default_task.build_tokenizer()).parameters()))
    assert _started(out.err, "fastgrpo train") == [
        f"fastgrpo train: training Qwen2ForCausalLM ({parameters} parameters, float32, all trained) on cpu: steps 1-2, "
        "8 completions a step (2 prompts x 4, up to 4 tokens)"], out.err
    assert main([*TRAIN, *run, "--max-steps", "3", "--resume"]) == 0
    assert _started(capsys.readouterr().err, "fastgrpo train")[0].endswith(": step 3, 8 completions a step (2 "
                                                                            "prompts x 4, up to 4 tokens)")
    assert main([*TRAIN, *run, "--max-steps", "3", "--resume"]) == 0  # finished: nothing starts
    assert _started(capsys.readouterr().err, "fastgrpo train") == []


def _grpo(path, resume=False):
    from tests.test_run_safety import _trainer

    return _trainer(path, max_steps=1, save_steps=1, resume=resume)


def _sft(path, resume=False):
    from fastgrpo.train.sft import SFTTrainer
    from fastgrpo.train.sft_config import SFTConfig

    config = SFTConfig(**{**default_task.SFT_PRESET, **ONE_STEP, "max_steps": 1, "batch_size": 2,
                          "micro_batch_size": 2, "max_seq_length": 16, "output_dir": str(path), "resume": resume})
    tokenizer = default_task.build_tokenizer()
    return SFTTrainer(default_task.build_model(tokenizer), tokenizer, default_task.build_sft_dataset(4), config)


def _ei(path, resume=False):
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration

    config = EIConfig(**{**default_task.EI_PRESET, **ONE_STEP, "prompt_format": "raw", "ei_steps": 1,
                         "questions_per_step": 4, "num_generations": 2, "max_completion_length": 2, "batch_size": 2,
                         "micro_batch_size": 2, "output_dir": str(path), "resume": resume})
    tokenizer = default_task.build_tokenizer()
    return ExpertIteration(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward,
                           default_task.build_dataset(8), config)


@pytest.mark.parametrize("build", [_grpo, _sft, _ei], ids=["train", "sft", "ei"])
def test_a_finished_run_resumed_from_python_logs_no_start_line(tmp_path, caplog, build):
    """The CLI says 'nothing to train' before it loads the model; from Python the trainer's loop has no step to run
    and says nothing of the steps it would start at (steps past the last)."""
    build(tmp_path).train()
    with caplog.at_level(logging.INFO, logger="fastgrpo.train.start_line"):
        build(tmp_path, resume=True).train()
    assert "nothing to train" in caplog.text and "start_line" not in [r.module for r in caplog.records], caplog.text


def test_sft_and_ei_say_theirs(tmp_path, capsys):
    rows = tmp_path / "rows.csv"
    rows.write_text("prompt,response\n" + "".join(f"add {i} {i},{2 * i}\n" for i in range(4)))
    sft = ["sft", "--dataset", str(rows), "--max-seq-length", "16", "--batch-size", "2", "--micro-batch-size", "2",
           "--max-steps", "1", "--output-dir", str(tmp_path / "sft"), "--no-progress-bar"]
    assert main(sft) == 0
    assert _started(capsys.readouterr().err, "fastgrpo sft")[0].endswith(
        ": step 1, 2 rows a step (up to 16 tokens)")
    ei = ["ei", "--ei-steps", "2", "--questions-per-step", "4", "--num-generations", "2", "--max-completion-length",
          "2", "--batch-size", "2", "--micro-batch-size", "2", "--output-dir", str(tmp_path / "ei"),
          "--no-progress-bar"]
    assert main(ei) == 0
    assert _started(capsys.readouterr().err, "fastgrpo ei")[0].endswith(
        ": rounds 1-2, 4 questions x 2 completions a round (up to 2 tokens), then SFT on those rewarded >= 1")


def test_eval_says_what_it_evaluates_without_what_is_trained(tmp_path, capsys):
    argv = ["eval", "--max-examples", "3", "--num-generations", "2", "--max-new-tokens", "4", "--output-dir",
            str(tmp_path / "eval")]
    assert main(argv) == 0
    parameters = count(sum(p.numel() for p in default_task.build_model(default_task.build_tokenizer()).parameters()))
    assert _started(capsys.readouterr().err, "fastgrpo eval") == [
        f"fastgrpo eval: evaluating Qwen2ForCausalLM ({parameters} parameters, float32) on cpu: 3 examples x 2 "
        "completion(s) (up to 4 tokens)"]


def test_lora_counts_its_adapters_as_peft_does():
    from peft import LoraConfig, get_peft_model

    model = default_task.build_model(default_task.build_tokenizer())
    lora = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    trained, total = lora.get_nb_trainable_parameters()
    assert describe_model(lora) == (f"Qwen2ForCausalLM ({count(total)} parameters, float32; LoRA r4: {count(trained)} "
                                    "trained)")


def test_a_4_bit_base_counts_values_not_the_bytes_they_are_packed_in():
    bnb = pytest.importorskip("bitsandbytes")
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32).to("cpu"),
                                torch.nn.Linear(32, 2, bias=False))
    assert model[0].weight.numel() == 64 * 32 // 2  # packed: two values a byte
    assert describe_model(model) == f"Sequential ({count(64 * 32 + 64)} parameters, 4-bit, float32; 64 trained)"


def test_dtypes_are_named_most_values_first_and_a_frozen_part_is_not_counted_as_trained():
    """A model kept mostly in float32 with a small bfloat16 part (or the reverse) reads as what most of it is."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(2, 2, bias=False).bfloat16())
    model[1].requires_grad_(False)
    assert describe_model(model) == "Sequential (68 parameters, float32, bfloat16; 64 trained)"


def test_several_processes_are_counted_on_the_device():
    assert describe_device(torch.device("cpu"), 1) == "cpu"
    assert describe_device(torch.device("cpu"), 2) == "cpu x 2 processes"


def test_a_model_sharded_by_fsdp2_is_named_by_its_own_class(tmp_path):
    from torch.distributed.fsdp import fully_shard

    model = default_task.build_model(default_task.build_tokenizer())
    total = count(sum(p.numel() for p in model.parameters()))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        fully_shard(model)
        assert type(model).__name__ == "FSDPQwen2ForCausalLM"
        assert describe_model(model) == f"Qwen2ForCausalLM ({total} parameters, float32, all trained)"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("n, said", [(0, "0"), (999, "999"), (1000, "1K"), (76_900, "76.9K"), (18_464_768, "18.5M"),
                                     (1_543_714_304, "1.54B")])
def test_counts_read_in_three_digits(n, said):
    assert count(n) == said
