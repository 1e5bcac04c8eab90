"""`fastgrpo sft`: the fused SFT loss equals HF's labels loss, micro-batching leaves the gradient alone, prompt /
response tokenization (raw and chat template), length-sorted batches, and the built-in run (loss falls, resume is
exact, the output folder is guarded)."""
import json
import shutil

import pytest
import torch

from fastgrpo.loss.sft import sft_loss
from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.prompts import prompt_ids, response_ids
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import SFTExample, step_micro_batches, tokenize_rows

CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    return default_task.build_tokenizer()


def _batch(tokenizer, left_pad: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (3, 12), generator=g)
    attention = torch.ones_like(ids)
    response = torch.zeros_like(ids)
    response[:, 6:] = 1
    if left_pad:  # row 0: 3 pads on the left
        ids[0, :3], attention[0, :3] = tokenizer.pad_token_id, 0
    else:  # row 0: 3 pads on the right
        ids[0, -3:], attention[0, -3:], response[0, -3:] = tokenizer.pad_token_id, 0, 0
    return ids, attention, response


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("left_pad", [False, True])
def test_sft_loss_is_hf_labels_loss(tokenizer, lora, left_pad):
    model = default_task.build_model(tokenizer, seed=1)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    ids, attention, response = _batch(tokenizer, left_pad)
    labels = torch.where(response.bool(), ids, -100)
    reference = model(input_ids=ids, attention_mask=attention, labels=labels).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    loss, metrics = sft_loss(model, ids, attention, response)
    loss.backward()
    assert metrics["response_tokens"] == response.sum()
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


def test_micro_batches_sum_to_the_step_mean(tokenizer):
    # normalised by the step's response tokens, two micro-batches give the gradient of the whole batch
    model = default_task.build_model(tokenizer, seed=1)
    ids, attention, response = _batch(tokenizer, left_pad=False)
    loss, _ = sft_loss(model, ids, attention, response)
    loss.backward()
    whole = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()
    total = int(response.sum())
    for rows in (slice(0, 1), slice(1, 3)):
        part, _ = sft_loss(model, ids[rows], attention[rows], response[rows], num_items_in_batch=total)
        part.backward()
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, whole, rtol=1e-5, atol=1e-7)


def test_sft_loss_rejects_bad_masks(tokenizer):
    model = default_task.build_model(tokenizer)
    ids, attention, response = _batch(tokenizer, left_pad=False)
    bad = response.clone()
    bad[:, 0] = 1
    with pytest.raises(ValueError, match="response_mask: column 0"):
        sft_loss(model, ids, attention, bad)
    with pytest.raises(ValueError, match="response_mask: is 1 where attention_mask is 0"):
        sft_loss(model, ids, attention, torch.where(attention.bool(), response, 1))
    with pytest.raises(ValueError, match="num_items_in_batch"):
        sft_loss(model, ids, attention, response, num_items_in_batch=0)


def test_prompt_and_response_ids(tokenizer):
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    # raw: the prompt's text, the response's text and EOS
    assert prompt_ids(tokenizer, "12 say a", "raw") == encode("12 say a")
    assert response_ids(tokenizer, "12 say a", "aa", "auto") == encode("aa") + [eos]
    with pytest.raises(ValueError, match="prompt_format: 'chat' needs a tokenizer with a chat template"):
        prompt_ids(tokenizer, "12 say a", "chat")
    # chat template: the generation prompt, then the assistant turn with its end-of-turn token
    chat = default_task.build_tokenizer()
    chat.chat_template = CHAT_TEMPLATE
    assert prompt_ids(chat, "12 say a", "auto") == encode("u:12 say a") + [eos] + encode("a:")
    assert response_ids(chat, "12 say a", "aa", "auto") == encode("aa") + [eos]
    assert prompt_ids(chat, "12 say a", "raw") == encode("12 say a")  # raw text skips the template


