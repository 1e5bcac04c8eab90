"""Distributed.finish_gradients on 2 processes, directly: the global gradient norm it returns and the gradients it
leaves, against one process's torch.nn.utils.clip_grad_norm_ of the full gradients in fp64.

Each rank builds the same tiny Qwen2 (seeded random weights) and wraps it the trainer's way (Distributed.wrap with a
GRPOConfig): FSDP2 (fully_shard on each decoder layer and the root), FSDP2 with fsdp_cpu_offload (the gradient
shards live in host memory, the norm is all-reduced over NCCL), and DDP over a LoRA adapter (finish_gradients is
clip_grad_norm_ on the replicated gradients: a sum over ranks there would count every gradient twice). Every trained
parameter gets a known fp32 gradient drawn from one seed on every rank, as the engine would leave it: FSDP2 ranks
their torch.chunk(dim 0) shard (the embedding's 37 rows split 19/18), DDP ranks the whole (already all-reduced)
gradient. max_norm is a quarter of the true norm (clips) or four times it (keeps). Every rank must return the
same norm, and its gradients must live where the wrap keeps them (host memory under CPU offload).

Tolerance, derived (u = 2^-24, fp32 unit roundoff; the gradients are exact in fp32, so the fp64 reference is exact
to ~1e-16): the squared norm of n fp32 values, squared and summed in fp32 in any order, is within gamma_n = n u of
the exact sum of non-negative terms (Higham, Accuracy and Stability, 4.2 and 3.1), so a tensor's norm is within
(n/2 + 1) u. FSDP2 squares those norms in fp64 (exact), sums and takes the root in fp64 (~k 2^-53) and rounds to
fp32 (u); clip_grad_norm_ (DDP) sums the k norms' squares in fp32 (another (k/2 + 1) u). Both are within
norm_rtol = ((n + k) / 2 + 3) u of the true norm, n the largest tensor's size and k the number of tensors
(first-order terms; the second-order ones are ~1e-9): 4.7e-5 for the full model, 4.2e-6 for the adapter, where
the CPU run's errors are 3e-9 and 4e-8. A fault moves the norm by a large fraction: a missing all-reduce by ~30%,
an all-reduce of replicated gradients by 41%, a sum of norms instead of squares by several x.
The clipped gradient g * (max_norm / (norm + 1e-6)) adds the rounding of max_norm to fp32, of norm + 1e-6, of the
quotient and of the product: each element within norm_rtol + 4u of the reference's (clip_rtol adds one u of slack).
A coefficient clamped to 1.0 leaves every gradient bit for bit.

CPU (gloo, forked processes) runs in CI; the NCCL run needs 2 GPUs (spawned processes: the parent may have
initialized CUDA already, which a forked child cannot use):

    python -m pytest -m gpu tests/test_distributed_gpu.py -q
"""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM

from fastgrpo.train.config import GRPOConfig
from fastgrpo.train.distributed import Distributed

WORLD = 2
# an odd vocabulary: the embedding and lm_head shard unevenly (19 + 18 rows)
SIZES = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
WRAPS = ("fsdp2", "fsdp2-offload", "ddp-lora")
FACTORS = {"clips": 0.25, "keeps": 4.0}  # max_norm / the true norm
U = 2.0**-24  # fp32 unit roundoff
CPU_OFFLOAD_SKIP = ("CPU offload on a CPU mesh: the shards are in host memory already, and CPUOffloadPolicy pins "
                    "them, which needs CUDA")


