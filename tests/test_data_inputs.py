"""A user's own data and reward functions, as `fastgrpo train / sft / ei / eval` take them."""
from __future__ import annotations

import json

import pytest

from fastgrpo.rewards.scoring import score
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.loading import load_dataset, load_eval_dataset, load_rows, tokenizer_before_load
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sources import DATA_FILE_FORMS


def test_a_folder_written_by_save_to_disk_loads(tmp_path):
    # datasets.load_dataset refuses such a folder ("use load_from_disk"), which a command-line user cannot call
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "what is 1 plus 1", "answer": "2"}, {"prompt": "what is 2 plus 2", "answer": "4"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    loaded = load_rows(str(tmp_path / "saved"))
    assert [dict(loaded[i]) for i in range(len(loaded))] == rows


def test_a_reward_function_returning_none_is_named_as_returning_it():
    # it raised nothing: "raised TypeError: 'NoneType' object is not iterable" sent the user looking for an exception
    def forgot_return(prompts, completions, **columns):
        [len(c) for c in completions]

    rewards, failures = score([forgot_return], ["p", "p"], ["a", "b"], {})
    assert failures["forgot_return"] == "returned None, expected a list of 2 rewards (one per completion)"
    assert rewards.tolist() == [[0.0], [0.0]]


def test_a_reward_function_returning_one_number_is_named_as_returning_it():
    rewards, failures = score([lambda prompts, completions, **columns: 1.0], ["p", "p"], ["a", "b"], {})
    assert failures["<lambda>"] == "returned 1.0, expected a list of 2 rewards (one per completion)"


@pytest.mark.parametrize("prompt, kind", [(None, "NoneType"), (7, "int"), ([{"content": "hi"}], "list")])
def test_a_row_whose_prompt_is_no_prompt_is_refused_as_the_rows_load(tmp_path, prompt, kind):
    # found only when the rows were tokenized, after the model had loaded (minutes for a large one)
    path = tmp_path / "data.jsonl"
    rows = [{"prompt": "what is 1 plus 1", "answer": "2"}, {"prompt": prompt, "answer": "4"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as err:
        load_dataset(GRPOConfig(dataset=str(path)))
    assert str(err.value) == ("dataset: row 1: prompt: expected a string or a list of chat messages {'role': ..., "
                              f"'content': ...}}, got {kind}")


def test_only_the_rows_an_evaluation_reads_are_checked(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": "what is 1 plus 1", "answer": "2"}, {"question": None, "answer": "4"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    config = EvalConfig(dataset=str(tmp_path / "saved"), prompt_column="question", max_examples=1)
    assert len(load_dataset(config)) == 2
    config.max_examples = 0
    with pytest.raises(ValueError, match=r"^dataset: row 1: prompt: expected a string .*, got NoneType$"):
        load_dataset(config)


def test_an_sft_row_without_a_response_is_refused_as_the_rows_load(tmp_path):
    path = tmp_path / "traces.jsonl"
    rows = [{"prompt": "say a", "response": "aaa"}, {"prompt": "say b"}, {"prompt": "say c", "response": None}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as err:
        load_dataset(SFTConfig(dataset=str(path)))
    assert str(err.value) == ("dataset: row 1 has no column 'response'; row 0 has ['prompt', 'response'], and every "
                              "row needs the prompt and response columns")
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[::2]))
    with pytest.raises(ValueError) as err:
        load_dataset(SFTConfig(dataset=str(path)))
    assert str(err.value) == "dataset: row 1: response: expected a string, got NoneType"


NO_TEMPLATE = ("dataset: row 1: chat messages need a chat template, and the model's tokenizer has none: give text "
               "prompts (prompt_format raw, auto or r1_zero) or a model whose tokenizer has a chat template")


@pytest.fixture
def model_without_chat_template(tmp_path):
    # a tokenizer and a config only: were the weights read, from_pretrained would fail
    from fastgrpo.train import default_task

    tokenizer = default_task.build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "model")
    default_task.build_model(tokenizer).config.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


@pytest.mark.parametrize("make_config", [
    lambda data, model: GRPOConfig(dataset=data, model=model),
    lambda data, model: EvalConfig(dataset=data, model=model, prompt_format="raw"),
    lambda data, model: SFTConfig(dataset=data, model=model),
    lambda data, model: GRPOConfig(dataset=data),  # the built-in model's tokenizer has none either
])
def test_chat_prompts_without_a_chat_template_are_refused_before_the_model_loads(
        tmp_path, model_without_chat_template, make_config):
    # found by tokenizing, after the model had loaded, in a line that named no option
    chat = [{"role": "user", "content": "say b"}]
    rows = [{"prompt": "say a", "response": "a", "answer": "a"}, {"prompt": chat, "response": "b", "answer": "b"}]
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as err:
        load_dataset(make_config(str(path), model_without_chat_template))
    assert str(err.value) == NO_TEMPLATE


def test_the_chat_format_without_a_chat_template_is_refused_before_the_model_loads(
        tmp_path, model_without_chat_template):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "say a"}\n')
    with pytest.raises(ValueError, match=r"^dataset: row 0: prompt_format: 'chat' needs a tokenizer with a chat "):
        load_dataset(GRPOConfig(dataset=str(path), model=model_without_chat_template, prompt_format="chat"))


def test_chat_prompts_under_r1_zero_are_refused_before_the_model_loads(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"^dataset: row 0: prompt_format: 'r1_zero' wraps a text question; got chat"):
        load_dataset(EvalConfig(dataset=str(path)))


def test_a_missing_column_names_a_close_match():
    from fastgrpo.train.input_checks import check_reward_rows
    from fastgrpo.train.sft_data import sft_pairs

    def needs_answer(prompts, completions, answer, **columns):
        return [0.0] * len(completions)

    with pytest.raises(ValueError) as err:
        check_reward_rows([{"promt": "say a", "answer": "a"}], "prompt", [], "dataset")
    assert str(err.value) == ("dataset: no prompt column 'prompt' (prompt_column); columns: ['promt', 'answer']; did "
                              "you mean 'promt'?")
    with pytest.raises(ValueError) as err:
        check_reward_rows([{"prompt": "say a", "answers": "a"}], "prompt", [needs_answer], "eval_dataset")
    assert str(err.value) == ("eval_dataset: reward function needs_answer needs columns ['answer'], which the dataset "
                              "lacks (columns: ['prompt', 'answers']); did you mean 'answers'?")
    with pytest.raises(ValueError) as err:
        sft_pairs([{"prompt": "say a", "respones": "a"}], "prompt", "response")
    assert str(err.value) == ("dataset: no column 'response' (response_column); columns: ['prompt', 'respones']; did "
                              "you mean 'respones'?")
    with pytest.raises(ValueError, match=r"columns: \['question', 'answer'\]$"):  # none close: no guess
        check_reward_rows([{"question": "say a", "answer": "a"}], "prompt", [], "dataset")


def test_an_eval_dataset_is_checked_before_the_model_loads(tmp_path):
    # read inside the trainer: a wrong path or column stopped the run after the model had loaded
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "say a", "response": "a", "answer": "a"}\n')
    chats = tmp_path / "chats.jsonl"  # TRL's conversational rows: sft evaluates on their prompt turns, graded by
    # eval_reward_funcs (r1_zero_math: each row's answer)
    chats.write_text('{"messages": [{"role": "user", "content": "say a"}, {"role": "assistant", "content": "a"}]}\n')
    chat_prompts = tmp_path / "chat_prompts.jsonl"
    chat_prompts.write_text('{"prompt": [{"role": "user", "content": "say a"}], "answer": "a"}\n')
    tokenizer = tokenizer_before_load(None)  # the built-in model's
    for config, message in [
        (SFTConfig(dataset=str(train), eval_dataset=str(tmp_path / "nope.jsonl"), eval_steps=10),
         f"eval_dataset: no such file or folder {tmp_path / 'nope.jsonl'}; eval_dataset takes a {DATA_FILE_FORMS}"),
        (SFTConfig(dataset=str(train), eval_dataset=str(chats), eval_steps=10),
         "eval_dataset: reward function r1_zero_math_reward needs columns ['answer'], which the dataset lacks "
         "(columns: ['messages', 'prompt'])"),
        (GRPOConfig(dataset=str(train), eval_dataset=str(chat_prompts), eval_steps=10, reward_funcs=["r1_zero_math"]),
         NO_TEMPLATE.replace("dataset: row 1", "eval_dataset: row 0")),
    ]:
        with pytest.raises(ValueError) as err:
            load_eval_dataset(config, tokenizer)
        assert str(err.value) == message
    not_evaluating = SFTConfig(dataset=str(train), eval_dataset=str(tmp_path / "nope.jsonl"))  # no eval_steps
    assert load_eval_dataset(not_evaluating, tokenizer) is None
    with pytest.raises(ValueError, match="^eval_dataset: eval_steps > 0 on your own dataset needs rows to evaluate"):
        load_eval_dataset(SFTConfig(dataset=str(train), eval_steps=10), tokenizer)  # no eval_dataset


@pytest.mark.parametrize("spelt", ["$REWARDS_DIR/my_reward.py:fn", "${REWARDS_DIR}/my_reward.py:fn",
                                   "~/my_reward.py:fn"])
def test_a_reward_files_path_expands_variables_and_home(tmp_path, monkeypatch, spelt):
    # as dataset and model paths do (coercion.PATH_FIELDS): `--reward-funcs '$X/r.py:fn'` in YAML or quoted
    from fastgrpo.train.loading import resolve_reward

    (tmp_path / "my_reward.py").write_text("def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.setenv("REWARDS_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_reward(spelt)(["a", "b"]) == [1.0, 1.0]


def test_an_unset_variable_in_a_reward_files_path_is_named(monkeypatch):
    from fastgrpo.train.loading import resolve_reward

    monkeypatch.delenv("NO_SUCH_REWARDS_DIR", raising=False)
    with pytest.raises(ValueError, match=r"^reward_funcs: environment variable NO_SUCH_REWARDS_DIR is not set \(in "
                                         r"'\$NO_SUCH_REWARDS_DIR/r.py'\)$"):
        resolve_reward("$NO_SUCH_REWARDS_DIR/r.py:fn")