def test_tokenize_rows_checks(tokenizer):
    rows = default_task.build_sft_dataset(num_rows=4)
    kwargs = dict(prompt_column="prompt", response_column="response", prompt_format="raw", max_seq_length=16,
                  truncate=False)
    examples = tokenize_rows(rows, tokenizer, **kwargs)
    assert [len(e.response_ids) for e in examples] == [default_task.SFT_REPEATS + 1] * 4
    with pytest.raises(ValueError, match="^dataset: no column 'answer' \\(response_column\\)"):
        tokenize_rows(rows, tokenizer, **{**kwargs, "response_column": "answer"})
    with pytest.raises(ValueError, match="row 0 has 14 tokens, over max_seq_length \\(12\\)"):
        tokenize_rows(rows, tokenizer, **{**kwargs, "max_seq_length": 12})
    cut = tokenize_rows(rows, tokenizer, **{**kwargs, "max_seq_length": 12, "truncate": True})
    assert all(len(e) == 12 for e in cut)
    with pytest.raises(ValueError, match="row 0 has no response tokens"):
        tokenize_rows(rows, tokenizer, **{**kwargs, "max_seq_length": 9, "truncate": True})
    with pytest.raises(ValueError, match="prompt: expected a string or a list of chat messages .*, got int"):
        tokenize_rows([{"prompt": 5, "response": "b"}], tokenizer, **{**kwargs, "prompt_format": "auto"})
    # a list's (a JSONL file's) rows may differ: a row without the response is named, not a KeyError
    with pytest.raises(ValueError, match=r"row 1 has no column 'response'; row 0 has \['prompt', 'response'\]"):
        tokenize_rows([{"prompt": "a", "response": "b"}, {"prompt": "c"}], tokenizer, **kwargs)


def test_step_micro_batches_sorted_and_a_function_of_the_step():
    lengths = [5, 9, 2, 7, 7, 3, 8, 1, 4, 6]
    steps = [step_micro_batches(lengths, s, batch_size=4, micro_batch_size=2, seed=3) for s in range(6)]
    epoch = [i for step in steps[:3] for micro in step for i in micro]
    assert sorted(epoch) == list(range(10))  # 3 steps (4 + 4 + 2 rows) cover the epoch once
    for step in steps:
        order = [lengths[i] for micro in step for i in micro]
        assert order == sorted(order, reverse=True)
    assert steps[3] != steps[0] and step_micro_batches(lengths, 4, batch_size=4, micro_batch_size=2, seed=3) == steps[4]


@pytest.fixture(scope="module")
def builtin_run(tmp_path_factory):
    """The built-in `fastgrpo sft`, shortened to 20 steps and saving at step 10; evaluated at steps 10 and 20."""
    out = tmp_path_factory.mktemp("sft")
    argv = ["sft", "--output-dir", str(out), "--max-steps", "20", "--save-steps", "10", "--save-total-limit",
            "none", "--eval-steps", "10", "--eval-max-examples", "16", "--no-progress-bar", "--logging-steps", "0"]
    assert main(argv) == 0
    return out, argv


def test_builtin_sft_loss_falls_and_evaluates(builtin_run):
    out, _ = builtin_run
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics]
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0], losses
    assert all(m["padding_frac"] == 0.0 for m in metrics)  # the built-in rows have one length
    assert (out / "final" / "config.json").exists() and (out / "checkpoint-10").is_dir()
    summary = json.loads((out / "eval" / "step-20_summary.json").read_text())
    assert summary["num_examples"] == 16 and metrics[-1]["eval/accuracy"] == summary["accuracy"]
    assert summary["reward"] > json.loads((out / "eval" / "step-10_summary.json").read_text())["reward"]


