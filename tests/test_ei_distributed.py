"""`fastgrpo ei` on 2 gloo processes (real torch.distributed, forked) against one process: a round samples the same
completions (the built-in engine's noise is keyed by the question's position in the run, whichever process samples
it), so both processes keep the same examples, in the same order, as one process; the round's SFT step (DDP for
LoRA, FSDP2 for full fine-tuning) leaves the same weights on both processes and equals one process's within fp32
rounding. The command writes its folder from rank 0 alone, resumes at the next round, and refuses a split that does
not fit (or another engine) on every process before it deletes anything.

Tolerance of the SFT step, as tests/test_sft_distributed.py derives it: each process runs some of the step's
micro-batches, cut as one process cuts them, and the gradients are summed in another order, so the 2-process
gradient may differ from one process's by a small multiple of the one-process error e1 against fp64 (on the same
kept examples): |g2 - g1| <= 8 e1 + 8 ulp(max|g|); a micro-batch dropped or counted twice moves gradients by a
sizeable fraction of their size. A round here is one SFT step (batch_size 20 holds every completion), AdamW's first:
the update lr g / (|g| + eps) has slope at most lr / eps in g, so the weights may differ by lr * tol_g / eps plus an
ulp of the weights.
"""
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fastgrpo.train import default_task
from fastgrpo.train.ei_config import EIConfig
from fastgrpo.train.expert_iteration import ExpertIteration
from fastgrpo.train.interrupts import Interrupted
from fastgrpo.train.sft import SFTTrainer
from fastgrpo.train.sft_data import SFTExample
from tests.forked_gloo import U32, WORLD, cli, full_tensor, read_metrics, run_forked, tiny_model, trained_weights

# 5 questions (3 on process 0, 2 on process 1) x 4 completions of 2 tokens; one SFT step of micro-batches of 2, no
# clipping (the gradients at the optimizer are the step's own).
FIELDS = dict(default_task.EI_PRESET, prompt_format="raw", questions_per_step=5, num_generations=4, batch_size=20,
              micro_batch_size=2, sft_epochs=1, adam_epsilon=1e-3, max_grad_norm=1e3)
SAME = ("kept", "kept_frac", "reward", "reward_std", "rewards/even_first_character", "rewards/even_first_character/std",
        "questions_solved_frac", "completion_length", "truncated_frac", "sft_steps")


def even_first_character(prompts, completions, **columns) -> list[float]:
    """Correct when the completion's first character has an even code: about half of the tiny model's samples (it
    seldom writes the built-in task's letter), decided by the text alone, so wherever it is scored."""
    return [float(bool(text) and ord(text[0]) % 2 == 0) for text in completions]


def none_or_text(prompts, completions, **columns) -> list:
    """Not applicable (None) to every other completion, and a bug's value (text, not a number) for the rest: each
    scoring (a round's, an evaluation's) warns that the function failed and that some completions are unscored."""
    return [None if i % 2 else "n/a" for i in range(len(completions))]


