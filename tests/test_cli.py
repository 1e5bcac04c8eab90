"""`fastgrpo train`: the built-in default learns on the CPU; YAML < flags; user data and rewards by name; every
mistake is one line and exit code 2 (--debug: the traceback); --help shows the defaults a run really uses."""
import json
import os

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.cli import build_parser, main
from fastgrpo.train.commands import config_from_args
from fastgrpo.train.loading import resolve_reward
from fastgrpo.rewards import length_reward


def _config(argv):
    return config_from_args("train", build_parser().parse_args(["train", *argv]))


def test_default_run_reward_rises(tmp_path, capsys):
    # The default run shortened from 100 to 40 steps: the reward goes ~0.03 -> ~0.25.
    assert main(["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "40"]) == 0
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert len(rewards) == 40 and last > 2 * first and last > first + 0.05, rewards
    assert (tmp_path / "final" / "tokenizer.json").exists()
    # One plain line per step (--logging-steps 1), then the summary.
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" | ")[0] for line in lines[:-1]] == [f"step {i}/40" for i in range(1, 41)]
    for label in ("| reward ", "| kl ", "| entropy ", "| clip_ratio ", "| completion_length ", "| rollout_tokens_per_s ",
                  "| train_tokens_per_s ", "| step_s ", "| peak "):
        assert label in lines[0], lines[0]
    assert lines[-1].startswith("reward ")


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


def test_the_presets_micro_batch_fits_each_process_under_torchrun(monkeypatch):
    # the preset's 64 rows on 4 processes are 16 each: its micro-batch of 32 (never set by the user) was refused
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _config([]).micro_batch_size == 16
    assert _config(["--micro-batch-size", "32"]).micro_batch_size == 32  # set by the user: kept (and refused)


def test_a_smaller_batch_brings_the_presets_micro_batch_down(tmp_path):
    # the preset's micro-batch (32) is for its batch of 64; one the user sets is kept (and checked)
    assert _config(["--batch-size", "16"]).micro_batch_size == 16
    assert _config(["--batch-size", "48"]).micro_batch_size == 24
    assert _config(["--batch-size", "64", "--num-minibatches", "8"]).micro_batch_size == 8
    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 16\n")
    assert _config(["--config", str(path)]).micro_batch_size == 16
    assert _config(["--batch-size", "16", "--micro-batch-size", "4"]).micro_batch_size == 4
    with pytest.raises(ValueError, match=r"micro_batch_size: expected a divisor of the minibatch size \(16\), got 32"):
        _config(["--batch-size", "16", "--micro-batch-size", "32"])
    assert _config(["--model", "/m", "--batch-size", "16"]).micro_batch_size == 8  # no preset: the default
    from fastgrpo.train import commands

    for name, batch in (("ei", "16"), ("sft", "4")):  # presets of 32 and 8 rows
        args = build_parser().parse_args([name, "--batch-size", batch])
        assert commands.config_from_args(name, args).micro_batch_size == int(batch)


def test_yaml_numbers_written_without_a_dot_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1e-6\nmax_steps: '20'\nbeta: 4e-2\nreward_funcs: length\n")
    config = _config(["--config", str(path)])  # PyYAML reads 1e-6 as a string (YAML 1.1 wants 1.0e-6)
    assert (config.learning_rate, config.max_steps, config.beta, config.reward_funcs) == (1e-6, 20, 0.04, ["length"])


def test_none_in_yaml_unsets_as_on_the_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("save_total_limit: none\ndelta: None\nreport_to: none\nmodel: null\n")
    config = _config(["--config", str(path)])
    assert (config.save_total_limit, config.delta, config.report_to, config.model) == (None, None, None, None)
    assert _config(["--save-total-limit", "none"]).save_total_limit is None
    path.write_bytes(b"\xef\xbb\xbfmax_steps: 3\n")  # a byte-order mark, as Windows editors write
    assert _config(["--config", str(path)]).max_steps == 3
    path.write_text("max_steps: none\n")  # not optional: still an error naming it
    with pytest.raises(ValueError, match=r"max_steps \(from .*\): expected an integer, got 'none'"):
        _config(["--config", str(path)])


