"""Prompts too long for a run are refused before the model loads: the commands tokenize them with the tokenizer alone
(it loads in well under a second; a model can take minutes). The model folder here has a config.json and a
tokenizer, and no weights: a check left to after the load would meet the missing weights first."""
from __future__ import annotations

import json
import logging
import re

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.expert_iteration import ExpertIteration

QUIET = ["--no-progress-bar", "--logging-steps", "0", "--no-export"]
RAISE = "raise --max-prompt-length or pass --truncate-prompts to left-truncate"


@pytest.fixture
def no_weights(tmp_path) -> str:
    """A model folder of the built-in tokenizer and a Qwen2 config with 64 positions, without weights."""
    from transformers import Qwen2Config

    folder = tmp_path / "model"
    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(folder)
    Qwen2Config(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64).save_pretrained(folder)
    return str(folder)


def _rows(tmp_path, *prompts: str) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "letter": "a", "answer": "a"}) + "\n" for p in prompts))
    return str(data)


@pytest.mark.parametrize("command", ["train", "ei"])
def test_an_over_long_prompt_is_refused_before_the_model_loads(no_weights, tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    reward = [] if command == "train" else ["--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward"]
    argv = [command, "--model", no_weights, "--dataset", _rows(tmp_path, "1 say a", "12 say a"), *reward,
            "--prompt-format", "raw", "--max-prompt-length", "7", "--max-completion-length", "8",
            "--output-dir", str(tmp_path / "run"), *QUIET]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"fastgrpo {command}: error: dataset: row 1 has a 8-token prompt, over max_prompt_length (7); "
                   f"{RAISE}\n"), err


def test_the_longest_over_long_prompt_is_named_with_how_many_are(tmp_path):
    """Raising the limit to the first over-long row's count only met the next, longer one: the error names the
    longest, which the limit must reach, and how many others are over it."""
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.grpo_data import prompt_token_ids

    rows = [{"prompt": p} for p in ("1 say a", "12 say a", "1234 say a", "123 say a")]
    config = GRPOConfig(max_prompt_length=7, prompt_format="raw")
    with pytest.raises(ValueError, match=r"^dataset: row 2 has a 10-token prompt, over max_prompt_length \(7\), as "
                                         r"2 other rows' are; raise max_prompt_length or pass truncate_prompts=True "
                                         r"to left-truncate$"):
        prompt_token_ids(rows, default_task.build_tokenizer(), config)


def test_left_truncated_prompts_are_said_in_one_line(tmp_path, caplog):
    from fastgrpo.train.config import GRPOConfig
    from fastgrpo.train.grpo_data import prompt_token_ids

    rows = [{"prompt": p} for p in ("1 say a", "12 say a", "1234 say a")]
    config = GRPOConfig(max_prompt_length=7, prompt_format="raw", truncate_prompts=True)
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.grpo_data"):
        ids = prompt_token_ids(rows, default_task.build_tokenizer(), config)
    assert [len(i) for i in ids] == [7, 7, 7]
    assert [r.getMessage() for r in caplog.records] == [
        "dataset: 2 of 3 prompts over max_prompt_length (7) left-truncated to their last 7 tokens "
        "(truncate_prompts=True): rows 1, 2"]


