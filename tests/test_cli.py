"""`fastgrpo train`: the built-in default learns on the CPU; YAML < flags; user data and rewards by name."""
import json

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import build_parser, config_from_args, main, resolve_reward
from fastgrpo.rewards import length_reward


def _config(argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_default_run_reward_rises(tmp_path, capsys):
    # The default run shortened from 100 to 40 steps: the reward goes ~0.03 -> ~0.25.
    assert main(["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "40"]) == 0
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert len(rewards) == 40 and last > 2 * first and last > first + 0.05, rewards
    assert (tmp_path / "final" / "tokenizer.json").exists()
    assert "reward" in capsys.readouterr().out


def test_builtin_preset_yaml_then_flags(tmp_path):
    assert _config([]).learning_rate == default_task.PRESET["learning_rate"]
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 0.5\nmax_steps: 3\n")
    config = _config(["--config", str(path), "--max-steps", "9"])
    assert config.learning_rate == 0.5 and config.max_steps == 9 and config.batch_size == 64
    real = _config(["--model", "/m"])  # a real model: the dataclass defaults, the built-in task's reward
    assert real.learning_rate == 1e-6 and real.reward_funcs == default_task.REWARD_FUNCS
    assert _config(["--model", "/m", "--dataset", "d.jsonl"]).reward_funcs == ["length"]
    assert _config(["--dataset", "d.jsonl"]).learning_rate == default_task.PRESET["learning_rate"]


def test_bad_arguments_exit_with_a_message(capsys, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("- 1\n")
    with pytest.raises(SystemExit):
        main(["train", "--config", str(path)])
    assert "config: expected a YAML mapping" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--dataset", str(tmp_path / "missing.jsonl")])
    assert "dataset: no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--reward-funcs", "nonsense"])
    assert "unknown reward 'nonsense'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--batch-size", "10", "--num-generations", "4"])
    assert "batch_size: expected a multiple of num_generations" in capsys.readouterr().err


def test_resolve_reward():
    assert resolve_reward("length") is length_reward
    assert resolve_reward("fastgrpo.train.default_task:repeat_letter_reward") is default_task.repeat_letter_reward
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("fastgrpo.train.default_task:missing")


def test_user_dataset_file_and_missing_column(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} say b", "target_length": 3}) for i in range(4)))
    common = ["train", "--dataset", str(data), "--output-dir", str(tmp_path / "o"), "--batch-size", "4",
              "--num-generations", "2", "--micro-batch-size", "4", "--max-completion-length", "4", "--max-steps", "1",
              "--learning-rate", "1e-3", "--no-progress-bar", "--no-export"]
    assert main([*common, "--reward-funcs", "length"]) == 0
    assert len((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()) == 1
    with pytest.raises(SystemExit):
        main([*common, "--reward-funcs", "r1_zero_math"])
    assert "needs columns ['answer']" in capsys.readouterr().err


def test_local_hf_model_with_lora_patched_and_exported(tmp_path):
    tokenizer = default_task.build_tokenizer()
    default_task.build_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} say c", "letter": "c"}) for i in range(4)))
    out = tmp_path / "o"
    assert main(["train", "--model", str(tmp_path / "model"), "--dataset", str(data), "--output-dir", str(out),
                 "--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward", "length", "--reward-weights", "1",
                 "0.1", "--lora-rank", "4", "--beta", "0.1", "--batch-size", "4", "--num-generations", "2",
                 "--micro-batch-size", "2", "--max-prompt-length", "16", "--max-completion-length", "4",
                 "--max-steps", "2", "--learning-rate", "1e-3", "--dtype", "float32", "--no-progress-bar"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["kl"] == 0.0 and {"rewards/repeat_letter_reward", "rewards/length_reward"} <= set(metrics[0])
    assert (out / "checkpoint-2" / "adapter_model.safetensors").exists()
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "bfloat16"


def test_offload_host_memory_bound(tmp_path, capsys):
    # Checked before any model loads: a bound without offload, or not > 0, names the field.
    for argv, message in [
        (["--offload-host-memory-gib", "1"], "offload_host_memory_gib: bounds the memory of offload_activations"),
        (["--offload-activations", "--offload-host-memory-gib", "0"], "offload_host_memory_gib: expected > 0"),
    ]:
        with pytest.raises(SystemExit):
            main(["train", *argv])
        assert message in capsys.readouterr().err
    # The built-in run with 1 KiB of host memory for offloaded inputs (a layer input takes a 1 MiB buffer): the
    # offload of the first training step passes the bound, and the run ends with a message naming the flag.
    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "2", "--patch",
            "--offload-activations", "--offload-host-memory-gib", str(2**-20)]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "activation offload needs" in err and "--offload-host-memory-gib" in err, err
    # A bound the step fits in trains as without one.
    assert main([*argv[:-1], "1"]) == 0