def _bad_inputs(tmp_path):
    (tmp_path / "list.yaml").write_text("- 1\n")
    (tmp_path / "broken.yaml").write_text("learning_rate: 1e-6\nbeta: [0.1\n")
    (tmp_path / "twice.yaml").write_text("seed: 1\nmax_steps: 2\nseed: 2\n")
    (tmp_path / "latin1.yaml").write_bytes("seed: 1 # caf\xe9\n".encode("latin-1"))
    (tmp_path / "rows.jsonl").write_text('{"prompt": "1 say a"}\n\n{"prompt": "2 say b",}\n')
    (tmp_path / "rows.txt").write_text("prompt\n1 say a\n")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "typed.jsonl").write_text('{"prompt": "1 say a"}\n{"prompt": 5}\n')
    (tmp_path / "chat.jsonl").write_text('{"prompt": [{"role": "user", "content": "1 say a"}]}\n')
    (tmp_path / "empty_prompt.jsonl").write_text('{"prompt": "1 say a"}\n{"prompt": ""}\n')
    (tmp_path / "no_prompt.jsonl").write_text('{"question": "1 say a"}\n')
    cuda = "needs a CUDA GPU" if not torch.cuda.is_available() else "GPU(s)"
    return [
        (["--config", str(tmp_path / "list.yaml")], f"config: {tmp_path / 'list.yaml'}: expected a mapping of field: "
                                                     "value, got a list"),
        (["--config", str(tmp_path / "missing.yaml")], f"config: no such file {tmp_path / 'missing.yaml'}"),
        (["--config", str(tmp_path / "broken.yaml")], f"config: {tmp_path / 'broken.yaml'}:3:1: malformed YAML"),
        (["--config", str(tmp_path / "twice.yaml")], f"config: {tmp_path / 'twice.yaml'}:3: 'seed' is given twice"),
        (["--config", str(tmp_path / "latin1.yaml")], f"config: {tmp_path / 'latin1.yaml'} is not UTF-8 text"),
        (["--model", "/nonexistent"], "model: no such folder /nonexistent"),
        (["--model", str(tmp_path)], f"model: {tmp_path} is not a Hugging Face model folder (no config.json"),
        (["--device", "cuda" if not torch.cuda.is_available() else "cuda:99"], "device: 'cuda"),
        (["--device", "tpu7"], "device: expected auto, cpu, cuda or cuda:N, got 'tpu7'"),
        (["--seed", str(10**14)], "seed: expected an int in [0, 2**32), got 100000000000000"),
        (["--stop", ""], "stop: expected non-empty strings"),
        (["--dataset", str(tmp_path / "missing.jsonl")], "dataset: no such file"),
        # a mistyped local name (its folder exists) is not sent to the Hub
        (["--dataset", str(tmp_path / "rows.jsonll")], f"dataset: no such file or folder {tmp_path / 'rows.jsonll'} "
                                                        f"(did you mean {tmp_path / 'rows.jsonl'}?); --dataset takes a "),
        (["--dataset", str(tmp_path / "empty_prompt.jsonl"), "--reward-funcs", "length"],
         "dataset: row 1: prompt: '' has no tokens"),
        (["--dataset", str(tmp_path / "rows.jsonl")], f"{tmp_path / 'rows.jsonl'}:3: invalid JSON in --dataset"),
        (["--reward-funcs", "nonsense"], "unknown reward 'nonsense'"),
        (["--reward-funcs", "no_such_module:f"], "reward_funcs: no module 'no_such_module' in the current folder"),
        (["--reward-funcs", "fastgrpo.train.default_task:missing"], "has no function 'missing'"),
        (["--batch-size", "10", "--num-generations", "4"], "batch_size: expected a multiple of num_generations"),
        (["--num-generations", "0"], "num_generations: expected >= 2 (advantages compare completions of a group)"),
        (["--lora-rank", "2", "--lora-dropout", "1.5"], "lora_dropout: expected a number in [0, 1), got 1.5"),
        (["--adam-beta1", "1.5"], "adam_beta1: expected a number in [0, 1), got 1.5"),
        (["--adam-beta2", "-1"], "adam_beta2: expected a number in [0, 1), got -1.0"),
        (["--learning-rate", "inf"], "learning_rate: expected a finite number >= 0, got inf"),
        (["--dataset", str(tmp_path / "no_prompt.jsonl")], "error: dataset: no prompt column 'prompt' (prompt_column)"),
        (["--dataset", str(tmp_path / "rows.txt")], f"dataset: expected a .jsonl, .json, .parquet, .csv or .tsv file "
                                                     f"(.jsonl.gz, .csv.gz too), a folder of them or a Hugging Face "
                                                     f"dataset name; got {tmp_path / 'rows.txt'}"),
        (["--output-dir", str(tmp_path / "a_file")], "output_dir: expected a folder (or a path to create one at)"),
        (["--output-dir", str(tmp_path / "a_file" / "run")], "output_dir: expected a folder"),
        (["--load-in-4bit", "--lora-rank", "8"], "load_in_4bit: quantizes the weights of --model as they load"),
        (["--resume", "--overwrite-output-dir"], "pass one of --resume and --overwrite-output-dir"),
        (["--offload-activations"], "runs in patch_model's layers, and patch is off (pass --patch)"),
        (["--dataset", str(tmp_path / "typed.jsonl"), "--reward-funcs", "length"],
         "dataset: row 1: prompt: expected a string or a list of chat messages {'role': ..., 'content': ...}, "
         "got int"),
        (["--dataset", str(tmp_path / "chat.jsonl"), "--reward-funcs", "length"],
         "dataset: row 0: chat messages need a chat template, and the model's tokenizer has none: give text prompts "
         "(--prompt-format raw, auto or r1_zero) or a model whose tokenizer has a chat template"),
    ], cuda