def test_ei_says_what_to_do_with_an_over_long_prompt_and_can_truncate(tmp_path):
    """ei's error said "over max_prompt_length (16)" and no fix; it has train's truncate_prompts too."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    rows = [{"prompt": "1234 say a", "letter": "a"}]
    args = dict(prompt_format="raw", max_prompt_length=7, max_completion_length=2, output_dir=str(tmp_path),
                questions_per_step=1, batch_size=4, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"^dataset: row 0 has a 10-token prompt, over max_prompt_length \(7\); raise "
                                         r"max_prompt_length or pass truncate_prompts=True to left-truncate$"):
        ExpertIteration(model, tokenizer, default_task.repeat_letter_reward, rows, EIConfig(**args))
    run = ExpertIteration(model, tokenizer, default_task.repeat_letter_reward, rows,
                          EIConfig(**args, truncate_prompts=True))
    assert tokenizer.decode(run.prompts[0]) == "4 say a"


def test_eval_refuses_prompts_past_the_models_positions_before_it_loads(no_weights, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["eval", "--model", no_weights, "--dataset", _rows(tmp_path, "1 say a", "1234 say a"),
            "--prompt-format", "raw", "--max-new-tokens", "60", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == ("fastgrpo eval: error: dataset: row 1 has a 10-token prompt; with 60 new tokens that is 70 "
                   "positions, over the model's max_position_embeddings (64): shorten the prompts or lower "
                   "--max-new-tokens to 54 or less\n"), err


def test_eval_of_a_checkpoint_checks_with_its_runs_model(no_weights, tmp_path, capsys, monkeypatch):
    """Without --model, eval of a --checkpoint loads the model its run trained: that model's tokenizer and positions
    are the ones its prompts are checked against."""
    from fastgrpo.train.checkpoint import CONFIG_FILE, STATE_FILE

    monkeypatch.chdir(tmp_path)
    checkpoint = tmp_path / "run" / "checkpoint-1"
    checkpoint.mkdir(parents=True)
    (checkpoint / STATE_FILE).write_bytes(b"")
    (checkpoint / CONFIG_FILE).write_text(json.dumps({"model": no_weights, "prompt_format": "raw"}))
    argv = ["eval", "--checkpoint", str(checkpoint), "--dataset", _rows(tmp_path, "1234 say a"),
            "--max-new-tokens", "60", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the line saying the run's prompt_format is taken
    assert re.fullmatch(r"fastgrpo eval: error: dataset: row 0 has a 10-token prompt; with 60 new tokens that is 70 "
                        r"positions, over the model's max_position_embeddings \(64\): .*", err), err


def test_sft_refuses_an_over_long_row_before_the_model_loads(no_weights, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1234 say a", "response": "aaaa"}) + "\n")
    argv = ["sft", "--model", no_weights, "--dataset", str(data), "--prompt-format", "raw", "--max-seq-length", "12",
            "--output-dir", str(tmp_path / "run"), *QUIET]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("fastgrpo sft: error: dataset: row 0 has 15 tokens, over max_seq_length (12); "
                                       "raise --max-seq-length or pass --truncate-sequences\n")


@pytest.mark.parametrize("command, argv, new_tokens", [
    ("train", ["--max-prompt-length", "8", "--max-completion-length", "49"], "--max-completion-length"),
    ("sft", ["--max-seq-length", "16", "--eval-max-new-tokens", "49"], "--eval-max-new-tokens"),
])
def test_eval_rows_past_the_models_positions_are_refused_before_it_loads(no_weights, tmp_path, capsys, monkeypatch,
                                                                         command, argv, new_tokens):
    """A run's periodic evaluation (--eval-steps): its prompts and new tokens within the model's positions."""
    monkeypatch.chdir(tmp_path)
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(json.dumps({"prompt": "1234567890 say a", "letter": "a", "answer": "a"}) + "\n")
    train_data = tmp_path / "train.jsonl"
    train_data.write_text(json.dumps({"prompt": "1 say a", "letter": "a", "response": "a"}) + "\n")
    rewards = ["--eval-reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward"] if command == "sft" else \
        ["--reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward"]
    assert main([command, "--model", no_weights, "--dataset", str(train_data), "--eval-steps", "1", "--eval-dataset",
                 str(eval_data), "--prompt-format", "raw", *rewards, *argv, "--output-dir", str(tmp_path / "run"),
                 *QUIET]) == 2
    assert capsys.readouterr().err == (
        f"fastgrpo {command}: error: eval_dataset: row 0 has a 16-token prompt; with 49 new tokens that is 65 "
        f"positions, over the model's max_position_embeddings (64): shorten the prompts or lower {new_tokens} to 48 "
        "or less\n")


@pytest.mark.parametrize("command", ["train", "ei", "eval"])
def test_reward_weights_of_another_count_are_refused_before_the_data_loads(no_weights, tmp_path, capsys,
                                                                           monkeypatch, command):
    """Each reward name is one function: the counts are known from the settings (the dataset named is no file)."""
    monkeypatch.chdir(tmp_path)
    argv = [command, "--model", no_weights, "--dataset", str(tmp_path / "missing.jsonl"), "--reward-funcs",
            "fastgrpo.train.default_task:repeat_letter_reward", "--reward-weights", "1", "2", "--prompt-format", "raw",
            "--output-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"fastgrpo {command}: error: reward_weights: expected one weight per name in "
                                       "reward_funcs (1), got 2\n")


@pytest.mark.parametrize("command", ["train", "ei"])
def test_rows_of_other_columns_are_refused_before_the_model_loads(no_weights, tmp_path, capsys, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "mixed.jsonl"
    data.write_text(json.dumps({"prompt": "1 say a", "letter": "a"}) + "\n"
                    + json.dumps({"prompt": "2 say b", "letter": "b", "id": 3}) + "\n")
    argv = [command, "--model", no_weights, "--dataset", str(data), "--reward-funcs",
            "fastgrpo.train.default_task:repeat_letter_reward", "--prompt-format", "raw", "--max-prompt-length", "16",
            "--max-completion-length", "8", "--output-dir", str(tmp_path / "run"), *QUIET]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"fastgrpo {command}: error: dataset: row 1 has columns ['id', 'letter', "
                                       "'prompt'], row 0 has ['letter', 'prompt']; every row needs the same columns\n")


def test_a_model_folder_without_a_tokenizer_is_one_line_naming_it(tmp_path, capsys, monkeypatch):
    """transformers makes an empty tokenizer of a qwen2 config.json alone: every prompt had no tokens ('prompt: ...
    has no tokens'), which blamed the rows."""
    from transformers import Qwen2Config

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "model"
    Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64).save_pretrained(folder)
    argv = ["train", "--model", str(folder), "--dataset", _rows(tmp_path, "1 say a"), "--max-prompt-length", "16",
            "--max-completion-length", "8", "--output-dir", str(tmp_path / "run"), *QUIET]
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"fastgrpo train: error: model: cannot load '{folder}' from the local folder: "
                                       "it has no tokenizer files (tokenizer.json, tokenizer_config.json); save the "
                                       "model's tokenizer there (tokenizer.save_pretrained)\n")
