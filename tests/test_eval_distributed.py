"""`fastgrpo train --eval-steps` on 2 gloo processes (real torch.distributed, forked, as tests/test_sft_distributed.py
runs `fastgrpo sft`): every process evaluates every 2nd row (under FSDP2 with every weight gathered), drawing the
samples one process draws for them, and rank 0 alone writes output_dir/eval/ and logs the numbers; the files are the
ones a single process evaluating the same weights writes. Before, every rank wrote the same files into rank 0's
folder, and under FSDP2 each rank generated from its shards and failed ("aten.embedding.default got mixed
torch.Tensor and DTensor").
"""
import json
import os

import pytest
import torch

from tests.forked_gloo import WORLD, cli, read_metrics
from tests.test_sft_distributed import _run

STEPS = 2
# 2 prompts x 8 samples a step (one group per process), an evaluation after each step on 4 held-out rows; groups of
# 8 completions of 8 tokens get rewards that differ within a group, and a learning rate that makes their steps change
# what the model samples
ARGS = ["--batch-size", "16", "--num-generations", "8", "--micro-batch-size", "8", "--max-completion-length", "8",
        "--max-steps", str(STEPS), "--eval-steps", "1", "--eval-max-examples", "4", "--no-progress-bar",
        "--logging-steps", "1", "--learning-rate", "0.05"]
TIMINGS = ("seconds", "tokens_per_s", "date")  # what differs in the summary from one evaluation to the next


def _train_argv(tmp, output: str, lora: bool) -> list[str]:
    return ["train", "--output-dir", str(tmp / "out" / output), "--lora-rank", "4" if lora else "0", *ARGS]


def _trained_weights(run, lora: bool) -> dict:
    """The weights the run ended with, which its last evaluation generated from: a LoRA run's adapter from its last
    checkpoint; a fully fine-tuned run's whole model from its export (saved in fp32, as trained)."""
    if lora:
        from fastgrpo.train.checkpoint import read_checkpoint

        return read_checkpoint(run / f"checkpoint-{STEPS}")["trainable"]
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def _evaluate_on_one_process(argv: list[str], weights: dict) -> None:
    """The periodic evaluation of the run `argv` describes, on this (single) process: as step 0 with the weights the
    run starts from, as step STEPS with `weights` loaded."""
    from fastgrpo.train.cli import build_parser
    from fastgrpo.train.commands import config_from_args
    from fastgrpo.train.loading import load_dataset, load_model_and_tokenizer, resolve_reward
    from fastgrpo.train.trainer import GRPOTrainer

    config = config_from_args("train", build_parser().parse_args(argv))
    torch.manual_seed(config.seed)  # LoRA's initialization, as the command does
    model, tokenizer = load_model_and_tokenizer(config)
    trainer = GRPOTrainer(model, tokenizer, [resolve_reward(name) for name in config.reward_funcs],
                          load_dataset(config), config)
    trainer.evaluator(0, force=True)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and (config.lora_rank or set(missing) <= {"lm_head.weight"}), (missing, unexpected)
    trainer.evaluator(STEPS, force=True)


def _completions(path) -> list[str]:
    return [json.loads(line)["completion"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_train_evaluates_on_every_process_and_rank_0_writes(tmp_path, lora):
    found = _run(cli, tmp_path, [_train_argv(tmp_path, "run", lora)])
    for rank in range(WORLD):
        assert found[rank]["exits"] == [0], found[rank]["stderr"]
    assert found[0]["stdout"].count("loss ") == STEPS and found[1]["stdout"] == ""
    assert "eval step 1 |" in found[0]["stderr"] and "eval step" not in found[1]["stderr"]  # logged generations
    # rank 1 writes nothing in the folder (FSDP2: its shard of the checkpoint only)
    assert [w for w in found[1]["writes"] if f"{os.sep}shards" not in w] == [], found[1]["writes"]

    run = tmp_path / "out" / "run"
    evals = run / "eval"
    assert sorted(os.listdir(evals)) == sorted(f"step-{s}{end}" for s in range(1, STEPS + 1)
                                               for end in (".jsonl", "_summary.json"))
    for metrics in read_metrics(run):  # rank 0's metrics line carries its evaluation's numbers
        summary = json.loads((evals / f"step-{metrics['step']}_summary.json").read_text())
        assert summary["num_samples"] == 4
        assert {k[len("eval/"):]: v for k, v in metrics.items() if k.startswith("eval/")} == {
            k: v for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        assert summary["step"] == metrics["step"]  # the metrics line's own step, not an eval/ number

    # one process evaluating the weights the run ended with writes the same completions and numbers; the weights
    # it starts from sample others (the comparison depends on the weights)
    _evaluate_on_one_process(_train_argv(tmp_path, "one", lora), _trained_weights(run, lora))
    one, name = tmp_path / "out" / "one" / "eval", f"step-{STEPS}.jsonl"
    assert (one / name).read_text() == (evals / name).read_text()
    assert _completions(one / "step-0.jsonl") != _completions(evals / name)
    two, single = [{k: v for k, v in json.loads((folder / f"step-{STEPS}_summary.json").read_text()).items()
                    if k not in TIMINGS} for folder in (evals, one)]
    assert two == single