def _model(lora: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    return model


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full fp32 gradient of each trained parameter, the same on every rank and in the reference; scales 1 to
    8 so that no tensor's share of the norm is like another's."""
    g = torch.Generator().manual_seed(1)
    return {name: torch.randn(p.shape, generator=g) * 2.0 ** (i % 4)
            for i, (name, p) in enumerate((n, p) for n, p in model.named_parameters() if p.requires_grad)}


def _true_norm(grads: dict[str, torch.Tensor]) -> float:
    return sum(g.double().square().sum() for g in grads.values()).sqrt().item()


def _own(full: torch.Tensor, sharded: bool, rank: int) -> torch.Tensor:
    """This rank's part of a full gradient: its dim-0 chunk under FSDP2 (torch.chunk, FSDP2's rule), else all."""
    return torch.chunk(full, WORLD)[rank] if sharded else full


def _set_gradient(p: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        p.grad = full.to(p.device, copy=True)  # finish_gradients scales it in place: not `full` itself
        return
    assert tuple(p.placements) == (Shard(0),)
    local = _own(full, True, rank)
    assert local.shape == p.to_local().shape
    # a DTensor like the parameter, whose local shard stays where the parameter's is (host memory under CPU
    # offload, as FSDP2 keeps its gradients there): DTensor.from_local would move it to the mesh's device
    p.grad = torch.zeros_like(p)
    p.grad.to_local().copy_(local)


def _worker(rank: int, backend: str, store: str, out: str) -> None:
    cuda = backend == "nccl"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # 2 processes on a 2-core CI machine; and no OpenMP pool inherited through fork
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.tensor import DTensor

        found = {}
        for wrap in WRAPS:
            if wrap == "fsdp2-offload" and not cuda:
                continue
            model = _model(lora=wrap == "ddp-lora").to("cuda" if cuda else "cpu")
            full = _gradients(model)
            config = GRPOConfig(batch_size=2 * WORLD, num_generations=2, micro_batch_size=1,
                                fsdp_cpu_offload=wrap == "fsdp2-offload")
            distributed = Distributed.wrap(model, None, config)
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            for case, factor in FACTORS.items():
                max_norm = factor * _true_norm(full)
                for name, p in named:
                    _set_gradient(p, full[name], rank)
                norm = distributed.finish_gradients([p for _, p in named], max_norm)
                local = {n: p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for n, p in named}
                found[wrap, case] = dict(norm=norm.item(), max_norm=max_norm,
                                         devices={g.device.type for g in local.values()},
                                         grads={n: g.detach().cpu().clone() for n, g in local.items()})
        torch.save(found, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                     reason="needs 2 CUDA GPUs")]),
])
def clipped(request, tmp_path_factory):
    """(backend, what each rank found: {(wrap, case): norm, max_norm, gradient devices, local gradients})."""
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"clip-{backend}")
    out = str(tmp / "found")
    # gloo: forked after this process imported transformers and PEFT (a spawned process spends seconds importing)
    _model(lora=True)
    import torch.distributed.fsdp  # noqa: F401

    mp.start_processes(_worker, args=(backend, str(tmp / "store"), out), nprocs=WORLD,
                       start_method="fork" if backend == "gloo" else "spawn")
    return backend, [torch.load(f"{out}-{rank}.pt", weights_only=False) for rank in range(WORLD)]


@pytest.mark.parametrize("case", FACTORS)
@pytest.mark.parametrize("wrap", WRAPS)
def test_finish_gradients_clips_by_the_global_norm(clipped, wrap, case):
    backend, ranks = clipped
    if wrap == "fsdp2-offload" and backend == "gloo":
        pytest.skip(CPU_OFFLOAD_SKIP)
    full = _gradients(_model(lora=wrap == "ddp-lora"))
    # the 1-process reference: clip_grad_norm_ of the whole gradients, in fp64
    reference = {}
    for name, g in full.items():
        reference[name] = torch.zeros(g.shape, dtype=torch.float64)
        reference[name].grad = g.double()
    max_norm = ranks[0][wrap, case]["max_norm"]
    want_norm = torch.nn.utils.clip_grad_norm_(list(reference.values()), max_norm).item()
    assert max_norm == pytest.approx(FACTORS[case] * want_norm, rel=1e-12)
    n, k = max(g.numel() for g in full.values()), len(full)
    norm_rtol = ((n + k) / 2 + 3) * U
    clip_rtol = norm_rtol + 5 * U
    assert norm_rtol < 1e-4  # far below what a fault moves (module docstring)

    sharded = wrap.startswith("fsdp2")
    expected_devices = {"cpu"} if backend == "gloo" or wrap == "fsdp2-offload" else {"cuda"}
    for rank, found in enumerate(ranks):
        got = found[wrap, case]
        assert got["devices"] == expected_devices, rank
        assert got["norm"] == ranks[0][wrap, case]["norm"], "the ranks disagree on the norm"
        assert abs(got["norm"] - want_norm) <= norm_rtol * want_norm, \
            f"rank {rank}: norm {got['norm']!r}, fp64 reference {want_norm!r} (tolerance {norm_rtol:.2g} relative)"
        assert got["grads"].keys() == full.keys()
        for name, g in got["grads"].items():
            assert g.dtype == torch.float32 and g.shape == _own(full[name], sharded, rank).shape, name
            if case == "keeps":  # coefficient clamped to 1.0: untouched, bit for bit
                assert torch.equal(g, _own(full[name], sharded, rank)), name
            else:
                want = _own(reference[name].grad, sharded, rank)
                err = ((g.double() - want).abs() / want.abs()).max().item()
                assert err <= clip_rtol, f"rank {rank} {name}: relative error {err:.3g} > {clip_rtol:.3g}"
    if case == "clips":  # the reference did clip: the comparison above is not of unchanged gradients
        assert _true_norm({n: p.grad for n, p in reference.items()}) == pytest.approx(max_norm, rel=1e-5)
