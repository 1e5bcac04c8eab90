"""Data-parallel GRPO on 2 gloo processes (real torch.distributed, forked) against one process on the same global
batch: the first step's rollouts and rewards are identical, and the update (FSDP2 for full fine-tuning, DDP for
LoRA) equals one process's within fp32 rounding, and so does the KL that beta > 0 logs from the log-probs each rank's
loss forwards return; an FSDP2 run resumed from its Distributed Checkpoint continues bit for bit (resumed twice with
both layers in one FSDP2 group, fsdp_reshard_after_forward off and on: they change when and in which collectives
weights are gathered, not the math).

Tolerance of "equal within fp32": the 1-process and the 2-process gradients are two fp32 evaluations of one
quantity that differ only in the order of their sums (micro-batches per rank, then the all-reduce / reduce-
scatter). Each one's error against an fp64 evaluation of the same batch is rounding of that kind, so the
2-process error may be a small multiple of the 1-process error (measured here, e1), never orders of magnitude
more: |g2 - g1| <= 8 e1 + 8 ulp(max|g|). A real fault (a rank's gradient dropped, dapo's normaliser per rank,
advantages from half a batch) moves gradients by a sizeable fraction of their size. AdamW's first step maps g to
lr g / (|g| + eps) elementwise, whose slope is at most lr / eps, so with eps = 1e-3 here the updated weights may
differ by lr * tol_g / eps plus an ulp of the weights; with the default eps = 1e-8 near-zero gradients would turn
rounding into whole steps (sign flips) and the comparison would check nothing.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastgrpo.rollout import BuiltinEngine
from fastgrpo.train import default_task
from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.trainer import GRPOTrainer

WORLD = 2
# 4 prompts x 4 samples: 2 groups per rank; micro-batches of 4, so each rank accumulates 2 before its all-reduce
FIELDS = dict(default_task.PRESET, batch_size=16, num_generations=4, micro_batch_size=4, max_completion_length=6,
              adam_epsilon=1e-3, export=False, progress_bar=False, logging_steps=0)
U32 = 2.0**-23  # fp32 unit roundoff (ulp of 1)
# adaptive entropy: the coefficient moves by the whole batch's entropy, the same on every rank
ADAPTIVE = dict(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.01, entropy_target=1.0)
# a KL penalty with one optimizer step: the KL comes from the log-probs of each rank's loss forwards, gathered
KL = dict(beta=0.1)


class _Replay:
    """An engine that returns one recorded rollout (the fp64 reference trains on the fp32 run's samples)."""

    def __init__(self, result):
        self.result = result

    def generate(self, prompts, **kwargs):
        return self.result

    def release_memory(self):
        pass

    def reacquire_memory(self):
        pass

    def load_weights(self, model):
        pass


def _model(lora: bool, dtype=torch.float32, seed: int = 0):
    tokenizer = default_task.build_tokenizer()
    model = default_task.build_model(tokenizer, seed=seed)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(seed)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    return model.to(dtype), tokenizer


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().double().clone()


def _move_policy(model) -> None:
    """Seeded noise on the trained weights (whole or FSDP2-sharded alike), after the trainer took its reference:
    the first step's KL is then not 0."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02
            p.add_(distribute_tensor(noise, p.device_mesh, p.placements) if isinstance(p, DTensor) else noise)


def _one_step(lora: bool, output_dir, dtype=torch.float32, replay=None, seed: int = 0, overrides=None,
              move_policy: bool = False):
    """One GRPO step: (trainer, metrics, rollouts of this process, gradients at the optimizer, weights after)."""
    model, tokenizer = _model(lora, dtype, seed)
    config = GRPOConfig(**{**FIELDS, **(overrides or {})}, output_dir=str(output_dir))
    engine = _Replay(replay) if replay is not None else BuiltinEngine(model, tokenizer)
    rollouts, generate = [], engine.generate

    def recording(*args, **kwargs):
        rollouts.append(generate(*args, **kwargs))
        return rollouts[-1]

    engine.generate = recording
    trainer = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(64),
                          config, engine=engine)
    if move_policy:
        _move_policy(model)
    grads = {}

    def capture(optimizer, args, kwargs):
        grads.update({n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None})

    hook = trainer.optimizer.register_step_pre_hook(capture)
    metrics = trainer.train_step()
    hook.remove()
    return trainer, metrics, rollouts[0], grads, _weights(model)


class _ReduceScatters:
    """Counts reduce-scatter calls on torch.distributed (FSDP2 reduces each group's gradients in one; the name it
    calls differs across torch versions)."""

    NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")

    def __enter__(self):
        self.calls, self.saved = 0, {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}
        for name, fn in self.saved.items():
            setattr(dist, name, self._counting(fn))
        return self

    def _counting(self, fn):
        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _weights(model) -> dict:
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def _worker(rank: int, store: str, out: str, tmp: str) -> None:
    torch.set_num_threads(1)  # 2 processes on a 2-core CI machine; and no OpenMP pool inherited through fork
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        found, trainers = {}, {}
        for lora in (False, True):
            with _ReduceScatters() as counted:
                trainers[lora], metrics, rollout, grads, weights = _one_step(lora, os.path.join(tmp, f"run-{lora}"))
            found[f"reduce-scatters-{lora}"] = counted.calls
            texts = [None] * WORLD
            dist.all_gather_object(texts, (rollout.texts, rollout.completion_ids.tolist()))
            found[lora] = dict(metrics=metrics, texts=[t for part, _ in texts for t in part],
                               ids=[row for _, part in texts for row in part], grads=grads, weights=weights)
        # FSDP2 resume: the full fine-tuning run checkpoints after step 1 (every rank writes its shard) and takes
        # step 2; a model built from another seed resumes from the checkpoint and takes step 2 again, keeping its
        # layers' gathered weights from forward to backward and gathering two layers as one group (the same
        # numbers, gathered fewer times in fewer collectives).
        first = trainers[False]
        first.save_checkpoint()
        found["straight"] = dict(metrics=first.train_step(), weights=_weights(first.model))
        # Twice, both layers as one group: kept gathered from forward to backward, and resharded after forward.
        for name, reshard, group in (("resumed", False, 2), ("resumed-resharded", True, 2)):
            model, tokenizer = _model(False, seed=1)
            resumed = GRPOTrainer(model, tokenizer, default_task.repeat_letter_reward, default_task.build_dataset(64),
                                  GRPOConfig(**FIELDS, output_dir=first.config.output_dir,
                                             fsdp_reshard_after_forward=reshard, fsdp_layers_per_group=group))
            resumed.resume()
            found[name] = dict(metrics=resumed.train_step(), weights=_weights(model), step=resumed.step)
        found["files"] = sorted(os.listdir(os.path.join(first.config.output_dir, "checkpoint-1", "shards")))
        with _ReduceScatters() as counted:
            _, metrics, _, grads, weights = _one_step(False, os.path.join(tmp, "run-accumulated"),
                                                      overrides=dict(fsdp_sync_every_micro_batch=False))
        found["accumulated"] = dict(metrics=metrics, grads=grads, weights=weights, reduce_scatters=counted.calls)
        for lora in (False, True):
            found[f"kl-{lora}"] = _one_step(lora, os.path.join(tmp, f"run-kl-{lora}"), overrides=KL,
                                            move_policy=True)[1]
        adaptive = _one_step(True, os.path.join(tmp, "run-adaptive"), overrides=ADAPTIVE)[0].entropy
        found["adaptive"] = [None] * WORLD
        dist.all_gather_object(found["adaptive"], (adaptive.last_entropy, adaptive.coef))
        if rank == 0:
            torch.save(found, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """The 2-process results, and the 1-process runs (fp32 and the fp64 reference on the same samples) computed
    while the two processes run. They are forked after this process imported what they use (a spawned process
    spends longer importing transformers than training)."""
    tmp = tmp_path_factory.mktemp("dist")
    out = str(tmp / "found.pt")
    _model(True)  # import transformers' model classes and PEFT before the fork
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

    context = mp.start_processes(_worker, args=(str(tmp / "store"), out, str(tmp)), nprocs=WORLD,
                                 start_method="fork", join=False)
    single = {}
    for lora in (False, True):
        _, metrics, rollout, grads, weights = _one_step(lora, tmp / f"one-{lora}")
        reference = _one_step(lora, tmp / f"fp64-{lora}", dtype=torch.float64, replay=rollout)[3]
        single[lora] = dict(metrics=metrics, rollout=rollout, grads=grads, weights=weights, reference=reference)
    for lora in (False, True):
        single[f"kl-{lora}"] = _one_step(lora, tmp / f"one-kl-{lora}", overrides=KL, move_policy=True)[1]
    adaptive = _one_step(True, tmp / "one-adaptive", overrides=ADAPTIVE)[0].entropy
    single["adaptive"] = (adaptive.last_entropy, adaptive.coef)
    while not context.join():
        pass
    return torch.load(out, weights_only=False), single


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_two_processes_sample_and_update_as_one(two_processes, lora):
    got = two_processes[0][lora]
    one = two_processes[1][lora]
    metrics, rollout = one["metrics"], one["rollout"]
    # the rollouts and rewards of the first step: exactly one process's
    assert got["texts"] == rollout.texts
    assert got["ids"] == rollout.completion_ids.tolist()
    # rewards/<name>/std: the gathered batch's, not a mean of the processes' own (which would leave out the spread
    # between their rows)
    for key in ("reward", "reward_std", "rewards/repeat_letter_reward/std", "frac_reward_zero_std",
                "completion_length", "truncated_frac"):
        assert got["metrics"][key] == metrics[key], key
    assert metrics["rewards/repeat_letter_reward/std"] > 0
    _assert_update_as_one(got, one)


def _assert_update_as_one(got: dict, one: dict) -> None:
    """The update: within the fp32 tolerance derived in the module docstring, from an fp64 run on the same
    samples."""
    metrics, grads, weights, reference = (one[k] for k in ("metrics", "grads", "weights", "reference"))
    assert got["grads"].keys() == grads.keys() == reference.keys() and grads
    flat = {name: torch.cat([g[k].flatten() for k in sorted(grads)]) for name, g in
            (("two", got["grads"]), ("one", grads), ("fp64", reference))}
    e1 = (flat["one"] - flat["fp64"]).abs().max().item()
    tol_g = 8 * e1 + 8 * U32 * flat["fp64"].abs().max().item()
    diff = (flat["two"] - flat["one"]).abs().max().item()
    assert diff <= tol_g, f"gradients differ by {diff:.3g} > {tol_g:.3g} (1-process fp32 error {e1:.3g})"
    assert flat["one"].abs().max() > 1e3 * tol_g  # the gradients are not all rounding
    lr = metrics["lr"]
    for name, w in weights.items():
        tol_w = lr * tol_g / FIELDS["adam_epsilon"] + 2 * U32 * w.abs().max().item()
        assert (got["weights"][name] - w).abs().max().item() <= tol_w, name
    assert got["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7)


def test_fsdp2_accumulating_unsharded_reduces_once_per_minibatch_and_updates_as_one(two_processes):
    """fsdp_sync_every_micro_batch off: each rank keeps its groups gathered and accumulates unsharded gradients over
    its 2 micro-batches, so FSDP2 reduce-scatters each group once per minibatch instead of once per micro-batch, and
    the update equals one process's within the same fp32 tolerance (the sums only change order)."""
    found, single = two_processes
    every, accumulated = found["reduce-scatters-False"], found["accumulated"]["reduce_scatters"]
    assert accumulated > 0 and every == 2 * accumulated, (every, accumulated)
    _assert_update_as_one(found["accumulated"], single[False])


@pytest.mark.parametrize("run", ["resumed", "resumed-resharded"])
def test_two_processes_resume_from_their_shards(two_processes, run):
    found = two_processes[0]
    straight, resumed = found["straight"], found[run]
    assert resumed["step"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(found["files"])
    for key in ("reward", "loss", "grad_norm"):
        assert resumed["metrics"][key] == straight["metrics"][key], key
    for name, w in straight["weights"].items():
        assert torch.equal(resumed["weights"][name], w), name


@pytest.mark.parametrize("lora", [False, True], ids=["fsdp2-full", "ddp-lora"])
def test_two_processes_measure_the_kl_as_one(two_processes, lora):
    """beta > 0 with one optimizer step: no old pass, the KL is taken from the log-probs that each rank's loss
    forwards return through the DDP / FSDP2 wrapper, then gathered."""
    got, want = two_processes[0][f"kl-{lora}"], two_processes[1][f"kl-{lora}"]
    assert got["reward"] == want["reward"]  # the same samples
    assert want["kl"] > 1e-3 and want["kl_p95"] > want["kl"]
    # each token's log-prob takes the same fp32 ops on either side; the means sum in another order
    for key in ("kl", "kl_p95"):
        assert got[key] == pytest.approx(want[key], rel=1e-6), key
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)


def test_two_processes_adapt_entropy_as_one(two_processes):
    """Both ranks move the adaptive entropy coefficient by the whole batch's entropy: the one process's entropy
    (within fp32 rounding of sums taken in another order) and the same coefficient on every rank."""
    found, single = two_processes[0]["adaptive"], two_processes[1]["adaptive"]
    (entropy0, coef0), (entropy1, coef1) = found
    assert entropy0 == entropy1 and coef0 == coef1
    assert entropy0 == pytest.approx(single[0], rel=1e-5) and coef0 == single[1]


def test_exit_frees_a_ddp_model_in_a_reference_cycle_before_closing_the_group(tmp_path):
    """At exit a trainer and its DDP wrapper may still sit in a reference cycle; DDP's reducer destroyed after its
    gloo group had been closed aborted the process now and then. The exit hook collects them while it is open."""
    import gc
    import weakref

    from fastgrpo.train.process_group import _close_process_group

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    gc.disable()  # the cycle must wait for the hook, not for a collection that happens to run earlier
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
        cycle = {"model": model}
        cycle["self"] = cycle
        freed_while_open = []
        weakref.finalize(model, lambda: freed_while_open.append(dist.is_initialized()))
        del model, cycle
        _close_process_group()
        assert freed_while_open == [True] and not dist.is_initialized()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
