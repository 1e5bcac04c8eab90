"""A run's exported final/ of the built-in tiny model: its tokenizer reloads with AutoTokenizer (as fastgrpo's own
`--model` loading does) to the ids the run trained on, and `fastgrpo eval --model` on it reads the prompts as the
run did; a generation length past the model's positions is refused with the length that fits."""
import json

import pytest
from transformers import AutoTokenizer

from fastgrpo.rewards import r1_zero_math_reward
from fastgrpo.train import default_task
from fastgrpo.train.checkpoint import export_model
from fastgrpo.train.cli import main
from fastgrpo.train.evaluate import build_eval_task
from fastgrpo.train.loading import load_inference_model

QUIET = ["--no-progress-bar", "--logging-steps", "0"]
# spaces (which a generic tokenizer in a qwen2 folder lost on reload), runs of them, every known character, specials
TEXTS = ["914 say b", "  a:b  c ", " " + default_task.CHARACTERS, "say c<eos><pad>", ""]


def _check_reloads_as_built(folder):
    built, reloaded = default_task.build_tokenizer(), AutoTokenizer.from_pretrained(folder)
    assert type(reloaded) is type(built) and len(reloaded) == len(built)
    assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.padding_side) == (0, 1, "left")
    for text in TEXTS:
        ids = built(text)["input_ids"]
        assert reloaded(text)["input_ids"] == ids, text
        assert reloaded.decode(ids) == text
    # a character the vocabulary lacks is dropped by both alike (Qwen2Tokenizer's BPE has no unknown token)
    assert reloaded("Say B!")["input_ids"] == built("Say B!")["input_ids"] == built("ay ")["input_ids"]


def test_an_exported_builtin_model_reloads_its_tokenizer_with_the_training_ids(tmp_path):
    tokenizer = default_task.build_tokenizer()
    assert tokenizer("914 say b")["input_ids"] == [38, 30, 33, 39, 21, 3, 27, 39, 4]  # the ids runs trained on
    folder = export_model(default_task.build_model(tokenizer), tokenizer, tmp_path / "final", run_config={})
    _check_reloads_as_built(folder)
    _, loaded = load_inference_model(model=str(folder), dtype="float32", device="cpu")  # eval/train --model
    assert loaded("914 say b")["input_ids"] == tokenizer("914 say b")["input_ids"]


@pytest.mark.parametrize("command", ["train", "sft"])
def test_the_final_of_a_builtin_run_reloads_its_tokenizer(tmp_path, command):
    assert main([command, "--max-steps", "1", "--output-dir", str(tmp_path), *QUIET]) == 0
    _check_reloads_as_built(tmp_path / "final")


def test_builtin_tokenizer_refuses_characters_outside_one_byte():
    with pytest.raises(ValueError, match=r"characters: expected ASCII characters .*got \['é'\]"):
        default_task.build_tokenizer("abé")


def test_eval_of_a_builtin_runs_final_matches_its_checkpoint(tmp_path):
    """--model run/final of a tiny-model run takes the tiny model's eval presets (its 8 new tokens, not the default
    1024 its 64 positions cannot hold) and the run's prompt format, as --checkpoint does: the same prompts (spaces
    and all) and completions."""
    run = tmp_path / "run"
    assert main(["train", "--max-steps", "2", "--output-dir", str(run), *QUIET]) == 0
    common = ["--max-examples", "8"]
    assert main(["eval", "--model", str(run / "final"), "--output-dir", str(tmp_path / "m"), *common]) == 0
    assert main(["eval", "--checkpoint", str(run), "--output-dir", str(tmp_path / "c"), *common]) == 0
    read = [[json.loads(line) for line in (tmp_path / out / "results.jsonl").read_text().splitlines()]
            for out in ("m", "c")]
    rows = default_task.build_sft_dataset(num_rows=8, seed=1)  # eval's built-in rows (seed + 1)
    assert [r["prompt"] for r in read[0]] == [row["prompt"] for row in rows]  # spaces and all
    assert [(r["prompt"], r["completion"]) for r in read[0]] == [(r["prompt"], r["completion"]) for r in read[1]]


def test_prompts_past_the_positions_name_the_longest_and_the_length_that_fits():
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a", "answer": "a"}, {"prompt": "1 say a " * 3, "answer": "a"}, {"prompt": "a",
                                                                                            "answer": "a"}]
    args = dict(prompt_column="prompt", prompt_format="raw", reward_funcs=[r1_zero_math_reward], max_positions=30)
    with pytest.raises(ValueError, match=r"row 1 has a 24-token prompt; with 8 new tokens that is 32 positions, over "
                                         r"the model's max_position_embeddings \(30\): shorten the prompts or lower "
                                         r"max_new_tokens to 6 or less$"):
        build_eval_task(rows, tokenizer, max_new_tokens=8, **args)
    assert build_eval_task(rows, tokenizer, max_new_tokens=6, **args)
    with pytest.raises(ValueError, match=r"shorten the prompts \(it leaves no position for a new token\)$"):
        build_eval_task(rows, tokenizer, max_new_tokens=1, **{**args, "max_positions": 24})
