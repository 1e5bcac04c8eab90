"""Edges of how the commands read a user's data: a split named for one file, numbers in a CSV's text columns, TRL's
plain `text` rows for sft, conversational rows as eval_dataset, emptied and saved datasets."""
from __future__ import annotations

import gzip
import json

import pytest

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.loading import eval_rows, load_dataset, load_rows
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import SFTExample, sft_eval_rows, tokenize_rows

ROWS = [{"prompt": "what is 1 plus 1", "answer": "2"}, {"prompt": "what is 2 plus 2", "answer": "4"}]
SFT_KWARGS = dict(prompt_column="prompt", response_column="response", prompt_format="auto", max_seq_length=64,
                  truncate=False)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def as_list(rows) -> list[dict]:
    return [dict(rows[i]) for i in range(len(rows))]


def test_a_split_one_file_lacks_is_refused_naming_the_split_setting(tmp_path):
    # `--dataset data.jsonl --dataset-split test` trained on the file's rows: a file has no test split
    data = write_rows(tmp_path / "data.jsonl", ROWS)
    with pytest.raises(ValueError) as err:
        load_dataset(GRPOConfig(dataset=data, dataset_split="test"))
    assert str(err.value) == (f"dataset_split: 'test' names a split of an HF dataset or a folder of data files; "
                              f"{data} is one file, read whole: give the file of those rows, or leave dataset_split "
                              "at 'train' (or slice it: 'train[:100]')")
    assert load_dataset(GRPOConfig(dataset=data, dataset_split="train")) == ROWS  # datasets' name for a file's rows


def test_a_file_is_read_whole_under_the_fields_default_split(tmp_path):
    # eval's dataset_split and every eval_dataset_split default to 'test': a file is its rows all the same
    data = write_rows(tmp_path / "data.jsonl", ROWS)
    assert load_dataset(EvalConfig(dataset=data, prompt_format="raw")) == ROWS
    assert eval_rows(GRPOConfig(dataset=data, eval_dataset=data, eval_steps=1)) == ROWS
    with pytest.raises(ValueError, match=r"^eval_dataset_split: 'validation' names a split .* leave "
                                         r"eval_dataset_split at 'test' \(or slice it: 'test\[:100\]'\)$"):
        eval_rows(GRPOConfig(dataset=data, eval_dataset=data, eval_steps=1, eval_dataset_split="validation"))


def test_a_split_a_saved_dataset_lacks_is_refused(tmp_path):
    # Dataset.save_to_disk writes one split; load_from_disk ignored the one named
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(ValueError, match=r"^dataset_split: 'test' names a split .* is a folder save_to_disk wrote, "
                                         "of one split, read whole"):
        load_rows(str(tmp_path / "saved"), "test")


def test_a_saved_dataset_dict_gives_the_split_named(tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                                   "test": datasets.Dataset.from_list(ROWS[1:])})
    splits.save_to_disk(str(tmp_path / "saved"))
    assert as_list(load_rows(str(tmp_path / "saved"), "test")) == ROWS[1:]
    assert as_list(load_rows(str(tmp_path / "saved"))) == ROWS
    with pytest.raises(ValueError, match=r"^dataset_split: no 'validation' split in .*; its splits: \['train', "
                                         r"'test'\] \(pass dataset_split='train'\)$"):
        load_rows(str(tmp_path / "saved"), "validation")


def test_sft_trains_on_every_token_of_trls_text_rows(tmp_path):
    # TRL's language-modelling rows ({"text": ...}, SFTTrainer's dataset_text_field) were refused with "no column
    # 'prompt'"; TRL trains on every token but the first (which no token predicts), EOS appended once
    tokenizer = default_task.build_tokenizer()
    texts = ["417 say c ccc", "12 say a aa" + tokenizer.eos_token]
    examples = tokenize_rows([{"text": t} for t in texts], tokenizer, **SFT_KWARGS)
    for example, text in zip(examples, texts):
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        ids = ids if ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]
        assert example == SFTExample(tuple(ids[:1]), tuple(ids[1:]))
    data = write_rows(tmp_path / "text.jsonl", [{"text": t} for t in texts])
    assert load_dataset(SFTConfig(dataset=data)) == [{"text": t} for t in texts]  # no prompt to check, none needed


@pytest.mark.parametrize("text, problem", [
    (7, "text: expected a string, got int"),
    ("", "text: '' has no tokens to train on"),
])
def test_a_text_row_that_is_no_text_is_refused_naming_the_row(tmp_path, text, problem):
    data = write_rows(tmp_path / "text.jsonl", [{"text": "417 say c ccc"}, {"text": text}])
    with pytest.raises(ValueError) as err:
        tokenize_rows(load_dataset(SFTConfig(dataset=data)), default_task.build_tokenizer(), **SFT_KWARGS)
    assert str(err.value) == f"dataset: row 1: {problem}"


