"""The hints of `fastgrpo`'s one-line errors: the flags a word starts, TRL's flag names, comma-joined reward names, the
config file a bad value came from, fsdp_* settings that would do nothing; --help once under torchrun; the closing
line of a one-step run."""
import pytest

from fastgrpo.train.cli import main


def _error(argv, capsys) -> str:
    """The one line `fastgrpo ...` prints for bad input (exit 2), without its "(see ... --help)"."""
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's
        code = exit_info.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, (argv, err)
    return err.removesuffix("\n").split(" (see fastgrpo")[0]


@pytest.mark.parametrize("argv, hint", [
    (["train", "--reward", "length"], "--reward (did you mean --reward-funcs, --reward-weights or --reward-errors?)"),
    (["eval", "--checkpoint-dir", "x"], "--checkpoint-dir (did you mean --checkpoint?)"),
    (["train", "--fsdp", "1"], "--fsdp (did you mean --fsdp-cpu-offload, --fsdp-reshard-after-forward, "
                               "--fsdp-sync-every-micro-batch or --fsdp-layers-per-group?)"),
    (["train", "--rollout"], "--rollout (one of the 8 flags --rollout-*: --rollout-engine, --rollout-attention, "
                             "--rollout-weights, --rollout-kv-cache, --rollout-correction, ...)"),
])
def test_a_flag_that_starts_several_names_them(argv, hint, capsys):
    assert _error(argv, capsys) == f"fastgrpo {argv[0]}: error: unrecognized arguments: {hint}" + (
        f" {argv[2]}" if len(argv) > 2 else "")


@pytest.mark.parametrize("argv, hint", [
    (["train", "--num-train-epochs", "3"], "--num-train-epochs (TRL's name; here --max-steps) 3"),
    (["sft", "--num_train_epochs=3"], "--num_train_epochs=3 (TRL's name; here --num-epochs)"),
    (["train", "--model-name-or-path", "m"], "--model-name-or-path (TRL's name; here --model) m"),
    (["train", "--use-peft"], "--use-peft (TRL's name; here --lora-rank > 0)"),
    (["ei", "--bf16"], "--bf16 (TRL's name; here --dtype bfloat16)"),
    (["train", "--use_vllm"], "--use_vllm (TRL's name; here --rollout-engine vllm)"),
    (["train", "--gradient-accumulation-steps", "4"], "--gradient-accumulation-steps (TRL's name; here "
                                                      "--micro-batch-size, gradients accumulate over a step's "
                                                      "micro-batches) 4"),
    (["train", "--lr", "3"], "--lr (TRL's name; here --learning-rate) 3"),
    (["eval", "--use-peft"], "--use-peft"),  # eval trains nothing: no counterpart
    (["sft", "--use-liger-kernel"], "--use-liger-kernel (TRL's name; here --patch, on by default: fastgrpo's own "
                                    "fused kernels; the loss is fused always)"),
    (["train", "--vllm-mode", "colocate"], "--vllm-mode (TRL's name; here --rollout-engine vllm, always colocated: "
                                           "in this process, no server mode) colocate"),
    (["sft", "--packing"], "--packing (TRL's name; no packing here: a step's rows are sorted by length into "
                           "micro-batches, each padded to its longest)"),
    (["sft", "--dataset-text-field", "body"], "--dataset-text-field (TRL's name; a column named text is read as "
                                              "plain text, trained on every token) body"),  # was: --dataset-config
    (["train", "--dataset_text_field", "body"], "--dataset_text_field (TRL's name; here --prompt-column) body"),
    (["train", "--generation-batch-size", "8"], "--generation-batch-size (TRL's name; here --batch-size, the "
                                                "completions of one rollout batch) 8"),  # not: a `fastgrpo ei` flag
    (["ei", "--log-completions"], "--log-completions (TRL's name; here --eval-steps, an evaluation's completions: "
                                  "every one in its JSONL file, a few printed to the log)"),
    (["train", "--deepspeed", "ds_zero3.json"], "--deepspeed (TRL's name; no DeepSpeed here: full fine-tuning under "
                                                "torchrun shards with FSDP2) ds_zero3.json"),
    # HF / TRL names a user types that no close match found (were "unrecognized arguments" naming nothing)
    (["train", "--per-device-train-batch-size", "8"], "--per-device-train-batch-size (TRL's name; here "
                                                      "--micro-batch-size, per forward/backward; a step's rows: "
                                                      "batch_size) 8"),
    (["sft", "--dataset-name", "trl-lib/Capybara"], "--dataset-name (TRL's name; here --dataset) trl-lib/Capybara"),
    (["ei", "--eval-strategy", "steps"], "--eval-strategy (TRL's name; here --eval-steps, N > 0: every N, and at the "
                                         "end; 0: off) steps"),
    (["train", "--save-strategy", "steps"], "--save-strategy (TRL's name; here --save-steps, N > 0: every N, and at "
                                            "the end; 0: only at the end) steps"),
    (["sft", "--logging-strategy", "steps"], "--logging-strategy (TRL's name; here --logging-steps) steps"),
])
def test_trls_flag_names_get_fastgrpos(argv, hint, capsys):
    assert _error(argv, capsys) == f"fastgrpo {argv[0]}: error: unrecognized arguments: {hint}"