def _run(worker, tmp_path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


# ---- one round ----
def _config(lora: bool, output_dir, **fields) -> EIConfig:
    return EIConfig(**{**FIELDS, **fields}, lora_rank=4 if lora else 0, output_dir=str(output_dir))


def _round(lora: bool, output_dir) -> dict:
    """Round 1 from the seeded model: its metrics, kept examples, the SFT step's gradients and lr at the optimizer,
    and the weights after."""
    model, tokenizer = tiny_model(lora)
    grads, lrs = {}, []

    def capture(optimizer, args, kwargs):  # every optimizer: the round's SFTTrainer builds its own
        grads.update({n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None})
        lrs.append(optimizer.param_groups[0]["lr"])

    hook = register_optimizer_step_pre_hook(capture)
    try:
        run = ExpertIteration(model, tokenizer, even_first_character, default_task.build_dataset(num_rows=8),
                              _config(lora, output_dir))
        metrics = run.run_round()
    finally:
        hook.remove()
    return dict(metrics=metrics, kept=run.last_kept, grads=grads, lrs=lrs, weights=trained_weights(model))


class _OwnEngine:
    """A caller's own rollout engine (vLLM's, say): under torchrun expert iteration refuses anything but the
    built-in engine before it looks at it."""


def _rounds(rank: int, tmp) -> dict:
    found = {lora: _round(lora, tmp / f"run-{lora}") for lora in (False, True)}
    model, tokenizer = tiny_model(False)
    try:
        ExpertIteration(model, tokenizer, even_first_character, default_task.build_dataset(num_rows=8),
                        _config(False, tmp / "own"), engine=_OwnEngine())
    except ValueError as err:
        found["engine"] = str(err)
    return found


def _fp64_step(lora: bool, kept: list[SFTExample], output_dir) -> dict:
    """The round's SFT step on the same kept examples in fp64 (one process): the reference gradients."""
    model, tokenizer = tiny_model(lora, torch.float64)
    trainer = SFTTrainer(model, tokenizer, kept, _config(lora, output_dir).sft_config(0))
    grads = {}
    trainer.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: grads.update(
        {n: full_tensor(p.grad) for n, p in model.named_parameters() if p.grad is not None}))
    trainer.train_step()
    return dict(grads=grads)


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    """(2 processes' results by rank, 1 process fp32, the SFT step in fp64) by lora; and rank 0's engine refusal."""
    tmp = tmp_path_factory.mktemp("ei-dist")
    found = _run(_rounds, tmp)
    out = {}
    for lora in (False, True):
        one = _round(lora, tmp / f"one-{lora}")
        out[lora] = ([rank[lora] for rank in found], one, _fp64_step(lora, one["kept"], tmp / f"fp64-{lora}"))
    out["engine"] = [rank.get("engine") for rank in found]
    return out


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_a_round_on_two_processes_keeps_and_updates_as_one(rounds, lora):
    ranks, one, fp64 = rounds[lora]
    # the same samples, scored where they were drawn, gathered in the round's order
    assert ranks[0]["kept"] == ranks[1]["kept"] == one["kept"] and len(one["kept"]) >= 6, one["kept"]
    for rank in ranks:
        assert {k: rank["metrics"][k] for k in SAME} == {k: one["metrics"][k] for k in SAME}
        assert rank["metrics"]["sft_loss_first"] == pytest.approx(one["metrics"]["sft_loss_first"], rel=1e-6)
    assert one["metrics"]["rewards/even_first_character/std"] > 0  # the gathered round's spread, not one process's
    assert one["metrics"]["sft_steps"] == 1 and one["lrs"] == ranks[0]["lrs"] and len(one["lrs"]) == 1
    # one update on every process: the same weights, bit for bit
    assert all(torch.equal(ranks[0]["weights"][n], ranks[1]["weights"][n]) for n in one["weights"])

    two = ranks[0]
    assert two["grads"].keys() == one["grads"].keys() == fp64["grads"].keys() and one["grads"]
    flat = {name: torch.cat([run["grads"][k].flatten() for k in sorted(one["grads"])])
            for name, run in (("two", two), ("one", one), ("fp64", fp64))}
    e1 = (flat["one"] - flat["fp64"]).abs().max().item()
    tol_g = 8 * e1 + 8 * U32 * flat["fp64"].abs().max().item()
    diff = (flat["two"] - flat["one"]).abs().max().item()
    assert diff <= tol_g, f"gradients differ by {diff:.3g} > {tol_g:.3g} (1-process fp32 error {e1:.3g})"
    assert flat["one"].abs().max() > 1e3 * tol_g  # the gradients are not all rounding
    lr = one["lrs"][0]
    for name, w in one["weights"].items():
        tol_w = lr * tol_g / FIELDS["adam_epsilon"] + 2 * U32 * w.abs().max().item()
        got = (two["weights"][name] - w).abs().max().item()
        assert got <= tol_w, f"{name}: weights differ by {got:.3g} > {tol_w:.3g}"


def test_another_engine_is_refused_under_torchrun(rounds):
    assert rounds["engine"] == ["engine: expected the built-in engine under torchrun (2 processes, each sampling "
                                "with the model it trains), got _OwnEngine; run on one process to sample with it"] * 2


