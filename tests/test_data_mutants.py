"""How a user's rows become what a run trains on, where a mutation audit of the data path found mutants the suite let
through: the GRPO walk over the data (each epoch every row once, in an order of its own, a function of the seed), the
prompt column read, a tokenizer's BOS once (raw prompts, chat prompts, never inside a response), the R1-Zero template,
sft's response column over TRL's completion, the built-in task's rows and held-out eval rows, the warning for
characters the built-in tokenizer drops inside chat messages, JSON lines past a blank line, and a prompt without
tokens refused naming its row.
"""
from __future__ import annotations

import json
import logging

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.eval_config import EvalConfig
from fastgrpo.train.grpo_data import _epoch_order, prompt_token_ids, walk_rows
from fastgrpo.train.loading import eval_rows, load_eval_dataset, load_rows, tokenizer_before_load
from fastgrpo.train.prompts import R1_ZERO_PROMPT, prompt_ids, response_ids
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import collate, tokenize_rows

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "[", "]", "user", "assistant", "system", "what", "is", "two", "plus", "four",
         "be", "brief"]
# Llama-2 style: the template writes the BOS itself, as the tokenizer's call adds one to plain text
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[ {{ m['role'] }} ] {{ m['content'] }} {{ eos_token }} "
                "{% endfor %}{% if add_generation_prompt %}[ assistant ]{% endif %}")
QUESTION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is two plus two"}]
SFT_KWARGS = dict(prompt_column="prompt", response_column="response", max_seq_length=64, truncate=False)


