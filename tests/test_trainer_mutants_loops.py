"""The step logic of `sft`, `ei` and `eval` outside the loss, where a mutation audit found mutants the suite let
through: SFT's gradient clipping by the global norm and its logged learning rate, an ei round's questions, solved
fraction and SFT steps, and a reward at correct_threshold counting as correct in an evaluation. On the built-in task's
tiny model, fp32.
"""
from __future__ import annotations

import pytest
import torch

from fastgrpo.rollout import BuiltinEngine, SamplingParams
from fastgrpo.train import default_task
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.evaluate import build_eval_task, evaluate
from fastgrpo.train.expert_iteration import ExpertIteration
from fastgrpo.train.grpo_data import walk_rows
from fastgrpo.train.optim import lr_factor
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_config import SFTConfig
from fastgrpo.train.sft_data import collate

ROWS = [{"prompt": p, "response": r} for p, r in
        [("1 say a", "a"), ("22 say b", "bbbbbbbbbbbb"), ("333 say c", "ccc"), ("4 say d", "dddddddddddddddd")]]


def test_sft_clips_the_step_s_gradient_by_its_global_norm(tmp_path):
    """learning_rate 0 leaves the step's gradient in .grad: HF's labels-loss gradient of the 4 rows (one padded
    batch; micro-batches of 2 here) scaled by max_grad_norm / (norm + 1e-6), clip_grad_norm_'s factor, with the
    logged grad_norm the norm before clipping. No clipping, or clipping each value, leaves another gradient."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=3)
    max_norm = 1e-3
    config = SFTConfig(prompt_format="raw", max_seq_length=48, batch_size=4, micro_batch_size=2, learning_rate=0.0,
                       max_grad_norm=max_norm, output_dir=str(tmp_path), max_steps=1)
    trainer = SFTTrainer(model, tokenizer, ROWS, config)
    batch = collate(trainer.examples, tokenizer.pad_token_id, "cpu")
    labels = torch.where(batch["response_mask"].bool(), batch["input_ids"], -100)
    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected.values()])).item()
    assert norm > 100 * max_norm  # clipping is active
    metrics = trainer.train_step()
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-4)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name] * (max_norm / (norm + 1e-6)), rtol=1e-4,
                                   atol=1e-7 * max_norm, msg=lambda m: f"{name}: {m}")


def test_a_reward_at_the_threshold_counts_as_correct():
    """evaluate's documented rule: correct when the reward is >= correct_threshold (as ei keeps a completion): a
    reward of exactly 1.0 at the default threshold 1.0 is correct, one just below it is not."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    rows = default_task.build_dataset(2)

    def at_or_below(prompts, completions, **kwargs):  # row 0's samples reach 1.0, row 1's miss it by one ulp
        return [1.0 if p == rows[0]["prompt"] else 1.0 - 2**-52 for p in prompts]

    task = build_eval_task(rows, tokenizer, prompt_column="prompt", prompt_format="raw", reward_funcs=[at_or_below])
    records, summary = evaluate(BuiltinEngine(model, tokenizer), tokenizer, task, SamplingParams(max_new_tokens=2),
                                num_generations=2)
    assert [(r["index"], r["correct"]) for r in records] == [(0, True), (0, True), (1, False), (1, False)]
    assert summary["accuracy"] == 0.5 and summary["pass@2"] == 0.5


def test_sft_logs_the_learning_rate_each_step_updated_with(tmp_path):
    """Warm-up over 2 updates, then linear decay over a 4-step run: each step's "lr" is lr_factor of its own update
    (0-based), as GRPOTrainer logs it; the scheduler's value after the step is the next update's."""
    tokenizer = default_task.build_tokenizer()
    config = SFTConfig(prompt_format="raw", max_seq_length=48, batch_size=2, micro_batch_size=2, learning_rate=1e-2,
                       warmup_steps=2, lr_scheduler="linear", output_dir=str(tmp_path), max_steps=4)
    trainer = SFTTrainer(default_task.build_model(tokenizer), tokenizer, ROWS, config)
    logged = [trainer.train_step()["lr"] for _ in range(4)]
    assert logged == pytest.approx([1e-2 * lr_factor(u, total=4, warmup=2, kind="linear") for u in range(4)],
                                   rel=1e-12)
    assert logged[:2] == pytest.approx([0.5e-2, 1e-2])


def test_an_ei_round_s_questions_solved_kept_and_sft_steps(tmp_path):
    """Two rounds of 4 questions x 2 samples, a reward marking the first sample of the round's first two questions
    correct: each round samples its own questions (walk_rows of its index), half of them are solved (any sample
    correct), 2 of 8 samples are kept, and its SFT runs sft_epochs (2) passes over them in batches of 2: 2 steps."""
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer)
    dataset = default_task.build_dataset(num_rows=8)
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 2, "micro_batch_size": 2, "sft_epochs": 2,
                         "ei_steps": 2, "output_dir": str(tmp_path)})
    seen = []

    def first_two(prompts, completions, **columns):
        seen.append(prompts)
        return [float(k in (0, 2)) for k in range(len(completions))]

    run = ExpertIteration(model, tokenizer, first_two, dataset, config)
    for round_index in range(2):
        metrics = run.run_round()
        expected = [dataset[i]["prompt"] for i in walk_rows(8, 4, round_index, config.seed) for _ in range(2)]
        assert seen[-1] == expected, round_index
        assert metrics["questions_solved_frac"] == 0.5 and metrics["kept"] == 2 and metrics["kept_frac"] == 2 / 8
        assert metrics["sft_steps"] == 2
    assert set(seen[0]) != set(seen[1])
