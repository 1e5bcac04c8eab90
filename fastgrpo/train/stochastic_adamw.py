"""StochasticRoundingAdamW: torch.optim.AdamW's update computed in fp32 and rounded stochastically into bf16, or,
for bf16 parameters on the CPU, applied to an fp32 master copy.

Why: full fine-tuning keeps bf16 weights, and at lr 1e-6 AdamW moves each weight by about 1e-6, less than half a
bf16 ulp of any weight above 2^-12 (~2.4e-4). torch's AdamW rounds to nearest, so the update is dropped and the
model does not train. Here the parameter and both moments are rounded up or down at random with the probability
that makes the expected result the exact fp32 value: small updates survive on average. fp32 (and fp16, fp64)
tensors are rounded to nearest, as torch does; for fp32 the result equals torch.optim.AdamW within fp32 rounding.

Random bits come from Philox keyed by (seed, the parameter's index in the optimizer, its step count[, its shard's
coordinates on a device mesh]), so a run resumed from a state_dict draws the same bits as one that never stopped,
replicas (DDP, or replicated mesh dimensions) round alike, and FSDP shards draw independent bits.

The Triton kernel (fastgrpo.kernels.adamw) runs on CUDA tensors and under TRITON_INTERPRET=1; for tensors it cannot
take (non-contiguous, fp64) an eager torch version of the same math and rounding rule runs, with bits from a
torch.Generator (same distribution, not the same bits). The kernel steps all of a param group's tensors that it
takes in one launch (one per step count and dtype): a launch per tensor cost ~35 us of host time each, and
Qwen2.5-1.5B has 338 tensors. fp16 parameters are rounded to nearest: small updates are lost there as with torch's
AdamW.

bf16 parameters whose (local) tensor is on the CPU, as FSDP2's CPUOffloadPolicy keeps them, take neither: the eager
path draws three random tensors and builds about twenty fp32 temporaries per element, far slower than torch's fused
CPU AdamW, and the optimizer of an offloaded model steps billions of elements on the host. They keep an fp32 master
copy and fp32 moments instead (host memory is what offloading trades for), step those with torch's fused AdamW
(torch._fused_adamw_, what torch.optim.AdamW(fused=True) runs), and set the bf16 parameter to the master rounded to
nearest: the master accumulates the updates that bf16 cannot hold, no random bits are needed, and the parameter is
always the master's nearest bf16.
"""
from __future__ import annotations

import functools
import itertools

import torch

from fastgrpo.ops._backend import use_triton

_MASK64 = (1 << 64) - 1
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _splitmix64(x: int) -> int:
    """Steele et al.'s 64-bit finalizer: nearby inputs (step 7, step 8) give unrelated keys."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, index: int, step: int, shard: tuple[int, ...] = ()) -> int:
    """The Philox key of one parameter's step, in [2^62, 2^63): the kernel's seed argument is then always an int64
    (Triton compiles one variant per argument type). Shard coordinates that are all 0 (rank 0, or an unsharded
    tensor) give the unsharded key."""
    key = 0
    for part in (seed, index, step, *(shard if any(shard) else ())):
        key = _splitmix64(key ^ (part & _MASK64))
    return (key >> 2) | (1 << 62)


def round_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 x -> bf16 rounded away from zero with probability (|x| - lower neighbour) / spacing; bits: int32, only
    the low 16 used. The eager twin of the kernel's _round_bf16_stochastic (see there why it is unbiased)."""
    xi = x.view(torch.int32)
    xi = torch.where(torch.isnan(x), xi | 0x400000, xi + (bits & 0xFFFF))
    return (xi & -65536).view(torch.float32).to(torch.bfloat16)


def adamw_step_torch_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
    decay: float, beta1: float, beta2: float, step_size: float, bias2_sqrt: float, eps: float, seed: int,
) -> None:
    """fastgrpo.kernels.adamw.adamw_step_ in eager torch: same arguments, same fp32 math and rounding rule."""
    p = param.float() * decay  # param.mul_(1 - lr * weight_decay)
    g = grad.float()
    m = exp_avg.float()
    m = m + (1.0 - beta1) * (g - m)  # exp_avg.lerp_(grad, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1.0 - beta2) * g * g  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, 1 - beta2)
    denom = v.sqrt() / bias2_sqrt + eps  # (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    p = p - step_size * (m / denom)  # param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    if param.dtype == torch.bfloat16:
        generator = torch.Generator(device=param.device).manual_seed(seed)
        bits = torch.randint(0, 1 << 16, (3, *p.shape), generator=generator, device=p.device, dtype=torch.int32)
        p, m, v = (round_bf16_stochastic(x, b) for x, b in zip((p, m, v), bits))
    param.copy_(p)
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)


