"""`torchrun --nproc_per_node 2 -m fastgrpo eval` (2 gloo processes, forked, each running fastgrpo.train.cli.main):
each process generates and scores every 2nd row, and rank 0 gathers them and writes results.jsonl and summary.json,
the files one process writes (the timings and date aside). Before, rank 0 evaluated every row alone and the others
stopped after the input checks. Also: periodic evaluation under `ei` logs its rounds as rounds."""
import json
import logging

from fastgrpo.train import default_task
from tests.forked_gloo import cli, run_forked

# 5 rows on 2 processes: shares of 3 and 2 rows, 2 a batch, so the batches differ from one process's
EVAL = ["eval", "--max-examples", "5", "--num-generations", "3", "--max-new-tokens", "6", "--batch-size", "2",
        "--temperature", "1.0"]
TIMINGS = ("seconds", "tokens_per_s", "date")  # what differs in the summary from one evaluation to the next

REWARDS = '''import os

import torch.distributed as dist

from fastgrpo.train.default_task import repeat_letter_reward


def scored_where(prompts, completions, **kwargs):
    """The built-in reward, noting which process scored which prompts."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(os.path.dirname(__file__), f"scored-{rank}.txt"), "a") as log:
        log.writelines(f"{prompt!r}\\n" for prompt in prompts)
    return repeat_letter_reward(prompts, completions, **kwargs)


def fails_on_rank_1(prompts, completions, **kwargs):
    if dist.get_rank() == 1:
        raise RuntimeError("no score here")
    return repeat_letter_reward(prompts, completions, **kwargs)
'''


def _summary(folder) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    summary["config"].pop("output_dir")
    return {k: v for k, v in summary.items() if k not in TIMINGS}