# ---- a signal that reaches one process ----
def _signalled(rank: int, tmp, phase: str) -> dict:
    """A 3-round run (full fine-tuning: FSDP2, each process writes its shard of a checkpoint) whose rank 1 alone gets
    SIGINT in round 2: while it scores its samples (before the SFT) or as the SFT's optimizer steps."""
    model, tokenizer = tiny_model(False)
    calls = []

    def reward(prompts, completions, **columns):
        calls.append(1)
        if rank == 1 and phase == "rollout" and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return even_first_character(prompts, completions)

    def sft_step(optimizer, args, kwargs):
        if rank == 1 and phase == "sft" and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    run = ExpertIteration(model, tokenizer, reward, default_task.build_dataset(num_rows=8),
                          _config(False, tmp / "run", ei_steps=3, save_steps=0, export=False, progress_bar=False,
                                  logging_steps=0))
    hook = register_optimizer_step_pre_hook(sft_step)
    try:
        run.train()
    except Interrupted as stop:
        return {"signal": stop.signum, "round": stop.step, "checkpoint": Path(stop.checkpoint).name,
                "logged": len(run.history)}
    finally:
        hook.remove()
    return {"signal": None}


@pytest.mark.parametrize("phase, saved", [("rollout", 1), ("sft", 2)])
def test_a_signal_one_process_gets_stops_every_process_at_one_round(tmp_path, phase, saved):
    """Before the SFT both processes abandon round 2 and save round 1 (the state round 2 began from); in the SFT both
    finish round 2 and save it. Neither waits in a collective the other never joins."""
    found = _run(_signalled, tmp_path, phase)
    want = {"signal": signal.SIGINT, "round": saved, "checkpoint": f"checkpoint-{saved}", "logged": saved}
    assert found == [want, want]
    assert sorted(os.listdir(tmp_path / "run")) == [f"checkpoint-{saved}", "metrics.jsonl"]
    assert [m["round"] for m in read_metrics(tmp_path / "run")] == list(range(1, saved + 1))


# ---- the command ----
def _ei_argv(tmp, output: str, lora: bool, *extra: str, reward: str = "even_first_character") -> list[str]:
    return ["ei", "--output-dir", str(tmp / "out" / output), "--questions-per-step", "5", "--num-generations", "4",
            "--batch-size", "4", "--micro-batch-size", "2", "--reward-funcs", f"{__file__}:{reward}",
            "--lora-rank", "4" if lora else "0", "--no-progress-bar", "--logging-steps", "0", *extra]


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_ei_command_on_two_processes(tmp_path, lora):
    """2 rounds with an evaluation before the first and after the last (every process generates, rank 0 writes), a
    checkpoint per round (the last kept) and the export; the same run stopped after round 1 and resumed. Rank 0 writes
    the folder and prints; rank 1 writes nothing there (FSDP2: its shard of each checkpoint only). Round 1 is one
    process's: the same samples, rewards and kept completions."""
    evaluation = ["--eval-steps", "2", "--eval-max-examples", "4"]
    straight = _ei_argv(tmp_path, "straight", lora, "--ei-steps", "2", "--save-total-limit", "1", *evaluation)
    first_half = _ei_argv(tmp_path, "resumed", lora, "--ei-steps", "1", "--no-export")
    resumed = _ei_argv(tmp_path, "resumed", lora, "--ei-steps", "2", "--no-export", "--resume")
    found = _run(cli, tmp_path, [straight, first_half, resumed], {"WORLD_SIZE": str(WORLD)})
    for rank in range(WORLD):
        assert found[rank]["exits"] == [0, 0, 0], found[rank]["stderr"]
    assert found[0]["stdout"].count("reward ") == 3 and found[1]["stdout"] == ""
    not_shards = [w for w in found[1]["writes"] if f"{os.sep}shards" not in w]
    assert not_shards == [] and (lora or found[1]["writes"]), found[1]["writes"]

    out = tmp_path / "out"
    assert sorted(os.listdir(out / "straight")) == ["checkpoint-2", "eval", "final", "metrics.jsonl"]
    assert sorted(os.listdir(out / "straight" / "eval")) == [
        "step-0.jsonl", "step-0_summary.json", "step-2.jsonl", "step-2_summary.json"]
    assert (out / "straight" / "final" / "config.json").is_file()
    assert (out / "resumed" / "checkpoint-1" / "shards").is_dir() == (not lora)
    start, *metrics = read_metrics(out / "straight")
    assert start["round"] == 0 and "eval/accuracy" in start and [m["round"] for m in metrics] == [1, 2]
    keys = ("reward", "kept", "sft_loss_first", "sft_loss_last")
    assert [[m[k] for k in keys] for m in read_metrics(out / "resumed")] == [[m[k] for k in keys] for m in metrics]

    from fastgrpo.train.cli import main

    assert main(_ei_argv(tmp_path, "one", lora, "--ei-steps", "1", "--no-export")) == 0
    assert {k: read_metrics(out / "one")[0][k] for k in SAME} == {k: metrics[0][k] for k in SAME}