def keeps_master(param: torch.Tensor) -> bool:
    """Whether param (a local tensor) steps an fp32 master copy instead of rounding stochastically: bf16 on the CPU."""
    return param.dtype == torch.bfloat16 and param.device.type == "cpu"


def adamw_step_master_(
    param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    step: torch.Tensor, *, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float,
    chunk: int = 1 << 20,
) -> None:
    """torch.optim.AdamW(fused=True)'s step on the fp32 master and moments (`step`, a CPU fp32 scalar, already
    counts this step), then param = master rounded to nearest. The grad is converted to fp32 `chunk` elements at a
    time into one reused buffer: an fp32 copy of the whole grad is fresh memory every step, and its page faults cost
    more than the conversion. A chunk that is a multiple of the SIMD width sends each element down the kernel's
    vector or scalar path as one call on the whole tensor would: the master equals torch's fused AdamW on an fp32
    copy bit for bit. master and the moments are contiguous (torch's fused CPU kernel walks the tensors' storage in
    order, so they and the grad chunk must share one layout); param and grad may have any layout."""
    grad = grad.reshape(-1)
    buffer = torch.empty(min(chunk, grad.numel()), dtype=torch.float32)
    flat = [t.view(-1) for t in (master, exp_avg, exp_avg_sq)]
    for start in range(0, grad.numel(), chunk):
        end = min(start + chunk, grad.numel())
        g = buffer[: end - start].copy_(grad[start:end])
        p, m, v = (t[start:end] for t in flat)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2,
                            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
    param.copy_(master)


@functools.cache
def _dtensor_type() -> type | tuple:
    """torch's DTensor class, or () where torch.distributed is not built in (isinstance(x, ()) is False)."""
    if not torch.distributed.is_available():
        return ()
    from torch.distributed.tensor import DTensor

    return DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank updates: the local shard of a DTensor (FSDP2), else the tensor itself."""
    return t.to_local() if isinstance(t, _dtensor_type()) else t


def _shard_coordinates(p: torch.Tensor) -> tuple[int, ...]:
    """This rank's coordinates along the mesh dimensions that shard p: replicas share bits, shards do not."""
    if not isinstance(p, _dtensor_type()):
        return ()
    coordinate = p.device_mesh.get_coordinate() or ()
    return tuple(c for c, placement in zip(coordinate, p.placements) if placement.is_shard())