def test_resume_is_exact_and_the_output_folder_is_guarded(builtin_run, tmp_path, capsys):
    out, argv = builtin_run
    straight = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the folder holds a run: a fresh one is refused with one line, exit 2
    assert main(argv) == 2
    assert "holds another run" in capsys.readouterr().err
    # a fresh run of another command names the folder's command, not a --resume that would be refused
    assert main(["train", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a `fastgrpo sft` run (checkpoint-" in err and "`fastgrpo sft --resume`" in err, err
    # another command cannot continue it, whatever --resume-allow-changes says
    assert main(["train", "--output-dir", str(out), "--resume", "--resume-allow-changes"]) == 2
    err = capsys.readouterr().err
    assert "is a `fastgrpo sft` run, not a `fastgrpo train` run" in err and len(err.strip().splitlines()) == 1, err
    # a run of 10 steps, then resumed to 20: the same losses as the straight 20
    short = ["sft", "--output-dir", str(tmp_path), "--max-steps", "10", "--no-progress-bar", "--no-export",
             "--logging-steps", "0"]
    assert main(short) == 0
    assert main([*short[:4], "20", *short[5:], "--resume"]) == 0
    resumed = [json.loads(line)["loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert resumed == straight


def test_user_rows_with_lora_and_patch(tmp_path, tokenizer):
    rows = [{"question": f"{i} say b", "answer": "bbb"} for i in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "o"
    assert main(["sft", "--dataset", str(data), "--prompt-column", "question", "--response-column", "answer",
                 "--lora-rank", "4", "--patch", "--batch-size", "4", "--micro-batch-size", "2", "--num-epochs", "2",
                 "--output-dir", str(out), "--no-progress-bar", "--logging-steps", "0"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rows"] for m in metrics] == [4, 2, 4, 2] and metrics[0]["response_tokens"] == 16
    assert (out / "checkpoint-4" / "adapter_model.safetensors").exists()
    # kept SFTExamples (expert iteration's input) train without re-tokenization
    model = default_task.build_model(tokenizer)
    trainer = SFTTrainer(model, tokenizer, [SFTExample((5, 6), (7, 1))], SFTConfig(batch_size=1, micro_batch_size=1,
                                                                                   max_seq_length=8))
    assert trainer.train_step()["response_tokens"] == 2


def test_a_finished_run_resumed_keeps_its_export(tmp_path):
    """--resume of a finished run trains nothing and leaves final/ as it is: it re-exported the same weights,
    deleting what the user had put there (an eval's --output-dir, notes)."""
    argv = ["sft", "--output-dir", str(tmp_path), "--max-steps", "1", "--no-progress-bar", "--logging-steps", "0"]
    assert main(argv) == 0
    (tmp_path / "final" / "notes.txt").write_text("mine")
    assert main([*argv, "--resume"]) == 0
    assert (tmp_path / "final" / "notes.txt").read_text() == "mine"
    shutil.rmtree(tmp_path / "final")  # stopped before its export: the resume exports, training nothing
    assert main([*argv, "--resume"]) == 0
    assert (tmp_path / "final" / "config.json").is_file()


def test_a_finished_run_resumed_says_so_before_loading_the_model(tmp_path, capsys):
    """--resume of a finished run prints that there is nothing to train without loading the model, as `fastgrpo
    train` does: here the model folder lost its weights after the run, and the command still says its line and exits
    0 (it loaded the model first, and failed on this folder)."""
    tokenizer = default_task.build_tokenizer()
    model = tmp_path / "model"
    default_task.build_model(tokenizer).save_pretrained(model)
    tokenizer.save_pretrained(model)
    out = tmp_path / "run"
    argv = ["sft", "--model", str(model), "--output-dir", str(out), "--max-seq-length", "16", "--batch-size", "256",
            "--micro-batch-size", "64", "--num-epochs", "1", "--no-progress-bar", "--logging-steps", "0"]
    assert main(argv) == 0
    capsys.readouterr()
    (model / "model.safetensors").unlink()
    assert main([*argv, "--resume"]) == 0
    assert capsys.readouterr().out == (
        f"fastgrpo sft: nothing to train: the run in {out} is at step 2 (checkpoint-2) of 2 (--num-epochs 1), "
        f"exported to {out / 'final'}; pass a larger --num-epochs to train on\n")


def test_the_command_tokenizes_each_row_once(tmp_path, monkeypatch, capsys):
    """`fastgrpo sft` tokenized every row twice: in its check before the model loads, and again in SFTTrainer. Now the
    trainer takes the checked examples: one response tokenization per row, and the truncation warning said once."""
    import fastgrpo.train.sft_data as sft_data

    calls = []
    monkeypatch.setattr(sft_data, "response_ids", lambda *a, **k: calls.append(1) or response_ids(*a, **k))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i} say a", "response": "a" * (3 + 9 * (i == 0))}) + "\n"
                            for i in range(8)))
    argv = ["sft", "--dataset", str(rows), "--prompt-format", "raw", "--max-seq-length", "12", "--truncate-sequences",
            "--output-dir", str(tmp_path / "out"), "--max-steps", "1", "--batch-size", "8", "--micro-batch-size", "8",
            "--no-progress-bar", "--logging-steps", "0", "--no-export"]
    assert main(argv) == 0
    assert len(calls) == 8
    err = capsys.readouterr().err
    assert err.count("1 of 8 rows over max_seq_length (12) lost their response's end") == 1, err


def test_examples_given_to_the_trainer_are_checked(tokenizer):
    rows = [{"prompt": "1 say a", "response": "aaa"}] * 4
    config = SFTConfig(prompt_format="raw", max_seq_length=12, batch_size=4, micro_batch_size=4)
    model = default_task.build_model(tokenizer)
    with pytest.raises(ValueError, match=r"^examples: expected the tokens of each of the dataset's 4 rows, got 3$"):
        SFTTrainer(model, tokenizer, rows, config, examples=[SFTExample((1,), (2,))] * 3)
    with pytest.raises(ValueError, match=r"^examples: an example has 13 tokens, over max_seq_length \(12\)$"):
        SFTTrainer(model, tokenizer, rows, config, examples=[SFTExample((1,) * 3, (2,) * 10)] * 4)
