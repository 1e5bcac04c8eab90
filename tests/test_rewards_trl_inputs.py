"""A reward function written for TRL's GRPOTrainer gets, in fastgrpo's own GRPOTrainer, what TRL passes it on the same
dataset: for a conversational dataset (prompts as chat messages) the prompts as message lists and each completion
as [{"role": "assistant", "content": text}], for a standard one both as text; every other column as a keyword holding
one value per completion; completion_ids (each completion's token ids) and trainer_state (transformers'
TrainerState), and TRL's logging hooks log_metric / log_extra. Both trainers run one step on the same tiny Qwen2
model, the reward recording what it received."""
from __future__ import annotations

import os
import string

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[dev]' installs it)")
datasets = pytest.importorskip("datasets", reason="TRL's GRPOTrainer needs `datasets`")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from tokenizers import Tokenizer, models  # noqa: E402
from transformers import (AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM,  # noqa: E402
                          TrainerState)

from fastgrpo.train.config import GRPOConfig  # noqa: E402
from fastgrpo.train.trainer import GRPOTrainer  # noqa: E402

# The messages joined by ';' (the tokenizer has no newline)
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }};{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
QUESTIONS = ["2+2=", "hi ", "abc", "cat "]
SOLUTIONS = ["4", "hello", "d", "dog"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    chars = ["<pad>", "</s>", "<unk>"] + list(string.ascii_lowercase + string.digits + " .,!?+-=*/:;()'")
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token="<unk>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def dataset(conversational: bool):
    prompts = [[{"role": "user", "content": q}] if conversational else q for q in QUESTIONS]
    return datasets.Dataset.from_dict({"prompt": prompts, "solution": SOLUTIONS})


def shape(value):
    """The shape of an argument, for comparing what two trainers passed: types, nesting, dict keys."""
    if isinstance(value, list):
        return ["list", shape(value[0]) if value else None]
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    return type(value).__name__


class Spy:
    """A TRL-style reward that records each call's arguments, reads a chat completion as TRL's docs do, and logs the
    share it scored 1 with log_metric (and the solutions with log_extra) when given them."""

    __name__ = "spy"

    def __init__(self):
        self.calls = []

    def __call__(self, prompts, completions, completion_ids, solution, **kwargs):
        self.calls.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids,
                               solution=solution, **kwargs))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        rewards = [float(s in t) for t, s in zip(texts, solution)]
        if "log_metric" in kwargs:
            kwargs["log_metric"]("spy/solved", sum(rewards) / len(rewards))
            kwargs["log_extra"]("solution", solution)
        return rewards


def run_trl(model_dir, tmp_path, rows) -> tuple[dict, list[dict]]:
    spy = Spy()
    args = trl.GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=2,
                          max_completion_length=6, max_steps=1, learning_rate=1e-3, report_to=[],
                          save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, bf16=False, fp16=False,
                          gradient_checkpointing=False, use_cpu=True, seed=0, logging_steps=1)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=spy, args=args, train_dataset=rows,
                              processing_class=build_tokenizer())
    trainer.train()
    return spy.calls[0], trainer.state.log_history


def run_fastgrpo(model_dir, tmp_path, rows) -> tuple[dict, GRPOTrainer]:
    spy = Spy()
    config = GRPOConfig(batch_size=8, num_generations=2, micro_batch_size=8, max_prompt_length=32,
                        max_completion_length=6, max_steps=1, learning_rate=1e-3, dtype="float32", device="cpu",
                        patch=False, export=False, progress_bar=False, logging_steps=0,
                        output_dir=str(tmp_path / "fastgrpo"))
    trainer = GRPOTrainer(Qwen2ForCausalLM.from_pretrained(model_dir), build_tokenizer(), spy, rows, config)
    trainer.train()
    return spy.calls[0], trainer


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "standard"])
def test_a_trl_reward_gets_what_trl_passes(model_dir, tmp_path, conversational):
    rows = dataset(conversational)
    theirs, their_logs = run_trl(model_dir, tmp_path, rows)
    ours, trainer = run_fastgrpo(model_dir, tmp_path, rows)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    assert {key: shape(value) for key, value in ours.items()} == {key: shape(value) for key, value in theirs.items()}
    # log_metric's value is logged under its name by both, the step's mean (the completions differ: not the value)
    assert 0 <= their_logs[0]["spy/solved"] <= 1 and 0 <= trainer.history[0]["spy/solved"] <= 1
    if conversational:
        assert ours["completions"][0][0]["role"] == "assistant"
        assert ours["prompts"][0] == [{"role": "user", "content": ours["prompts"][0][0]["content"]}]
    # every column is one value per completion, completions grouped by prompt (num_generations 2)
    n = len(ours["completions"])
    assert all(len(ours[key]) == n for key in ("prompts", "solution", "completion_ids"))
    assert ours["solution"][0] == ours["solution"][1]
    # completion_ids are the tokens of the text: decoded, they give the completion
    tokenizer = build_tokenizer()
    for completion, ids in zip(ours["completions"], ours["completion_ids"]):
        text = completion[0]["content"] if conversational else completion
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    state = ours["trainer_state"]
    assert isinstance(state, TrainerState) and state.global_step == 0 and state.max_steps == 1
    assert trainer.history[0]["reward_errors"] == 0