def test_reward_warnings_are_logged_once_by_rank_0(tmp_path):
    """--reward-errors skip with a function that fails and leaves completions unscored: rank 0 logs each warning once
    for the evaluation before round 1, for round 1 (every process's failures merged) and for the evaluation after;
    rank 1 logs none. Before, each process logged the evaluations' warnings (the same samples: repeated) and its own
    share of the round's failures."""
    argv = _ei_argv(tmp_path, "run", True, "--ei-steps", "1", "--no-export", "--eval-steps", "1",
                    "--eval-max-examples", "4", "--reward-errors", "skip", reward="none_or_text")
    found = _run(cli, tmp_path, [argv], {"WORLD_SIZE": str(WORLD)})
    assert [rank["exits"] for rank in found] == [[0], [0]], found[1]["stderr"]
    warnings = ("reward function none_or_text failed; its failed samples score 0: returned 'n/a'",
                "every reward function returned None (or NaN) for")
    assert [[rank["stderr"].count(w) for w in warnings] for rank in found] == [[3, 3], [0, 0]], found[1]["stderr"]
    # the round's merged failure: its row count is of process 0's share, and it says so
    merged = "(in process 0's share of the round; process 1 failed too)"
    assert found[0]["stderr"].count(merged) == 1, found[0]["stderr"]


def test_a_split_that_does_not_fit_stops_every_process_before_overwrite(tmp_path):
    """The size errors come first on every process, naming what is expected on 2, and the previous run in the folder
    is still there (--overwrite-output-dir would have deleted it)."""
    previous = tmp_path / "out" / "run" / "metrics.jsonl"
    previous.parent.mkdir(parents=True)
    previous.write_text('{"round": 1}\n')
    odd_share = _ei_argv(tmp_path, "run", True, "--overwrite-output-dir", "--batch-size", "6")
    one_question = _ei_argv(tmp_path, "run", True, "--overwrite-output-dir", "--questions-per-step", "1")
    found = _run(cli, tmp_path, [odd_share, one_question], {"WORLD_SIZE": str(WORLD)})
    assert found[0]["exits"] == found[1]["exits"] == [2, 2] and found[1]["stderr"] == ""  # rank 0 says it
    assert found[0]["stderr"].splitlines() == [
        "fastgrpo ei: error: micro_batch_size: expected a divisor of 3 (each of the 2 processes' batch_size 6 / "
        "2 rows), got 2",
        "fastgrpo ei: error: questions_per_step: expected at least 2 (each of the 2 processes samples some of a "
        "round's questions), got 1"], found[0]["stderr"]
    assert previous.read_text() == '{"round": 1}\n'


def test_the_builtin_micro_batch_fits_each_process(monkeypatch):
    """The built-in ei's micro-batch of 32 (a memory setting for its batch of 32) comes down to a process's share of
    16 rows under torchrun: `torchrun --nproc_per_node 2 -m fastgrpo ei` refused a value the user never set."""
    from fastgrpo.train import commands
    from fastgrpo.train.cli import build_parser
    from fastgrpo.train.expert_iteration import check_process_split

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = commands.config_from_args("ei", build_parser().parse_args(["ei"]))
    assert config.micro_batch_size == 16 and config.batch_size == 32
    check_process_split(config, 2)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert commands.config_from_args("ei", build_parser().parse_args(["ei"])).micro_batch_size == 32
