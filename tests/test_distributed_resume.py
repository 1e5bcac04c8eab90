"""A --resume under torchrun (2 gloo processes, forked, each running fastgrpo.train.cli.main) of a run that another
process count wrote: the settings the resume takes from the run fit this launch's processes."""
import json
from pathlib import Path

import torch

from fastgrpo.train import default_task
from fastgrpo.train.cli import main
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed
from tests.forked_gloo import cli, full_tensor, run_forked, tiny_model, trained_weights

# LoRA: its checkpoint (whole adapter weights, DDP) resumes on any process count
FIELDS = dict(default_task.PRESET, batch_size=8, num_generations=4, micro_batch_size=4)
FAST = ["--lora-rank", "4", "--no-progress-bar", "--num-generations", "4", "--batch-size", "8",
        "--max-completion-length", "2"]


def _run(worker, tmp_path, *args) -> list:
    return run_forked(worker, tmp_path, *args, deadline_s=120, group_timeout_s=60)


def _launched(rank, tmp, runs) -> dict:
    """cli, with the RANK torchrun gives each process (the other ranks log warnings only)."""
    return cli(rank, tmp, runs, {"RANK": str(rank)})


def test_a_bare_resume_on_more_processes_fits_the_runs_micro_batch_to_each(tmp_path):
    """A run of 1 process, its micro-batch 8 (the built-in model's, fitted to its batch of 8), resumed on 2 with
    `--resume` alone: the resume took micro_batch_size 8 from the run, each process's share of the minibatch is 4, and
    both stopped with 'micro_batch_size: expected a divisor of 4 ..., got 8', a setting the user never gave. The
    micro-batch is lowered to 4 and said (once, by rank 0); the batch stays the run's."""
    run = tmp_path / "out" / "run"
    assert main(["train", "--output-dir", str(run), "--max-steps", "1", *FAST]) == 0
    resume = ["train", "--output-dir", str(run), "--max-steps", "2", "--resume", *FAST]
    found = _run(_launched, tmp_path, [resume])
    assert [rank["exits"] for rank in found] == [[0], [0]], found[0]["stderr"]
    said = "resume: --micro-batch-size 4, not the run's 8, which does not divide each of the 2 processes' share of a " \
           "minibatch (4); the batch stays the run's (pass --micro-batch-size to choose another)"
    assert said in found[0]["stderr"] and said not in found[1]["stderr"], found
    record = json.loads((run / "checkpoint-2" / "run_config.json").read_text())
    assert (record["micro_batch_size"], record["batch_size"]) == (4, 8)


def test_a_bare_resume_on_one_process_keeps_the_runs_fsdp_settings(tmp_path):
    """A full fine-tuning run of 2 processes with --fsdp-layers-per-group 2, resumed on 1 with `--resume` alone: the
    resume took the setting from the run, and the command refused it ('fsdp_layers_per_group: shapes FSDP2, ...,
    and this run has one process'), a setting the user never gave. It is kept (it shapes nothing on one process) for
    the run's next resume on several."""
    run = tmp_path / "out" / "run"
    full = FAST[2:]  # without --lora-rank 4
    start = ["train", "--output-dir", str(run), "--max-steps", "1", "--fsdp-layers-per-group", "2", *full]
    assert [rank["exits"] for rank in _run(_launched, tmp_path, [start])] == [[0], [0]]
    assert main(["train", "--output-dir", str(run), "--max-steps", "2", "--resume", *full]) == 0
    record = json.loads((run / "checkpoint-2" / "run_config.json").read_text())
    assert (record["fsdp_layers_per_group"], record["micro_batch_size"]) == (2, 4)


def _optimizer_states(model, optimizer) -> dict:
    """{parameter name: {state name: whole fp64 copy}} of an AdamW over model's parameters (shards gathered)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: full_tensor(v) for k, v in s.items()} for p, s in optimizer.state.items()}


def _stepped(model):
    """AdamW over model's parameters after one step on seeded gradients: its states are not 0."""
    g = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()
    return optimizer