def test_sft_on_text_rows_runs_from_the_command_line(tmp_path):
    data = write_rows(tmp_path / "text.jsonl", [{"text": "417 say c ccc"}, {"text": "12 say a aa"}] * 4)
    assert main(["sft", "--dataset", data, "--output-dir", str(tmp_path / "run"), "--max-steps", "1",
                 "--batch-size", "4", "--micro-batch-size", "2", "--max-seq-length", "32", "--no-export",
                 "--device", "cpu", "--no-progress-bar"]) == 0


def test_a_csv_column_of_numbers_is_its_text_where_it_is_a_prompt_or_a_response(tmp_path):
    # datasets' csv builder reads a column of digits as int: a prompt "0123" was refused ("expected a string ...,
    # got int"), and would have lost its 0; other columns keep the types TRL's users get (an answer 4 stays 4)
    pytest.importorskip("datasets")
    data = tmp_path / "data.csv"
    data.write_text("question,response,answer\n0123,4,4\n17,34,34\n")
    rows = load_dataset(GRPOConfig(dataset=str(data), prompt_column="question", reward_funcs=["length"]))
    assert as_list(rows) == [{"question": "0123", "response": 4, "answer": 4},
                             {"question": "17", "response": 34, "answer": 34}]
    evaluated = eval_rows(GRPOConfig(eval_dataset=str(data), prompt_column="question", eval_steps=1))
    assert evaluated["question"] == ["0123", "17"]
    sft_rows = load_dataset(SFTConfig(dataset=str(data), prompt_column="question"))
    assert as_list(sft_rows) == [{"question": "0123", "response": "4", "answer": 4},
                                 {"question": "17", "response": "34", "answer": 34}]


@pytest.mark.parametrize("suffix, text, where", [
    (".jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2", "prompt": "c"}\n', ":2"),
    (".json", '[{"prompt": "a", "answer": "1"},\n {"prompt": "b", "answer": "2", "prompt": "c"}]', ""),
])
def test_a_row_with_a_key_twice_is_refused(tmp_path, suffix, text, where):
    # JSON keeps the last value of a repeated key: the row's first "prompt" was dropped without a word
    path = tmp_path / f"data{suffix}"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_rows(str(path), field="eval_dataset")
    assert str(err.value) == (f"{path}{where}: the key 'prompt' twice in a row of eval_dataset (JSON keeps the last "
                              "value, losing the other)")


@pytest.mark.parametrize("name, header", [("data.csv", "prompt,answer,prompt"),
                                          ("data.tsv.gz", "prompt\tanswer\tprompt")])
def test_a_table_file_naming_a_column_twice_is_refused(tmp_path, name, header):
    # the csv reader renamed the second 'prompt' 'prompt.1': the run read the first and dropped the other silently
    pytest.importorskip("datasets")
    path = tmp_path / name
    text = f"{header}\nq1{header[6]}1{header[6]}q2\n"
    path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    assert str(err.value) == f"dataset: {path} names the column 'prompt' twice in its header line"


@pytest.mark.parametrize("text", ["prompt,answer\n", ""])
def test_a_table_file_without_rows_is_an_empty_dataset(tmp_path, text):
    # it was "datasets.load_dataset could not read the file ...: ValueError: Instruction "train" corresponds to no
    # data!"
    pytest.importorskip("datasets")
    path = tmp_path / "data.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_rows(str(path))
    assert str(err.value) == f"dataset: expected at least one row, got an empty dataset ({path} has none under its " \
                             "header line)"


TURNS = [{"role": "user", "content": "417 say c"}, {"role": "assistant", "content": "cccc"}]


def test_sft_evaluates_on_the_conversations_its_dataset_takes(tmp_path):
    # sft trains on TRL's messages rows, and its --eval-dataset of the same rows was refused ("no prompt column
    # 'prompt'"): they evaluate on the turns before the assistant's, the prompt sft trains them on
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": TURNS, "answer": "c"},
                                                {"messages": TURNS[:1], "answer": "c"}])
    config = SFTConfig(dataset=data, eval_dataset=data, eval_steps=1, eval_reward_funcs=["length"])
    assert eval_rows(config) == [{"messages": TURNS, "answer": "c", "prompt": TURNS[:1]},
                                 {"messages": TURNS[:1], "answer": "c", "prompt": TURNS[:1]}]
    bad = write_rows(tmp_path / "bad.jsonl", [{"messages": TURNS}, {"messages": TURNS[1:]}])
    with pytest.raises(ValueError) as err:
        eval_rows(SFTConfig(dataset=data, eval_dataset=bad, eval_steps=1))
    assert str(err.value) == ("eval_dataset: row 1: messages: expected turns before the last assistant turn (the "
                              "prompt), got only the assistant's")