def test_greedy_sampling_of_a_group_names_both_flags(tmp_path, capsys):
    err = _error(["eval", "--temperature", "0", "--num-generations", "4", "--output-dir", str(tmp_path)], capsys)
    assert err == ("fastgrpo eval: error: temperature: 0 samples greedily: with --num-generations 4 the completions "
                   "of a prompt are identical (pass@4 would be pass@1); for greedy pass --num-generations 1, or a "
                   "temperature > 0")


def test_comma_joined_reward_names_are_told_to_be_spaced(tmp_path, capsys):
    err = _error(["train", "--reward-funcs", "length,ifeval", "--output-dir", str(tmp_path)], capsys)
    assert err == ("fastgrpo train: error: reward_funcs: unknown reward 'length,ifeval'; names are separated by "
                   "spaces, not commas (--reward-funcs length ifeval; in YAML, a list: [length, ifeval])")


@pytest.mark.parametrize("command", ["train", "sft", "ei", "eval"])
def test_a_bad_value_from_the_config_file_names_the_file(tmp_path, capsys, command):
    """Wrong types from the file named it; wrong values did not. A flag's bad value names the flag's setting alone,
    also where the file set the same key."""
    path = tmp_path / "run.yaml"
    path.write_text("dtype: bf16\nseed: 1\n")
    out = ["--output-dir", str(tmp_path / "out")]
    expected = "dtype: expected one of ['auto', 'float32', 'bfloat16', 'float16'], got 'bf16'"
    assert _error([command, "--config", str(path), *out], capsys) == (
        f"fastgrpo {command}: error: dtype (from {path}): {expected.removeprefix('dtype: ')}")
    assert _error([command, "--config", str(path), "--dtype", "bf16", *out], capsys) == (
        f"fastgrpo {command}: error: {expected}")
    assert _error([command, "--config", str(path), "--dtype", "float32", "--seed", "-1", *out], capsys) == (
        f"fastgrpo {command}: error: seed: expected an int in [0, 2**32), got -1")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_help_prints_once_under_torchrun(monkeypatch, capsys, rank):
    """torchrun runs `fastgrpo train --help` on every process: rank 0 prints it, the others exit 0 quietly."""
    monkeypatch.setenv("RANK", rank)
    for argv in (["train", "--help"], ["--help"], ["--version"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        out = capsys.readouterr().out
        assert exit_info.value.code == 0 and (out != "") == (rank == "0"), (argv, out)


@pytest.mark.parametrize("command, length, unit", [("train", "--max-steps", "step"), ("sft", "--max-steps", "step"),
                                                   ("ei", "--ei-steps", "round")])
def test_a_one_step_run_closes_with_its_numbers_once(tmp_path, capsys, command, length, unit):
    """"reward 0.044 (step 1) -> 0.044 (step 1)" said one number twice; sft's loss and ei's reward and kept share
    did too."""
    assert main([command, "--output-dir", str(tmp_path), length, "1", "--no-progress-bar", "--no-export"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert f"(1 {unit})" not in last and f"({unit} 1)" in last and "->" not in last, last


@pytest.mark.parametrize("command", ["train", "sft", "ei"])
def test_fsdp_settings_that_do_nothing_are_refused(monkeypatch, tmp_path, capsys, command):
    """fsdp_* settings shape FSDP2, which shards full fine-tuning under torchrun: a LoRA run trains through DDP there
    and a run of one process wraps nothing; both ignored them silently."""
    out = ["--output-dir", str(tmp_path / "out")]
    assert _error([command, "--fsdp-layers-per-group", "2", *out], capsys) == (
        f"fastgrpo {command}: error: fsdp_layers_per_group: shapes FSDP2, which shards full fine-tuning under "
        "torchrun, and this run has one process")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _error([command, "--lora-rank", "8", "--no-fsdp-reshard-after-forward", *out], capsys) == (
        f"fastgrpo {command}: error: fsdp_reshard_after_forward: shapes FSDP2, which shards full fine-tuning under "
        "torchrun, and a LoRA run (--lora-rank 8) trains through DDP")


def test_fsdp_settings_of_a_full_fine_tuning_launch_or_at_their_defaults_pass(monkeypatch):
    from fastgrpo.train.cli import build_parser
    from fastgrpo.train.commands import config_from_args

    def config(argv):
        return config_from_args("train", build_parser().parse_args(["train", *argv]))

    assert config(["--fsdp-reshard-after-forward", "--fsdp-layers-per-group", "1"]).fsdp_layers_per_group == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert config(["--fsdp-cpu-offload", "--fsdp-layers-per-group", "2"]).fsdp_cpu_offload


@pytest.mark.parametrize("argv, hint", [
    (["train", "--gradient-checkpointing", "true"], "true (--gradient-checkpointing takes no value: "
                                                    "--gradient-checkpointing turns it on, --no-gradient-checkpointing "
                                                    "off)"),
    (["sft", "--no-export", "False"], "False (--no-export takes no value: --export turns it on, --no-export off)"),
    (["ei", "--truncate-prompts", "yes"], "yes (--truncate-prompts takes no value: --truncate-prompts turns it on, "
                                          "--no-truncate-prompts off)"),
])
def test_a_value_after_a_true_false_flag_says_the_flag_takes_none(argv, hint, capsys):
    """TRL's flags take one (`--gradient_checkpointing true`); argparse said only `unrecognized arguments: true`."""
    assert _error(argv, capsys) == f"fastgrpo {argv[0]}: error: unrecognized arguments: {hint}"