def check_received(call: dict, conversational: bool, global_step: int, max_steps: int) -> None:
    """What Spy got is what TRL passes (test above): completions in the dataset's form, with their token ids."""
    assert set(call) == {"prompts", "completions", "completion_ids", "solution", "trainer_state", "log_extra",
                         "log_metric"}
    tokenizer = build_tokenizer()
    for prompt, completion, ids in zip(call["prompts"], call["completions"], call["completion_ids"]):
        assert isinstance(prompt, list if conversational else str)
        if conversational:
            assert [m["role"] for m in completion] == ["assistant"]
            completion = completion[0]["content"]
        assert isinstance(completion, str) and tokenizer.decode(ids, skip_special_tokens=True) == completion
    state = call["trainer_state"]
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (global_step, max_steps)


@pytest.mark.parametrize("conversational", [True, False], ids=["conversational", "standard"])
def test_ei_and_eval_pass_what_train_passes(model_dir, tmp_path, conversational):
    """`ei` and `eval` (its periodic evaluations too) score completions as `train` does: the same arguments."""
    from fastgrpo.rollout import BuiltinEngine, SamplingParams
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.evaluate import build_eval_task, evaluate
    from fastgrpo.train.expert_iteration import ExpertIteration
    from fastgrpo.train.periodic_eval import PeriodicEval

    rows, tokenizer, spy = dataset(conversational), build_tokenizer(), Spy()
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    config = EIConfig(ei_steps=1, questions_per_step=4, num_generations=2, batch_size=4, micro_batch_size=4,
                      max_prompt_length=32, max_completion_length=6, sft_epochs=1, dtype="float32", device="cpu",
                      patch=False, export=False, progress_bar=False, logging_steps=0, prompt_format="raw",
                      correct_threshold=0.0, output_dir=str(tmp_path / "ei"))
    ExpertIteration(model, tokenizer, spy, rows, config).train()
    check_received(spy.calls[0], conversational, global_step=0, max_steps=1)

    task = build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw", reward_funcs=[spy])
    engine, sampling = BuiltinEngine(model, tokenizer), SamplingParams(max_new_tokens=6)
    evaluate(engine, tokenizer, task, sampling, num_generations=2)
    check_received(spy.calls[-1], conversational, global_step=0, max_steps=0)  # `fastgrpo eval`: no run around it
    PeriodicEval(model, engine, tokenizer, task, sampling, every=1, output_dir=tmp_path / "run", max_steps=5)(3)
    check_received(spy.calls[-1], conversational, global_step=3, max_steps=5)  # eval_steps: the run's progress


REWARD_FILE = '''import json


def trl_reward(prompts, completions, completion_ids, solution, trainer_state, **kwargs):
    """Written for TRL: reads a chat completion's content; records what it got."""
    with open({out!r}, "a") as f:
        f.write(json.dumps(dict(prompt=prompts[0], completion=completions[0], ids=completion_ids[0],
                                step=trainer_state.global_step, max_steps=trainer_state.max_steps)) + "\\n")
    return [float(s in c[0]["content"]) for c, s in zip(completions, solution)]
'''


def test_a_trl_reward_file_trains_from_the_cli(model_dir, tmp_path, monkeypatch):
    """`fastgrpo train --reward-funcs my_rewards.py:trl_reward` on a JSONL file of chat prompts."""
    import json

    from fastgrpo.train.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "seen.jsonl"
    (tmp_path / "my_rewards.py").write_text(REWARD_FILE.format(out=str(out)))
    rows = [{"prompt": [{"role": "user", "content": q}], "solution": s} for q, s in zip(QUESTIONS, SOLUTIONS)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["train", "--model", model_dir, "--dataset", "data.jsonl", "--reward-funcs", "my_rewards.py:trl_reward",
                 "--max-steps", "2", "--batch-size", "4", "--num-generations", "2", "--micro-batch-size", "4",
                 "--max-prompt-length", "32", "--max-completion-length", "6", "--dtype", "float32", "--device", "cpu",
                 "--no-progress-bar", "--output-dir", "run"]) == 0
    seen = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(s["step"], s["max_steps"]) for s in seen] == [(0, 2), (1, 2)]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)  # as the command loads it
    for s in seen:
        assert s["prompt"][0]["role"] == "user" and [m["role"] for m in s["completion"]] == ["assistant"]
        assert tokenizer.decode(s["ids"], skip_special_tokens=True) == s["completion"][0]["content"]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["reward_errors"] for m in metrics] == [0, 0]
