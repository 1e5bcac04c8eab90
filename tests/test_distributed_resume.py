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
    assert all(torch.equal(w, weights[n]) for n, w in trained_weights(model).items())
    back = _optimizer_states(model, optimizer)
    assert all(torch.equal(back[n][k], v) for n, s in states.items() for k, v in s.items())