def _restored_into_shards(rank, tmp, whole: str) -> dict:
    """The whole-weights checkpoint `whole` restored into an FSDP2 run of 2 processes (whole copies of its weights and
    optimizer states), which then writes its own (sharded) checkpoint."""
    from fastgrpo.train.checkpoint import read_checkpoint

    model, _ = tiny_model(lora=False)
    group = Distributed.current().data_parallel(model, None, GRPOConfig(**FIELDS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group.restore_checkpoint(Path(whole), read_checkpoint(whole), model, optimizer)
    found = {"weights": trained_weights(model), "states": _optimizer_states(model, optimizer), "rng": torch.rand(3)}
    group.save_checkpoint(tmp / "sharded", model, optimizer, {"step": 1})
    return found


def test_full_fine_tuning_resumes_on_another_process_count(tmp_path):
    """Whole weights (1 process) resumed on 2 FSDP2 processes, and their shards resumed on 1: each was refused ('holds
    whole weights, but this run shards them' / 'holds FSDP2 shards of 2 processes; resume it under torchrun
    --nproc_per_node 2') after the model loaded. Each loads the other's weights and AdamW states bit for bit."""
    from fastgrpo.train.checkpoint import read_checkpoint, rng_states

    model, _ = tiny_model(lora=False)
    optimizer = _stepped(model)
    weights, states = trained_weights(model), _optimizer_states(model, optimizer)
    torch.manual_seed(5)
    rng = rng_states()
    Distributed().save_checkpoint(tmp_path / "whole", model, optimizer,
                                  {"step": 1, "optimizer": optimizer.state_dict(), "rng": rng})
    found = _run(_restored_into_shards, tmp_path, str(tmp_path / "whole"))
    for rank in found:
        assert all(torch.equal(rank["weights"][n], w) for n, w in weights.items())
        assert rank["states"].keys() == states.keys()
        assert all(torch.equal(rank["states"][n][k], v) for n, s in states.items() for k, v in s.items())
    torch.set_rng_state(rng["torch"])
    assert torch.equal(found[0]["rng"], torch.rand(3))  # the run's RNG state, restored
    model, _ = tiny_model(lora=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    Distributed().restore_checkpoint(tmp_path / "sharded", read_checkpoint(tmp_path / "sharded"), model, optimizer)
    drawn = torch.rand(3)
    torch.set_rng_state(rng["torch"])
    torch.rand(3)  # rank 0's draw before it saved the sharded checkpoint
    assert torch.equal(drawn, torch.rand(3))  # the RNG state it saved, restored
    assert all(torch.equal(w, weights[n]) for n, w in trained_weights(model).items())
    back = _optimizer_states(model, optimizer)
    assert all(torch.equal(back[n][k], v) for n, s in states.items() for k, v in s.items())


def test_processes_that_resolve_different_settings_stop_before_the_run(tmp_path):
    """Each process resolves the command line itself: here `--output-dir ~/run` under a home of its own (a folder each
    sees alone, as a disk local to each machine), where rank 0's holds the run's checkpoint and rank 1's nothing.
    Rank 0 resumed the run while rank 1 found no checkpoint and stopped, leaving rank 0 in a collective until its
    process group timed out. Every process now stops at once, rank 0 naming the setting."""
    homes = [tmp_path / "out" / f"home-{rank}" for rank in range(2)]
    for home in homes:
        home.mkdir(parents=True)
    train = ["train", "--output-dir", "~/run", "--max-steps", "1", *FAST]
    assert main(["train", "--output-dir", str(homes[0] / "run"), "--max-steps", "1", *FAST]) == 0
    found = _run(_at_home, tmp_path, [[*train, "--max-steps", "2", "--resume"]])
    assert [rank["exits"] for rank in found] == [[2], [2]], found
    assert found[0]["stderr"].splitlines()[-1] == (
        f"fastgrpo train: error: output_dir: expected the same value on every process, got '{homes[0] / 'run'}' on "
        f"process 0, '{homes[1] / 'run'}' on process 1; each reads the flags, config file and output folder itself: "
        "start them again on one folder they all see as it stands")
    assert "error" not in found[1]["stderr"]


def _at_home(rank, tmp, runs) -> dict:
    return cli(rank, tmp, runs, {"RANK": str(rank), "HOME": str(tmp / "out" / f"home-{rank}")})


def _restored(rank, tmp) -> dict:
    """Rank r restores checkpoint-<r + 1>, as a process that found another newest checkpoint would."""
    from fastgrpo.train.checkpoint import read_checkpoint

    model, _ = tiny_model(lora=True)
    path = tmp / f"checkpoint-{rank + 1}"
    try:
        Distributed.current().restore_checkpoint(path, read_checkpoint(path), model, None)
    except ValueError as err:
        return {"error": str(err)}
    return {"weights": trained_weights(model)}


def test_processes_that_find_different_checkpoints_stop_together(tmp_path):
    """Each process of a resume loads the newest checkpoint that reads back as it finds it: a checkpoint that a
    previous launch's process was still writing as they looked made them continue from different steps, each with
    other weights, unsaid (and the one further behind trained a step more, alone, waiting in its collectives)."""
    from fastgrpo.train.checkpoint import rng_states

    model, _ = tiny_model(lora=True)
    for step in (1, 2):
        trainable = {n: p.detach().clone() + step for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"step": step, "trainable": trainable, "rng": rng_states()},
                   _folder(tmp_path / f"checkpoint-{step}") / "trainer_state.pt")
    found = _run(_restored, tmp_path)
    message = (f"resume: expected one checkpoint on every process, got {tmp_path / 'checkpoint-1'} on process 0, "
               f"{tmp_path / 'checkpoint-2'} on process 1; start them again on one folder they all see as it stands")
    assert found == [{"error": message}, {"error": message}], found


def _folder(path: Path) -> Path:
    path.mkdir()
    return path