def test_eval_splits_the_rows_across_processes_and_writes_one_process_results(tmp_path):
    from fastgrpo.train.cli import main

    (tmp_path / "rewards.py").write_text(REWARDS)
    rewards = ["--reward-funcs", f"{tmp_path / 'rewards.py'}:scored_where"]
    runs = [[*EVAL, *rewards, "--output-dir", str(tmp_path / "out" / "two")],
            *([*EVAL, "--reward-funcs", f"{tmp_path / 'rewards.py'}:fails_on_rank_1", "--output-dir",
               str(tmp_path / "out" / name), *flags] for name, flags in (("failed", []),
                                                                         ("skipped", ["--reward-errors", "skip"])))]
    found = run_forked(cli, tmp_path, runs, deadline_s=120, group_timeout_s=60)
    assert [rank["exits"] for rank in found] == [[0, 1, 0], [0, 1, 0]], found[0]["stderr"][-2000:]
    # skipped: the summary's message of the failure says whose rows it counts, and rank 0 alone warns of it, once
    failures = json.loads((tmp_path / "out" / "skipped" / "summary.json").read_text())["reward_errors"]
    assert list(failures) == ["fails_on_rank_1"] and failures["fails_on_rank_1"].endswith(" (in process 1's rows)")
    warned = "reward function fails_on_rank_1 failed; its failed samples score 0: "
    assert [rank["stderr"].count(warned) for rank in found] == [1, 0], found[1]["stderr"]
    assert failures["fails_on_rank_1"] in found[0]["stderr"]
    assert found[1]["stdout"] == "" and found[1]["writes"] == [] and "error" not in found[1]["stderr"]
    assert "over 15 completions" in found[0]["stdout"]
    # a failure on rank 1 alone: one line, by rank 0
    errors = [line for line in found[0]["stderr"].splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("fastgrpo eval: error: (on process 1) reward function "
                                                     "fails_on_rank_1 raised RuntimeError"), errors
    # rank r scored the rows r, r + 2, ...: each prompt once per completion
    prompts = [row["prompt"] for row in default_task.build_held_out_dataset(num_rows=5, seed=0)]
    scored = [(tmp_path / f"scored-{rank}.txt").read_text().splitlines() for rank in range(2)]
    assert scored == [[repr(p) for p in prompts[rank::2] for _ in range(3)] for rank in range(2)]

    (tmp_path / "scored-0.txt").unlink()
    assert main([*EVAL, *rewards, "--output-dir", str(tmp_path / "out" / "one")]) == 0
    two, one = tmp_path / "out" / "two", tmp_path / "out" / "one"
    assert (two / "results.jsonl").read_text() == (one / "results.jsonl").read_text()
    assert _summary(two) == _summary(one)
    completions = [json.loads(line)["completion"] for line in (one / "results.jsonl").read_text().splitlines()]
    assert len(set(completions)) > 5  # sampled: the rows' completions differ (the comparison is not of constants)


def test_ei_periodic_eval_logs_rounds(tmp_path, caplog):
    """`ei` evaluates every --eval-steps rounds: its log said 'eval step <N>'."""
    from fastgrpo.train.ei_config import EIConfig
    from fastgrpo.train.expert_iteration import ExpertIteration

    tokenizer = default_task.build_tokenizer()
    config = EIConfig(**{**default_task.EI_PRESET, "prompt_format": "raw", "questions_per_step": 4,
                         "num_generations": 2, "batch_size": 4, "micro_batch_size": 4, "output_dir": str(tmp_path),
                         "eval_steps": 1, "eval_max_examples": 2})
    run = ExpertIteration(default_task.build_model(tokenizer), tokenizer, default_task.repeat_letter_reward,
                          default_task.build_dataset(num_rows=8), config)
    with caplog.at_level(logging.INFO, logger="fastgrpo"):
        assert run.evaluator(3, force=True)["eval/num_examples"] == 2
    assert "eval round 3 |" in caplog.text and "eval step" not in caplog.text


def test_fewer_eval_rows_than_processes_under_fsdp2(tmp_path):
    """`fastgrpo sft` fully fine-tuned (FSDP2) on 2 processes, evaluating 1 row each step: rank 1, left without a row,
    evaluates row 0 and drops it. With no forward of its own its next backward's collectives no longer paired with
    rank 0's, and the run hung until the group's timeout."""
    argv = ["sft", "--output-dir", str(tmp_path / "out" / "run"), "--max-steps", "2", "--eval-steps", "1",
            "--eval-max-examples", "1", "--lora-rank", "0", "--batch-size", "8", "--micro-batch-size", "4",
            "--no-progress-bar", "--no-export"]
    found = run_forked(cli, tmp_path, [argv], deadline_s=120, group_timeout_s=30)
    assert [rank["exits"] for rank in found] == [[0], [0]], found[0]["stderr"][-2000:]
    for step in (1, 2):
        results = (tmp_path / "out" / "run" / "eval" / f"step-{step}.jsonl").read_text().splitlines()
        assert [json.loads(line)["index"] for line in results] == [0]


def _evaluated_here(rank, tmp_path):
    """evaluate() on this process of 2: (records, summary) as it returns them."""
    from fastgrpo.rollout import BuiltinEngine, SamplingParams
    from fastgrpo.train.distributed import Distributed
    from fastgrpo.train.evaluate import build_eval_task, evaluate
    from tests.forked_gloo import tiny_model

    model, tokenizer = tiny_model(lora=False)
    task = build_eval_task(default_task.build_sft_dataset(num_rows=5, seed=1), tokenizer, prompt_column="prompt",
                           prompt_format="raw", reward_funcs=[default_task.repeat_letter_reward])
    return evaluate(BuiltinEngine(model, tokenizer), tokenizer, task, SamplingParams(max_new_tokens=4),
                    num_generations=2, dist=Distributed.current())


def test_the_evaluation_is_gathered_on_rank_0_alone(tmp_path):
    """Every process gathered every process's records (all_gather_object), while rank 0 alone writes and logs them:
    each process held the whole evaluation's completions for nothing."""
    (records, summary), (others, other_summary) = run_forked(_evaluated_here, tmp_path, deadline_s=120,
                                                             group_timeout_s=60)
    assert [r["index"] for r in records] == [i for i in range(5) for _ in range(2)]
    assert summary["num_examples"] == 5
    assert (others, other_summary) == ([], {})