def test_mistakes_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a run that got past the checks would write here: none may
    cases, cuda = _bad_inputs(tmp_path)
    for argv, message in cases:
        assert main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("fastgrpo train: error: ") and err.count("\n") == 1, err
        assert (cuda if argv[0] == "--device" and "tpu7" not in argv else message) in err, (argv, err)
    assert not (tmp_path / "fastgrpo_output" / "metrics.jsonl").exists()
    with pytest.raises(ValueError, match="seed: expected"):  # --debug: the traceback
        main(["train", "--seed", str(10**14), "--debug"])


@pytest.mark.parametrize("argv, message", [
    (["sft", "--learning-rate", "inf"], "learning_rate: expected a finite number >= 0, got inf"),
    (["sft", "--lora-dropout", "1"], "lora_dropout: expected a number in [0, 1), got 1.0"),
    (["ei", "--correct-threshold", "nan"], "correct_threshold: expected a finite number, got nan"),
    (["eval", "--correct-threshold", "nan"], "correct_threshold: expected a finite number, got nan"),
])
def test_bad_numbers_of_the_other_commands_are_one_line(argv, message, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"fastgrpo {argv[0]}: error: {message}\n", err
    assert not any(tmp_path.iterdir())  # refused before a run folder or a model


def test_row_files_with_a_byte_order_mark_or_an_upper_case_suffix_load(tmp_path):
    from fastgrpo.train.loading import load_rows

    rows = [{"prompt": "1 say a"}, {"prompt": "2 say b"}]
    (tmp_path / "rows.JSONL").write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in rows).encode())
    (tmp_path / "rows.JSON").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    assert load_rows(str(tmp_path / "rows.JSONL")) == rows == load_rows(str(tmp_path / "rows.JSON"))