def _kernel_fits(param, grad, exp_avg, exp_avg_sq) -> bool:
    """The Triton kernel takes contiguous tensors of its dtypes (fp64 stays in torch: the kernel computes in fp32),
    on CUDA or under the interpreter, as fastgrpo.ops choose."""
    tensors = (param, exp_avg, exp_avg_sq)
    return (
        use_triton(param, grad, exp_avg, exp_avg_sq)
        and param.dtype in KERNEL_DTYPES
        and all(t.is_contiguous() and t.dtype == param.dtype for t in tensors)
    )


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW (decoupled weight decay, bias correction, eps added after the square root) whose bf16
    parameters and moments are rounded stochastically, or (bf16 on the CPU) kept as fp32 masters.

    Per-parameter state, as state_dict() holds it: torch's step (a CPU fp32 scalar), exp_avg and exp_avg_sq, in the
    parameter's dtype as torch keeps them; for a bf16 parameter on the CPU the moments are fp32 and `master` (fp32,
    the parameter's shape) is added. The tensors are shaped like the parameter and are DTensors when it is one
    (FSDP2), so Distributed Checkpoint saves and reshards them. load_state_dict gives each parameter the layout of
    its own path, whatever path wrote the state: a state without master (torch's AdamW, or this optimizer on the
    GPU) takes the master from the parameter and its moments exactly in fp32; a master state loaded for a parameter
    off the CPU drops the master and rounds the moments to the parameter's dtype to nearest, as torch's load casts
    them. A torch AdamW checkpoint loads (amsgrad and maximize excepted); `seed` is a param-group entry like lr and
    travels with it."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, seed: int = 0):
        if not lr >= 0.0:
            raise ValueError(f"lr: must be >= 0, got {lr}")
        if not eps >= 0.0:
            raise ValueError(f"eps: must be >= 0, got {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas: each must be in [0, 1), got {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay: must be >= 0, got {weight_decay}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, seed=int(seed))
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        if not all(p.is_floating_point() for p in self.param_groups[-1]["params"]):
            raise ValueError("params: StochasticRoundingAdamW takes real floating-point parameters only")

    def __setstate__(self, state: dict) -> None:
        """After load_state_dict: groups saved by torch's AdamW get this optimizer's defaults for what they lack
        (seed); options it cannot honour are refused; step counters live on the CPU as torch keeps them when not
        fused (a fused AdamW's are on the GPU, and reading them there would sync every step)."""
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            unsupported = [key for key in ("amsgrad", "maximize") if group.get(key)]
            if unsupported:
                raise ValueError(f"state_dict: {', '.join(unsupported)} is not supported by StochasticRoundingAdamW")
        for param_state in self.state.values():
            if "step" in param_state:
                param_state["step"] = torch.as_tensor(param_state["step"], dtype=torch.float32).cpu()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating-point state to its parameter's dtype, then the fp32 states of
        parameters that keep a master taken again from the tensors as saved (see the class docstring)."""
        saved_ids = itertools.chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = itertools.chain.from_iterable(group["params"] for group in self.param_groups)
        saved = {p: state_dict["state"].get(i) for i, p in zip(saved_ids, params)}
        super().load_state_dict(state_dict)
        for p, src in saved.items():
            state = self.state.get(p)
            if not src or not state:
                continue
            if not keeps_master(_local(p)):
                state.pop("master", None)
                continue
            master = src["master"] if "master" in src else p.detach()
            state["master"] = master.to(dtype=torch.float32, device=p.device).contiguous()
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = src[key].to(dtype=torch.float32, device=p.device).contiguous()

    @staticmethod
    def _new_state(p: torch.Tensor) -> dict:
        """A parameter's state before its first step (torch's, plus an fp32 master where it keeps one)."""
        if not keeps_master(_local(p)):
            return dict(step=torch.tensor(0.0, dtype=torch.float32),
                        exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                        exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
        state = {"step": torch.tensor(0.0, dtype=torch.float32)}
        for key in ("master", "exp_avg", "exp_avg_sq"):
            state[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
        _local(state["master"]).copy_(_local(p))
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        first = 0
        for group in self.param_groups:
            # a parameter's index is its position in state_dict(): stable across save and load
            live = [(first + i, p) for i, p in enumerate(group["params"]) if p.grad is not None]
            first += len(group["params"])
            if live:
                self._step_group(group, live)
        return loss

    def _step_group(self, group: dict, live: list[tuple[int, torch.Tensor]]) -> None:
        """One step of a group's parameters that have a grad (with their indices): masters through torch's fused
        AdamW, tensors the kernel takes in one launch per step count (FSDP2 shards and plain tensors alike: the
        launch takes local tensors), the rest in eager torch. What is left per parameter is Python: ~11 us here and
        ~3 in the launcher on a 2-core x86 CPU, against ~35 us per tensor on the GPU host with a launch each."""
        for _, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("StochasticRoundingAdamW does not support sparse gradients")
            if not self.state[p]:
                self.state[p].update(self._new_state(p))
        states = [self.state[p] for _, p in live]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1)  # one call: 2.7 us per counter against 5.2 for `step += 1` (2-core x86 CPU)
        beta1, beta2 = group["betas"]
        lr, weight_decay = float(group["lr"]), group["weight_decay"]
        batches: dict[int, list[tuple]] = {}  # step -> the (param, grad, exp_avg, exp_avg_sq, seed) of its launch
        for (index, p), state, step in zip(live, states, [step.item() for step in steps]):
            if "master" in state:
                adamw_step_master_(*(_local(t) for t in (p, p.grad, state["master"], state["exp_avg"],
                                                         state["exp_avg_sq"])), state["step"], lr=lr,
                                   beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=group["eps"])
                continue
            step = int(step)
            tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            seed = step_seed(group["seed"], index, step, _shard_coordinates(p))
            if _kernel_fits(*tensors):
                batches.setdefault(step, []).append((*tensors, seed))
            else:
                adamw_step_torch_(*tensors, **_scalars(group, step), seed=seed)
        if not batches:
            return
        from fastgrpo.kernels.adamw import adamw_multi_tensor_step_

        for step, batch in batches.items():
            adamw_multi_tensor_step_(*(list(column) for column in zip(*batch)), **_scalars(group, step))


def _scalars(group: dict, step: int) -> dict[str, float]:
    """The step's scalars as fastgrpo.kernels.adamw.adamw_step_ takes them (the seed aside)."""
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    return dict(decay=1.0 - lr * group["weight_decay"], beta1=beta1, beta2=beta2, step_size=lr / (1.0 - beta1**step),
                bias2_sqrt=(1.0 - beta2**step) ** 0.5, eps=group["eps"])