@pytest.fixture(scope="module")
def bos_tokenizer():
    """A word-level tokenizer whose call adds a BOS (as Llama's, Gemma's and Mistral's do) and whose chat template
    writes one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.chat_template = BOS_TEMPLATE
    return tokenizer


def _tokens(tokenizer, ids) -> list[str]:
    return tokenizer.convert_ids_to_tokens(list(ids))


def test_each_epoch_of_the_grpo_walk_takes_every_row_once_in_an_order_of_its_own():
    # 7 rows, 3 a step: steps cross epoch boundaries; 14 steps are 6 epochs
    n, per_step, seed = 7, 3, 5
    walk = [row for step in range(14) for row in walk_rows(n, per_step, step, seed)]
    epochs = [walk[e * n:(e + 1) * n] for e in range(len(walk) // n)]
    for e, rows in enumerate(epochs):
        assert sorted(rows) == list(range(n)), f"epoch {e} took rows {rows}"
    assert len({tuple(rows) for rows in epochs}) > 1, f"every epoch in the order {epochs[0]}"
    assert walk != [row for step in range(14) for row in walk_rows(n, per_step, step, seed + 100)]


def test_the_grpo_walk_is_a_function_of_the_seed_and_step_in_a_fresh_process():
    # what a resumed run (a new process, an empty cache) takes at a step is what the straight run took there
    straight = [walk_rows(10, 4, step, seed=3) for step in range(6)]
    _epoch_order.cache_clear()
    assert [walk_rows(10, 4, step, seed=3) for step in range(6)] == straight
    assert straight[0] == torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()[:4]


def test_grpo_prompts_are_read_from_the_prompt_column():
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a", "question": "22 say b"}, {"prompt": "3 say c", "question": "44 say d"}]
    config = GRPOConfig(prompt_column="question", prompt_format="raw")
    assert prompt_token_ids(rows, tokenizer, config) == [tokenizer(row["question"])["input_ids"] for row in rows]


def test_a_raw_prompt_starts_with_the_tokenizers_bos(bos_tokenizer):
    assert _tokens(bos_tokenizer, prompt_ids(bos_tokenizer, "what is two", "raw")) == ["<s>", "what", "is", "two"]


def test_a_chat_prompt_has_the_templates_bos_once(bos_tokenizer):
    # the template's text tokenized with the tokenizer's specials would start <s> <s>
    assert _tokens(bos_tokenizer, prompt_ids(bos_tokenizer, QUESTION, "chat")) == [
        "<s>", "[", "system", "]", "be", "brief", "</s>", "[", "user", "]", "what", "is", "two", "plus", "two", "</s>",
        "[", "assistant", "]"]


def test_an_sft_response_has_no_bos_and_one_end(bos_tokenizer):
    for prompt, prompt_format in ((QUESTION, "chat"), ("what is two plus two", "raw")):
        assert _tokens(bos_tokenizer, response_ids(bos_tokenizer, prompt, "four", prompt_format)) == ["four", "</s>"]
    examples = tokenize_rows([{"prompt": QUESTION, "response": "four"}], bos_tokenizer, prompt_format="chat",
                             **SFT_KWARGS)
    batch = collate(examples, bos_tokenizer.pad_token_id, "cpu")
    ids, mask = batch["input_ids"][0], batch["response_mask"][0]
    assert _tokens(bos_tokenizer, ids[mask.bool()]) == ["four", "</s>"]
    assert _tokens(bos_tokenizer, ids).count("<s>") == 1


def test_r1_zero_wraps_the_question_in_its_template():
    tokenizer = default_task.build_tokenizer()
    wrapped = tokenizer(R1_ZERO_PROMPT.format(question="12 say a"))["input_ids"]
    assert prompt_ids(tokenizer, "12 say a", "r1_zero") == wrapped
    assert len(wrapped) > len(tokenizer("12 say a")["input_ids"])


def test_sft_reads_the_response_column_where_rows_also_have_a_completion():
    # TRL's completion column stands in only where the rows lack the response column
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "12 say a", "response": "aaaa", "completion": "b"}]
    example, = tokenize_rows(rows, tokenizer, prompt_format="raw", **SFT_KWARGS)
    assert list(example.response_ids) == response_ids(tokenizer, "12 say a", "aaaa", "raw")


def test_each_built_in_row_asks_for_the_letter_its_reward_grades():
    rows = default_task.build_dataset(64, seed=3)
    assert [row["prompt"][-1] for row in rows] == [row["letter"] for row in rows]
    assert len({row["letter"] for row in rows}) == len(default_task.LETTERS)


@pytest.mark.parametrize("config_class", [GRPOConfig, SFTConfig])
def test_the_built_in_tasks_eval_rows_are_drawn_apart_from_its_training_rows(config_class):
    config = config_class(eval_steps=1, eval_max_examples=64)
    evaluated = [row["prompt"] for row in eval_rows(config)]
    trained = {row["prompt"] for row in default_task.build_dataset(seed=config.seed)}
    seen = [prompt for prompt in evaluated if prompt in trained]
    # drawn with another seed alone, ~8 of 64 were training prompts (512 of 4,000 prompts); with the training seed, all
    assert len(evaluated) == 64 and not seen, f"{len(seen)} of {len(evaluated)} eval prompts are training prompts"


def test_characters_the_built_in_tokenizer_drops_are_said_inside_chat_messages(caplog):
    rows = [{"prompt": [{"role": "user", "content": "12 say A!"}]}]
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.default_task"):
        default_task.warn_unknown_characters(rows, GRPOConfig())
    assert [r.getMessage() for r in caplog.records] == [
        "no --model: the built-in tiny model's tokenizer knows only a-z, 0-9, ' ' and ':'; the dataset's 2 other "
        "characters (most often 'A!') are dropped. Pass --model for a real model and its tokenizer."]


def test_an_eval_of_a_checkpoint_is_not_warned_about_the_built_in_tokenizer(caplog):
    # the checkpoint's run names its model, whose tokenizer reads the rows
    with caplog.at_level(logging.WARNING, logger="fastgrpo.train.default_task"):
        default_task.warn_unknown_characters([{"prompt": "12 say A!"}], EvalConfig(checkpoint="run/checkpoint-10"))
    assert caplog.records == []


def test_an_eval_split_of_a_users_dataset_without_eval_dataset_asks_for_eval_dataset(tmp_path):
    # not "the built-in task (no eval_dataset) has none": the run is on the user's rows
    config = GRPOConfig(dataset=str(tmp_path / "rows.jsonl"), eval_steps=1, eval_dataset_split="validation")
    with pytest.raises(ValueError, match="^eval_dataset: eval_steps > 0 on your own dataset needs rows to evaluate"):
        eval_rows(config)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_json_lines_file_whose_text_holds_unicode_line_separators_loads_whole(tmp_path, suffix):
    # written with ensure_ascii=False (as for non-English text), a JSON string holds U+2028, U+2029 and U+0085 as they
    # are; str.splitlines ends a line at each, which refused the file (datasets' json reader loads it)
    rows = [{"prompt": "first line\u2028same row", "answer": "1"}, {"prompt": "a\x85b\u2029c", "answer": "2"},
            {"prompt": "crlf", "answer": "3"}]
    path = tmp_path / f"data{suffix}"
    path.write_bytes("".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows).encode())
    assert load_rows(str(path)) == rows


def test_blank_lines_between_json_lines_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a"}\n\n  \n{"prompt": "b"}\n\n')
    assert load_rows(str(path)) == [{"prompt": "a"}, {"prompt": "b"}]
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"data\.jsonl:4: invalid JSON in dataset "):
        load_rows(str(path))


def test_a_prompt_without_tokens_is_refused_naming_its_row():
    # the built-in tokenizer drops characters it lacks; generation starts from a prompt's last token
    tokenizer = default_task.build_tokenizer()
    rows = [{"prompt": "1 say a"}, {"prompt": "ÉÉ"}]
    with pytest.raises(ValueError, match=r"^dataset: row 1: prompt: 'ÉÉ' has no tokens"):
        prompt_token_ids(rows, tokenizer, GRPOConfig(prompt_format="raw"))


@pytest.mark.parametrize("command", ["train", "sft"])
def test_a_chat_prompt_the_template_renders_without_tokens_is_refused_naming_its_row(command):
    # a template writing only the contents, and an empty question: a GRPO run took the row, then failed at the step
    # that sampled it, after the model had loaded ("prompts[1]: expected a non-empty ... token id list, got []")
    tokenizer = default_task.build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    rows = [{"prompt": [{"role": "user", "content": "1 say a"}], "response": "a"},
            {"prompt": [{"role": "user", "content": ""}], "response": "b"}]
    with pytest.raises(ValueError, match=r"^dataset: row 1: prompt: \[\{'role': 'user', 'content': ''\}\] has no "):
        if command == "train":
            prompt_token_ids(rows, tokenizer, GRPOConfig(prompt_format="chat"))
        else:
            tokenize_rows(rows, tokenizer, prompt_format="chat", **SFT_KWARGS)


def test_only_the_eval_rows_a_run_evaluates_are_checked_before_it_loads(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1 say a", "letter": "a"}\n')
    held_out = tmp_path / "eval.jsonl"  # its third row a null prompt, past the two evaluated
    held_out.write_text('{"prompt": "2 say b", "letter": "b"}\n{"prompt": "3 say c", "letter": "c"}\n'
                        '{"prompt": null, "letter": "d"}\n')
    fields = dict(dataset=str(train), eval_dataset=str(held_out), eval_steps=1, reward_funcs=default_task.REWARD_FUNCS)
    tokenizer = tokenizer_before_load(None)  # the built-in model's
    assert len(load_eval_dataset(GRPOConfig(**fields, eval_max_examples=2), tokenizer)) == 3  # the trainer's rows
    with pytest.raises(ValueError, match=r"^eval_dataset: row 2: prompt: expected a string"):
        load_eval_dataset(GRPOConfig(**fields, eval_max_examples=3), tokenizer)
