"""`fastgrpo sft` on 2 gloo processes (real torch.distributed, forked) against one process on the same global batch:
one step's update (DDP for LoRA, FSDP2 for full fine-tuning) equals one process's within fp32 rounding, also on an
epoch's smaller last step, where one process has no micro-batch of its own; the command writes its folder from rank 0
alone (FSDP2: each rank its shard of a checkpoint), resumes bit for bit, and a setting or folder that one process
refuses stops every process with one line.

Tolerance of "equal within fp32" (as tests/test_distributed.py derives it for GRPO): each process runs some of the
step's micro-batches, exactly as one process cuts them, and the gradients are summed in another order (per process,
then the all-reduce / reduce-scatter; the scaling by 2 processes and the average over them are exact). Each side's
error against an fp64 evaluation of the same step is rounding of that kind, so the 2-process error may be a small
multiple of the 1-process error e1, never orders of magnitude more: |g2 - g1| <= 8 e1 + 8 ulp(max|g|). A real fault
(a process's micro-batch dropped or counted twice, the loss divided by a process's own tokens) moves gradients by a
sizeable fraction of their size. AdamW's first step maps g to lr g / (|g| + eps) elementwise, slope at most
lr / eps: with eps = 1e-3 the updated weights may differ by lr * tol_g / eps plus an ulp of the weights. The global
gradient norm moves by at most the difference vector's norm, sqrt(n) * tol_g.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from fastgrpo.train import default_task
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_config import SFTConfig
from tests.forked_gloo import U32, WORLD, cli, full_tensor, read_metrics, run_forked, tiny_model, trained_weights

ROWS = 10
# A step takes 8 of the 10 rows: 4 micro-batches of 2, two per process (accumulated, then reduced); the epoch's last
# step takes 2: one micro-batch, which process 1 repeats with weight 0.
# No clipping (the gradient norms are 4 to 10): the gradients at the optimizer are the step's own.
FIELDS = dict(default_task.SFT_PRESET, batch_size=8, micro_batch_size=2, adam_epsilon=1e-3, max_grad_norm=1e3,
              export=False, progress_bar=False, logging_steps=0, save_steps=0)


def _rows() -> list[dict]:
    """Rows of 11 to 15 tokens (a response of 1 to 5 letters and EOS), so that sorting a step by length matters."""
    return [{"prompt": f"{i:03d} say {c}", "response": c * (1 + i % 5), "letter": c}
            for i, c in zip(range(ROWS), "abcabcabca")]


# ---- the forked processes ----
def _run(worker, tmp_path: Path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


# ---- one step's update ----
def _one_step(lora: bool, step: int, output_dir: Path, dtype=torch.float32, **fields) -> dict:
    """SFT step `step` (0-based) from the seeded model (SFTConfig `fields` over FIELDS): its metrics, the gradients
    at the optimizer, the weights after, the rows this process ran forward, and the model's FSDP2 groups."""
    from torch.distributed.fsdp import FSDPModule

    model, tokenizer = tiny_model(lora, dtype)
    trainer = SFTTrainer(model, tokenizer, _rows(), SFTConfig(**{**FIELDS, **fields}, output_dir=str(output_dir)))
    trainer.step = step
    grads, forwarded = {}, []
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: forwarded.append(len(args[0])))

    def capture(optimizer, args, kwargs):
        grads.update({n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(capture)
    metrics = trainer.train_step()
    return dict(metrics=metrics, grads=grads, weights=trained_weights(model), forwarded=forwarded,
                groups=sum(isinstance(m, FSDPModule) for m in model.modules()))


CASES = [(lora, step) for lora in (False, True) for step in (0, 1)]


def _steps(rank: int, tmp: Path) -> dict:
    return {case: _one_step(*case, tmp / f"run-{case}") for case in CASES}


@pytest.fixture(scope="module")
def updates(tmp_path_factory):
    """{(lora, step): (2 processes' results by rank, 1 process fp32, 1 process fp64)}."""
    tmp = tmp_path_factory.mktemp("sft-dist")
    found = _run(_steps, tmp)
    return {case: ([rank[case] for rank in found], _one_step(*case, tmp / "one"),
                   _one_step(*case, tmp / "fp64", torch.float64)) for case in CASES}


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
@pytest.mark.parametrize("step", [0, 1], ids=["equal-shares", "epoch-end-one-micro-batch"])
def test_two_processes_update_as_one(updates, lora, step):
    ranks, one, fp64 = updates[lora, step]
    two = ranks[0]
    # each process runs its share of the micro-batches of 2 rows; on the epoch's last step process 1 repeats the one
    assert one["forwarded"] == ([2, 2, 2, 2] if step == 0 else [2])
    assert [rank["forwarded"] for rank in ranks] == ([[2, 2], [2, 2]] if step == 0 else [[2], [2]])
    for key in ("rows", "tokens", "response_tokens", "padding_frac", "micro_batches", "lr", "epoch"):
        assert two["metrics"][key] == one["metrics"][key], key
    assert one["metrics"]["micro_batches"] == (4 if step == 0 else 1)
    assert two["grads"].keys() == one["grads"].keys() == fp64["grads"].keys() and one["grads"]
    flat = {name: torch.cat([run["grads"][k].flatten() for k in sorted(one["grads"])])
            for name, run in (("two", two), ("one", one), ("fp64", fp64))}
    e1 = (flat["one"] - flat["fp64"]).abs().max().item()
    tol_g = 8 * e1 + 8 * U32 * flat["fp64"].abs().max().item()
    diff = (flat["two"] - flat["one"]).abs().max().item()
    assert diff <= tol_g, f"gradients differ by {diff:.3g} > {tol_g:.3g} (1-process fp32 error {e1:.3g})"
    assert flat["one"].abs().max() > 1e3 * tol_g  # the gradients are not all rounding
    norm_tol = flat["one"].numel() ** 0.5 * tol_g
    norms = two["metrics"]["grad_norm"], one["metrics"]["grad_norm"]
    assert abs(norms[0] - norms[1]) <= norm_tol, f"grad_norm {norms} differ by more than {norm_tol:.3g}"
    lr = one["metrics"]["lr"]
    for name, w in one["weights"].items():
        tol_w = lr * tol_g / FIELDS["adam_epsilon"] + 2 * U32 * w.abs().max().item()
        got = (two["weights"][name] - w).abs().max().item()
        assert got <= tol_w, f"{name}: weights differ by {got:.3g} > {tol_w:.3g}"
    # the same forwards (one micro-batch each), their fp32 sums of -log p added in fp64 in another order
    assert two["metrics"]["loss"] == pytest.approx(one["metrics"]["loss"], rel=1e-6)


def _fsdp_options(rank: int, tmp: Path) -> dict:
    return _one_step(False, 0, tmp / "run", fsdp_layers_per_group=2, fsdp_sync_every_micro_batch=False)


def test_sft_takes_trains_fsdp_settings(tmp_path):
    """fastgrpo sft has train's fsdp_* settings (it had FSDP2's defaults alone): the tiny model's 2 decoder layers
    in one group (plus the root), and gradients kept unsharded over the step's 2 micro-batches per process, reduced
    once, give one process's gradients."""
    ranks = _run(_fsdp_options, tmp_path)
    one, fp64 = _one_step(False, 0, tmp_path / "one"), _one_step(False, 0, tmp_path / "fp64", torch.float64)
    assert [rank["groups"] for rank in ranks] == [2, 2] and one["groups"] == 0
    assert [rank["forwarded"] for rank in ranks] == [[2, 2], [2, 2]]
    flat = {name: torch.cat([run["grads"][k].flatten() for k in sorted(one["grads"])])
            for name, run in (("two", ranks[0]), ("one", one), ("fp64", fp64))}
    e1 = (flat["one"] - flat["fp64"]).abs().max().item()
    tol = 8 * e1 + 8 * U32 * flat["fp64"].abs().max().item()
    diff = (flat["two"] - flat["one"]).abs().max().item()
    assert diff <= tol, f"gradients differ by {diff:.3g} > {tol:.3g} (1-process fp32 error {e1:.3g})"


# ---- the command ----
def _sft_argv(tmp: Path, output: str, lora: bool, *extra: str) -> list[str]:
    data = tmp / "rows.jsonl"
    if not data.exists():
        data.write_text("\n".join(json.dumps(row) for row in _rows()) + "\n")
    return ["sft", "--dataset", str(data), "--output-dir", str(tmp / "out" / output), "--batch-size", "4",
            "--micro-batch-size", "2", "--max-steps", "4", "--lora-rank", "4" if lora else "0", "--no-progress-bar",
            "--logging-steps", "0", *extra]


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_sft_command_on_two_processes(tmp_path, lora):
    """4 steps of 4 rows from 10 (step 3 ends the epoch: 2 rows, one micro-batch), a checkpoint every 2 steps (the
    last kept), an evaluation every 2 (every process generates, rank 0 writes; under FSDP2 with every weight
    gathered), the export; and the same run stopped at step 2 and resumed. Rank 0 writes the folder and prints; rank 1 writes nothing there (FSDP2:
    its shard of each checkpoint only)."""
    evaluation = ["--eval-steps", "2", "--eval-dataset", str(tmp_path / "rows.jsonl"), "--eval-max-examples", "4",
                  "--eval-reward-funcs", "fastgrpo.train.default_task:repeat_letter_reward"]
    straight = _sft_argv(tmp_path, "straight", lora, "--save-steps", "2", "--save-total-limit", "1", *evaluation)
    first_half = _sft_argv(tmp_path, "resumed", lora, "--save-steps", "2", "--no-export")
    first_half[first_half.index("--max-steps") + 1] = "2"
    resumed = _sft_argv(tmp_path, "resumed", lora, "--save-steps", "2", "--no-export", "--resume")
    found = _run(cli, tmp_path, [straight, first_half, resumed])
    for rank in range(WORLD):
        assert found[rank]["exits"] == [0, 0, 0], found[rank]["stderr"]
    assert found[0]["stdout"].count("loss ") == 3 and found[1]["stdout"] == ""
    shards = [w for w in found[1]["writes"] if f"{os.sep}shards" not in w]
    assert (shards if not lora else found[1]["writes"]) == [], found[1]["writes"]
    assert lora or found[1]["writes"], "rank 1 wrote no shard of an FSDP2 checkpoint"

    out = tmp_path / "out"
    assert sorted(os.listdir(out / "straight")) == ["checkpoint-4", "eval", "final", "metrics.jsonl"]
    assert sorted(os.listdir(out / "straight" / "eval")) == [
        "step-2.jsonl", "step-2_summary.json", "step-4.jsonl", "step-4_summary.json"]
    assert (out / "straight" / "final" / "config.json").is_file()
    assert ((out / "resumed" / "checkpoint-2" / "shards").is_dir()) == (not lora)
    metrics = read_metrics(out / "straight")
    assert [m["rows"] for m in metrics] == [4, 4, 2, 4] and "eval/accuracy" in metrics[1]
    keys = ("loss", "grad_norm", "lr")
    assert [[m[k] for k in keys] for m in read_metrics(out / "resumed")] == [[m[k] for k in keys] for m in metrics]

    # one process, the same command: the first step's loss (the same weights, its fp32 sums added in another order)
    from fastgrpo.train.cli import main

    assert main(_sft_argv(tmp_path, "one", lora, "--max-steps", "1")) == 0
    assert read_metrics(out / "one")[0]["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-6)


def test_a_batch_that_does_not_split_stops_every_process_before_overwrite(tmp_path):
    """The size error comes first on every process, naming what the batch must be on 2, and the previous run in the
    folder is still there (--overwrite-output-dir would have deleted it)."""
    previous = tmp_path / "out" / "run" / "metrics.jsonl"
    previous.parent.mkdir(parents=True)
    previous.write_text('{"step": 1}\n')
    odd_share = _sft_argv(tmp_path, "run", True, "--overwrite-output-dir")
    odd_share[odd_share.index("--batch-size") + 1] = "6"
    odd_batch = _sft_argv(tmp_path, "run", True, "--overwrite-output-dir", "--micro-batch-size", "1")
    odd_batch[odd_batch.index("--batch-size") + 1] = "5"
    found = _run(cli, tmp_path, [odd_share, odd_batch])
    assert found[0]["exits"] == found[1]["exits"] == [2, 2] and found[1]["stderr"] == ""  # rank 0 says it
    assert found[0]["stderr"].splitlines() == [
        "fastgrpo sft: error: micro_batch_size: expected a divisor of 3 (each of the 2 processes' batch_size 6 / "
        "2 rows), got 2",
        "fastgrpo sft: error: batch_size: expected a multiple of 2 (each of the 2 processes takes an equal share "
        "of a step's rows), got 5"], found[0]["stderr"]
    assert previous.read_text() == '{"step": 1}\n'


def test_a_folder_rank_0_refuses_stops_every_process(tmp_path):
    (tmp_path / "out" / "used").mkdir(parents=True)
    (tmp_path / "out" / "used" / "metrics.jsonl").write_text('{"step": 1}\n')
    found = _run(cli, tmp_path, [_sft_argv(tmp_path, "used", True)])
    first = found[0]["stderr"].strip().splitlines()
    assert found[0]["exits"] == found[1]["exits"] == [2] and len(first) == 1 and "holds another run" in first[0]
    assert found[1]["stderr"] == ""  # rank 0 says it