@pytest.mark.parametrize("split, picked", [("train[:1]", [0]), ("train[-1:]", [1]), ("train[50%:]", [1]),
                                           ("test[:1]", [0])])
def test_a_slice_of_a_files_split_picks_its_rows(tmp_path, split, picked):
    # datasets' split slices, which a Hub dataset or a folder honours, were ignored for one file: all rows were read
    pytest.importorskip("datasets")
    data = write_rows(tmp_path / "data.jsonl", ROWS)
    assert load_rows(data, split, field="eval_dataset", default_split="test") == [ROWS[i] for i in picked]
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,answer\nwhat is 1 plus 1,2\nwhat is 2 plus 2,4\n")
    assert as_list(load_rows(str(csv), split, field="eval_dataset", default_split="test")) == \
        [{"prompt": ROWS[i]["prompt"], "answer": int(ROWS[i]["answer"])} for i in picked]
    with pytest.raises(ValueError, match=r"^dataset_split: 'validation\[:1\]' names a split of an HF dataset"):
        load_rows(data, "validation[:1]")


def test_text_rows_with_a_prompt_column_are_not_taken_for_plain_text():
    # which column is the response is the user's to say: training on all of `text` would drop the prompt unsaid
    with pytest.raises(ValueError, match=r"^dataset: no column 'response' \(response_column\); columns: \['prompt', "
                                         r"'text'\]$"):
        tokenize_rows([{"prompt": "417 say c", "text": "ccc"}], default_task.build_tokenizer(), **SFT_KWARGS)


def test_a_row_over_max_seq_length_names_the_flag_to_raise(tmp_path, capsys):
    # the line said "raise max_seq_length" beside "--truncate-sequences"
    data = write_rows(tmp_path / "text.jsonl", [{"text": "417 say c " * 20}])
    assert main(["sft", "--dataset", data, "--output-dir", str(tmp_path / "run"), "--max-seq-length", "32",
                 "--device", "cpu", "--no-progress-bar"]) == 2
    assert capsys.readouterr().err.endswith("over max_seq_length (32); raise --max-seq-length or pass "
                                            "--truncate-sequences\n")


def test_sft_takes_sharegpt_conversations_as_trl_does():
    # TRL's maybe_convert_to_chatml: a `conversations` column of {"from", "value"} turns is `messages` of {"role",
    # "content"}; they were refused with "no column 'prompt' (prompt_column); columns: ['conversations']"
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}"
                               "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
    turns = [{"from": "user", "value": "417 say c"}, {"from": "assistant", "value": "cccc"}]
    expected = tokenize_rows([{"messages": TURNS}], tokenizer, **SFT_KWARGS)
    assert tokenize_rows([{"conversations": turns}], tokenizer, **SFT_KWARGS) == expected
    assert sft_eval_rows([{"conversations": turns, "answer": "c"}], "prompt", 0)[0]["prompt"] == TURNS[:1]


def test_a_folder_of_csv_files_reads_its_prompts_as_written(tmp_path):
    # as one CSV file does: the csv builder made a column of digits ints, refused as prompts
    pytest.importorskip("datasets")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.csv").write_text("question,answer\n0123,4\n17,34\n")
    rows = load_rows(str(tmp_path / "data"), text_columns=("question",))
    assert as_list(rows) == [{"question": "0123", "answer": 4}, {"question": "17", "answer": 34}]


@pytest.mark.parametrize("folder", [False, True])
def test_a_csv_prompt_or_response_that_pandas_takes_for_missing_is_read_as_written(tmp_path, folder):
    # pandas' read_csv turned "NA", "None", "null", "nan" and empty cells into missing values before the converters
    # that keep these columns' text ran: a prompt "None" became None ("expected a string, got NoneType"); the
    # other columns keep pandas' missing values, as TRL's users get them (an empty answer is None, "NA" too)
    pytest.importorskip("datasets")
    text = 'question,response,answer,n\nNA,None,NA,1\nnull,nan,"",\nN/A,x,4,3\n'
    if folder:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "part-0.csv").write_text(text)
        data = tmp_path / "data"
    else:
        data = tmp_path / "data.csv"
        data.write_text(text)
    rows = as_list(load_rows(str(data), text_columns=("question", "response")))
    assert [r["question"] for r in rows] == ["NA", "null", "N/A"]
    assert [r["response"] for r in rows] == ["None", "nan", "x"]
    assert [r["answer"] for r in rows] == [None, None, 4]
    assert [r["n"] for r in rows][::2] == [1, 3] and rows[1]["n"] is None