def test_a_dataset_folder_datasets_cannot_read_is_one_line(tmp_path, capsys, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"prompt": "1 say a"}\n')
    (folder / "b.jsonl").write_text('{"question": "1 say a"}\n')  # other columns: datasets cannot cast them
    assert main(["train", "--dataset", str(folder), "--reward-funcs", "length", "--output-dir", "out"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # above it: datasets' own progress bar
    assert last.startswith(f"fastgrpo train: error: dataset: datasets.load_dataset could not read the folder "
                           f"{folder} ('train' split): CastError: "), last


def test_flag_mistakes_are_one_line_with_a_hint(capsys):
    """argparse's own errors: no usage block, whole flag names only, the closest flag named for a misspelt one."""
    for argv, message in [
        (["train", "--max-steps", "abc"], "argument --max-steps: invalid int value: 'abc'"),
        (["train", "--max-step", "3"], "unrecognized arguments: --max-step (did you mean --max-steps?) 3"),
        (["sft", "--max-seq-len", "4"], "unrecognized arguments: --max-seq-len (did you mean --max-seq-length?) 4"),
        (["train", "--learning_rate=3"], "unrecognized arguments: --learning_rate=3 (did you mean --learning-rate?)"),
        (["train", "--lr", "3"], "unrecognized arguments: --lr (TRL's name; here --learning-rate) 3 (see"),
        (["ei", "--max-steps", "3"], "unrecognized arguments: --max-steps (a `fastgrpo train` / `fastgrpo sft` flag; "
                                     "ei counts rounds with --ei-steps) 3"),
        (["sft", "--no-truncate-prompts"], "unrecognized arguments: --no-truncate-prompts (a `fastgrpo train` / "
                                           "`fastgrpo ei` flag; sft truncates long rows with --truncate-sequences)"),
        (["eval", "--eval-steps=3"], "unrecognized arguments: --eval-steps=3 (a `fastgrpo train` / `fastgrpo sft` / "
                                     "`fastgrpo ei` flag)"),
        (["ei", "--config", "a.yaml", "--config", "b.yaml"], "argument --config: given twice (a.yaml, b.yaml)"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1, (argv, err)
        assert err.startswith(f"fastgrpo {argv[0]}: error: {message}"), (argv, err)
        assert err.endswith(f"(see fastgrpo {argv[0]} --help)\n"), (argv, err)


def test_a_yaml_key_of_another_command_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ei.yaml").write_text("max_steps: 3\n")
    assert main(["ei", "--config", "ei.yaml"]) == 2
    assert capsys.readouterr().err == ("fastgrpo ei: error: config: ei.yaml: unknown field 'max_steps' for `fastgrpo "
                                       "ei` (a `fastgrpo train` / `fastgrpo sft` setting; ei counts rounds with "
                                       "ei_steps); see `fastgrpo ei --help`\n")
    assert [p.name for p in tmp_path.iterdir()] == ["ei.yaml"]  # refused before a run folder or a model


def test_each_commands_help_says_only_what_applies_to_it(capsys):
    texts = {}
    for name in ("sft", "ei", "eval"):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        texts[name] = " ".join(capsys.readouterr().out.split())
    assert [("--checkpoint of a run" in t) for t in texts.values()] == [False, False, True]
    assert not any(f"(default: {v}; {v} for the built-in model" in t for t in texts.values() for v in (8, 32, 64))
    # ei fine-tunes on its kept completions with plain cross-entropy: train's "divides the logits of the loss" is not
    assert "logits of the loss" not in texts["ei"] and "plain cross-entropy, at temperature 1" in texts["ei"]


def test_reward_functions_from_the_current_folder_and_from_a_file(tmp_path, monkeypatch):
    assert resolve_reward("length") is length_reward
    assert resolve_reward("fastgrpo.train.default_task:repeat_letter_reward") is default_task.repeat_letter_reward
    (tmp_path / "myrewards_cwd.py").write_text("def fn(prompts, completions, **kw):\n"
                                               "    return [1.0] * len(completions)\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "helper_mod.py").write_text("SCORE = 2.0\n")
    (tmp_path / "sub" / "rewards.py").write_text(
        "from helper_mod import SCORE\n\ndef fn(prompts, completions, **kw):\n    return [SCORE] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("myrewards_cwd:fn")([], ["a", "b"]) == [1.0, 1.0]
    assert resolve_reward("sub/rewards.py:fn")([], ["a"]) == [2.0]  # its sibling modules import
    with pytest.raises(ValueError, match="reward_funcs: no such file sub/missing.py"):
        resolve_reward("sub/missing.py:fn")


def test_version_and_help_show_what_a_run_uses(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("fastgrpo 0.")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 1e-06; 0.003 for the built-in model)" in text  # --learning-rate
    assert "(default: 8; 32 for the built-in model, or the largest divisor of a smaller batch)" in text
    assert "repeat_letter_reward'] without --dataset)" in text and "--overwrite-output-dir" in text


def test_user_dataset_file_and_missing_column(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} say b", "target_length": 3}) for i in range(4)))
    common = ["train", "--dataset", str(data), "--output-dir", str(tmp_path / "o"), "--batch-size", "4",
              "--num-generations", "2", "--micro-batch-size", "4", "--max-completion-length", "4", "--max-steps", "1",
              "--learning-rate", "1e-3", "--no-progress-bar", "--no-export"]
    assert main([*common, "--reward-funcs", "length"]) == 0
    assert len((tmp_path / "o" / "metrics.jsonl").read_text().splitlines()) == 1
    assert "are dropped" not in capsys.readouterr().err  # the built-in tokenizer knows each character of these rows
    assert main([*common, "--reward-funcs", "r1_zero_math", "--overwrite-output-dir"]) == 2
    assert "needs columns ['answer']" in capsys.readouterr().err


def test_characters_the_builtin_tokenizer_lacks_are_named(tmp_path, capsys, caplog):
    """--dataset without --model trains the tiny model, whose character tokenizer drops what it does not know: one
    warning names those characters (of the columns a command tokenizes: SFT's responses too)."""
    import types

    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"What is {i}+{i}?", "target_length": 3}) for i in range(4)))
    assert main(["train", "--dataset", str(data), "--output-dir", str(tmp_path / "o"), "--batch-size", "4",
                 "--num-generations", "2", "--max-completion-length", "4", "--max-steps", "1", "--no-progress-bar",
                 "--no-export", "--reward-funcs", "length"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "are dropped" in line]
    assert len(warned) == 1 and "12 other characters (most often 'W+?')" in warned[0], warned
    sft = types.SimpleNamespace(model=None, checkpoint=None, prompt_column="q", response_column="r")
    with caplog.at_level("WARNING", logger="fastgrpo"):
        default_task.warn_unknown_characters([{"q": "say a", "r": "A!", "other": "Z"}], sft)
        default_task.warn_unknown_characters([{"q": "say a", "r": "A!"}], types.SimpleNamespace(**{**vars(sft),
                                                                                               "model": "m"}))
    # the response's 'A' and '!', not the untokenized column's 'Z'; nothing with a --model
    assert [r.getMessage() for r in caplog.records if "are dropped" in r.getMessage()] == [
        "no --model: the built-in tiny model's tokenizer knows only a-z, 0-9, ' ' and ':'; the dataset's 2 other "
        "characters (most often 'A!') are dropped. Pass --model for a real model and its tokenizer."]


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
    assert json.loads((out / "final" / "config.json").read_text())["dtype"] == "float32"  # the run's --dtype


def test_offload_host_memory_bound(tmp_path, capsys):
    # Checked before any model loads: a bound without offload, or not > 0, names the field.
    for argv, message in [
        (["--offload-host-memory-gib", "1"], "offload_host_memory_gib: bounds the memory of offload_activations"),
        (["--patch", "--offload-activations", "--offload-host-memory-gib", "0"],
         "offload_host_memory_gib: expected a finite number > 0"),
        (["--patch", "--offload-activations", "--offload-host-memory-gib", "inf"],
         "offload_host_memory_gib: expected a finite number > 0 or none, got inf"),
        (["--recompute-layers", "1"], "recompute_layers: chooses the layers that gradient_checkpointing or "
                                      "offload_activations"),
        (["--gradient-checkpointing", "--recompute-layers", "-1"], "recompute_layers: expected an int >= 0"),
    ]:
        assert main(["train", *argv]) == 2
        assert message in capsys.readouterr().err
    # The built-in run with 1 KiB of host memory for offloaded inputs (a layer input takes a 1 MiB buffer): the
    # offload of the first training step passes the bound, and the run ends with a message naming the flag.
    argv = ["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "2", "--patch",
            "--offload-activations", "--offload-host-memory-gib", str(2**-20)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "activation offload needs" in err and "--offload-host-memory-gib" in err, err
    # A bound the step fits in trains as without one.
    assert main([*argv[:-1], "1"]) == 0


@pytest.mark.parametrize("preset, engine, want", [
    (None, "builtin", "expandable_segments:True"),
    ("max_split_size_mb:64", "builtin", "max_split_size_mb:64"),  # the user's own setting stays
    (None, "vllm", None),  # vLLM's sleep-mode pool refuses expandable segments
])
def test_commands_start_with_expandable_segments(monkeypatch, preset, engine, want):
    from fastgrpo.train import cuda_memory

    monkeypatch.setenv(cuda_memory.ALLOC_CONF, "")  # then deleted: monkeypatch restores the variable as it was
    monkeypatch.delenv(cuda_memory.ALLOC_CONF)
    if preset is not None:
        monkeypatch.setenv(cuda_memory.ALLOC_CONF, preset)
    cuda_memory.use_expandable_segments(engine)
    assert os.environ.get(cuda_memory.ALLOC_CONF) == want


def test_train_sets_the_allocator_before_loading(monkeypatch, tmp_path):
    from fastgrpo.train import cuda_memory

    monkeypatch.setenv(cuda_memory.ALLOC_CONF, "")
    monkeypatch.delenv(cuda_memory.ALLOC_CONF)
    assert main(["train", "--output-dir", str(tmp_path), "--no-progress-bar", "--max-steps", "1"]) == 0
    assert os.environ[cuda_memory.ALLOC_CONF] == "expandable_segments:True"


@pytest.mark.parametrize("rank", ["0", "1"])
def test_info_lines_on_rank_0_only_warnings_on_every_rank(monkeypatch, capsys, rank):
    """Under torchrun every rank runs the command: a resumed run says so once (rank 0), a warning from any rank."""
    import logging

    from fastgrpo.train.errors import run_command

    monkeypatch.setenv("RANK", rank)

    def body():
        logging.getLogger("fastgrpo.train.trainer").info("resumed from here")
        logging.getLogger("fastgrpo.train.trainer").warning("look")
        return 0

    assert run_command("fastgrpo train", body) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == (["fastgrpo train: resumed from here"] if rank == "0" else []) + ["fastgrpo train: warning: look"]


@pytest.mark.parametrize("command", ["train", "sft", "ei", "eval"])
def test_a_model_that_is_no_folder_nor_reachable_repo_fails_at_once(tmp_path, capsys, monkeypatch, command):
    """`--model nowhere` (no such folder; not cached; the Hub unreachable or without it) is one line at once, not
    20 s or more of transformers' retries; with HF_HUB_OFFLINE set, without asking the Hub."""
    import time

    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing cached
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    argv = [command, "--model", "nowhere", "--output-dir", str(tmp_path / "out")]
    start = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - start < 15
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"fastgrpo {command}: error: model: no such folder nowhere, and "), err
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(argv) == 2
    assert "not in the Hugging Face cache, and HF_HUB_OFFLINE is set" in capsys.readouterr().err
    assert main([command, "--model", "no such/model", "--output-dir", str(tmp_path / "out")]) == 2
    assert "not a Hugging Face Hub repo id" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_a_run_or_its_checkpoint_as_model_names_what_model_takes(tmp_path, capsys, command):
    """A run's folder as --model pointed to '--checkpoint', which only eval has (train answered 'unrecognized
    arguments: --checkpoint'); a checkpoint-<step>/ (say an SFT run's, to start GRPO from) and a PEFT adapter folder
    got no hint at all."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")
    (run / "checkpoint-1").mkdir()
    (run / "checkpoint-1" / "trainer_state.pt").write_bytes(b"")
    adapter = tmp_path / "trl_lora"  # TRL's SFT with a peft_config saves the adapter alone
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    for model, hint in [(run, "(a run's folder: --model takes its final/; fastgrpo eval --checkpoint takes the run)"),
                        (run / "checkpoint-1", "(a run's checkpoint: --model takes the run's final/; fastgrpo eval "
                                               "--checkpoint takes a checkpoint)"),
                        (adapter, "(a PEFT adapter: --model takes a whole model; save the adapter's merge_and_unload() "
                                  "and its tokenizer to a folder)")]:
        assert main([command, "--model", str(model), "--output-dir", str(tmp_path / "out")]) == 2
        assert capsys.readouterr().err == (f"fastgrpo {command}: error: model: {model} is not a Hugging Face model "
                                           f"folder (no config.json in it) {hint}\n")


def test_a_run_no_reward_function_scored_ends_with_its_summary(tmp_path, capsys):
    """Every completion unscored (the reward function returns None for all: it applies to none): the steps log
    reward null, and the end-of-run line says none instead of failing on the format."""
    (tmp_path / "none_rewards.py").write_text(
        "def fn(prompts, completions, **kw):\n    return [None] * len(completions)\n")
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i} say b"}) for i in range(4)))
    argv = ["train", "--dataset", str(data), "--output-dir", str(tmp_path / "o"), "--batch-size", "4",
            "--num-generations", "2", "--micro-batch-size", "4", "--max-completion-length", "4", "--max-steps", "1",
            "--no-progress-bar", "--no-export", "--reward-funcs", f"{tmp_path / 'none_rewards.py'}:fn"]
    assert main(argv) == 0
    assert json.loads((tmp_path / "o" / "metrics.jsonl").read_text())["reward"] is None
    out = capsys.readouterr()
    assert out.out.splitlines()[-1].startswith("reward none (step 1); metrics in "), out.out
    assert "every reward function returned None (or NaN) for 4 completion(s)" in out.err, out.err


def test_yaml_none_and_quoted_numbers_reach_the_presets_as_flags_do(tmp_path):
    """The presets read the settings before the config is built: YAML's `none` (as `--model none`) keeps the built-in
    model's and task's presets, and a quoted or float batch size ("16", 16.0) fits the preset's micro-batch as 16."""
    from fastgrpo.train import commands

    path = tmp_path / "c.yaml"
    for batch in ("'16'", "16.0"):
        path.write_text(f"model: none\ndataset: none\nbatch_size: {batch}\n")
        config = _config(["--config", str(path)])
        assert config.model is None and config.learning_rate == default_task.PRESET["learning_rate"]
        assert config.reward_funcs == list(default_task.REWARD_FUNCS) and config.micro_batch_size == 16
    for name in ("sft", "ei", "eval"):
        path.write_text("model: none\ndataset: none\n" + ("checkpoint: none\n" if name == "eval" else ""))
        from_yaml = commands.config_from_args(name, build_parser().parse_args([name, "--config", str(path)]))
        builtin = commands.config_from_args(name, build_parser().parse_args([name]))
        assert from_yaml == builtin, name


def test_a_leading_tilde_is_the_home_folder(tmp_path, monkeypatch):
    """~ in a path setting (YAML or a quoted flag) and in --config is the home folder, as a shell expands it: a run
    never writes into a folder named ~."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.yaml").write_text("output_dir: ~/out\nmodel: ~/m\ndataset: ~/d.jsonl\n")
    config = _config(["--config", "~/c.yaml"])
    assert (config.output_dir, config.model, config.dataset) == tuple(f"{tmp_path}/{name}"
                                                                      for name in ("out", "m", "d.jsonl"))
    assert _config(["--output-dir", "~/o2"]).output_dir == f"{tmp_path}/o2"
    from fastgrpo.train import commands

    args = build_parser().parse_args(["eval", "--checkpoint", "~/nowhere"])
    with pytest.raises(ValueError, match=f"checkpoint: no such folder {tmp_path}/nowhere"):
        commands.config_from_args("eval", args)
