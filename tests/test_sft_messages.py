"""`fastgrpo sft` on TRL's dataset formats: conversational `messages` rows (the last turn, the assistant's, is the
response; the turns before it the prompt) and prompt / `completion` rows (a completion as text or as one assistant
message), and their mistakes refused naming the row before the model loads."""
from __future__ import annotations

import json

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.loading import load_dataset
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import tokenize_rows

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")
KWARGS = dict(prompt_column="prompt", response_column="response", prompt_format="auto", max_seq_length=64,
              truncate=False)
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12 say a"},
         {"role": "assistant", "content": "aa"}]


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_messages_rows_train_on_the_last_assistant_turn(chat_tokenizer):
    # refused with "no column 'prompt' (prompt_column); columns: ['messages']"
    expected = tokenize_rows([{"prompt": TURNS[:-1], "response": "aa"}], chat_tokenizer, **KWARGS)
    assert tokenize_rows([{"messages": TURNS}], chat_tokenizer, **KWARGS) == expected
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_list([{"messages": TURNS, "source": "x"}])
    assert tokenize_rows(table, chat_tokenizer, **KWARGS) == expected


@pytest.mark.parametrize("completion", ["aa", [{"role": "assistant", "content": "aa"}]])
def test_prompt_completion_rows_train_on_the_completion(chat_tokenizer, completion):
    expected = tokenize_rows([{"prompt": TURNS[:-1], "response": "aa"}], chat_tokenizer, **KWARGS)
    assert tokenize_rows([{"prompt": TURNS[:-1], "completion": completion}], chat_tokenizer, **KWARGS) == expected


def test_a_named_response_column_is_not_replaced_by_completion(chat_tokenizer):
    # TRL's name stands in for the default one only: a column the user named must be there
    with pytest.raises(ValueError, match=r"^dataset: no column 'target' \(response_column\); columns: "):
        tokenize_rows([{"prompt": "a", "completion": "b"}], chat_tokenizer, **{**KWARGS, "response_column": "target"})


@pytest.mark.parametrize("turns, problem", [
    (TURNS[:-1], "expected the last turn to be the assistant's (the response trained on), got a 'user' turn"),
    (TURNS[-1:], "expected turns before the last assistant turn (the prompt), got only the assistant's"),
    ([], "expected the last turn to be the assistant's (the response trained on), got no turns"),
])
def test_a_conversation_without_a_final_assistant_turn_is_refused_naming_the_row(tmp_path, turns, problem):
    path = write_rows(tmp_path / "chats.jsonl", [{"messages": TURNS}, {"messages": turns}])
    with pytest.raises(ValueError) as err:  # before the model loads: the commands load the rows first
        load_dataset(SFTConfig(dataset=path))
    assert str(err.value) == f"dataset: row 1: messages: {problem}"


def test_a_missing_response_column_is_refused_as_the_rows_load(tmp_path):
    # found only by tokenize_rows, after the model had loaded
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "say a", "answer": "a"}])
    with pytest.raises(ValueError) as err:
        load_dataset(SFTConfig(dataset=path))
    assert str(err.value) == "dataset: no column 'response' (response_column); columns: ['prompt', 'answer']"


def test_fastgrpo_sft_trains_on_messages_rows(tmp_path, chat_tokenizer):
    default_task.build_model(chat_tokenizer).save_pretrained(tmp_path / "model")
    chat_tokenizer.save_pretrained(tmp_path / "model")
    rows = [{"messages": [{"role": "user", "content": f"{i} say c"}, {"role": "assistant", "content": "cccc"}]}
            for i in range(4)]
    out = tmp_path / "out"
    assert main(["sft", "--model", str(tmp_path / "model"), "--dataset", write_rows(tmp_path / "chats.jsonl", rows),
                 "--output-dir", str(out), "--batch-size", "4", "--micro-batch-size", "2", "--max-steps", "1",
                 "--max-seq-length", "32", "--dtype", "float32", "--device", "cpu", "--no-progress-bar"]) == 0
    assert (out / "metrics.jsonl").is_file()
