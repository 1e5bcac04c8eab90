"""Which completions an expert-iteration round fine-tunes on: the correct ones, each distinct completion of a question
once (a repeat would weight the questions the model is already sure of), with the repeats counted in the metrics;
the SFT examples are the prompt ids and the sampled ids, masked as `fastgrpo sft` masks its rows."""
from __future__ import annotations

import torch

from fastgrpo.train import default_task
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.expert_iteration import ExpertIteration, distinct_correct
from fastgrpo.train.sft_data import SFTExample, collate


def _all_correct(prompts, completions, **columns):
    return [1.0] * len(completions)


def test_a_question_s_repeated_completion_is_kept_once(tmp_path):
    # greedy sampling: a question's 4 samples are one completion, which the round fine-tuned on 4 times
    tokenizer = default_task.build_tokenizer()
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 4, "temperature": 0.0, "batch_size": 4, "micro_batch_size": 4,
                         "sft_epochs": 1, "output_dir": str(tmp_path)})
    run = ExpertIteration(default_task.build_model(tokenizer), tokenizer, _all_correct,
                          default_task.build_dataset(num_rows=8), config)
    metrics = run.run_round()
    assert metrics["kept"] == 4 and metrics["kept_repeats_dropped"] == 12 and metrics["kept_frac"] == 4 / 16
    questions = run._questions(0)
    assert [list(e.prompt_ids) for e in run.last_kept] == [run.prompts[i] for i in questions]


def test_distinct_correct_keeps_each_question_s_distinct_correct_completions():
    prompts = [[5, 6], [7]]
    completions = [[1, 2], [1, 2], [3], [],  # question 0: a repeat, an incorrect one, an empty one
                   [1, 2], [4, 1], [4, 1], [2]]  # question 1: [1, 2] too (another question's), a repeat
    correct = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    kept, repeats = distinct_correct(prompts, completions, correct, num_generations=4)
    assert kept == [SFTExample((5, 6), (1, 2)), SFTExample((7,), (1, 2)), SFTExample((7,), (4, 1))]
    assert repeats == 2
    batch = collate(kept, pad_id=0, device="cpu")  # sft's masking: the sampled ids are the labels, not the prompt
    assert batch["response_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 1, 0], [0, 1, 1, 0]]
