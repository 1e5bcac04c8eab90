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
takes in one launch (one per device, step count, param and grad dtype, and 16-byte alignment): a launch per tensor cost ~35 us of host time each, and
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

import dataclasses
import functools
import itertools

import torch

from fastgrpo._device import on_device
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


def _int64(x: int) -> int:
    """A 64-bit pattern as the int64 that holds it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of the uint64 patterns that int64 x holds (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """_splitmix64 on the uint64 patterns an int64 tensor holds (adds and multiplies wrap modulo 2^64 alike)."""
    x = x + _int64(0x9E3779B97F4A7C15)
    x = (x ^ _shift_right(x, 30)) * _int64(0xBF58476D1CE4E5B9)
    x = (x ^ _shift_right(x, 27)) * _int64(0x94D049BB133111EB)
    return x ^ _shift_right(x, 31)


def step_seeds(prefixes: torch.Tensor, step: int, shards: torch.Tensor) -> torch.Tensor:
    """step_seed for many parameters at one step, in a few tensor ops: prefixes (int64 [n]) are step_key_prefix of
    each (seed, index); shards (int64 [n, k]) their shard coordinates as step_seed uses them (an all-zero tuple
    dropped), padded with -1 (no coordinate is negative)."""
    key = _splitmix64_tensor(prefixes ^ _int64(step))
    for column in shards.unbind(1):
        key = torch.where(column >= 0, _splitmix64_tensor(key ^ column), key)
    return _shift_right(key, 2) | (1 << 62)


def step_key_prefix(seed: int, index: int) -> int:
    """step_seed's key after (seed, index), as an int64: what does not change from step to step."""
    return _int64(_splitmix64(_splitmix64(seed & _MASK64) ^ (index & _MASK64)))


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
    """The tensor this rank updates: the local shard of a DTensor (FSDP2), else the tensor itself. What to_local()
    returns under no_grad, where the optimizer runs, without the fresh view it makes of a parameter's (~2 us)."""
    return t._local_tensor if isinstance(t, _dtensor_type()) else t


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

    Per-parameter state, as state_dict() holds it: torch's step (a CPU fp32 scalar: a view of one counter tensor
    per param group, so that a step counts all in one op), exp_avg and exp_avg_sq, in the parameter's dtype as
    torch keeps them; for a bf16 parameter on the CPU the moments are fp32 and `master` (fp32, the parameter's
    shape) is added. The tensors are shaped like the parameter and are DTensors when it is one
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
        self._plans: dict[int, _Plan] = {}  # id(param group) -> its step's plan
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
        self._plans = {}
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
                with on_device(live[0][1].device):  # the kernel launches on the current device
                    self._step_group(group, live)
        return loss

    def _step_group(self, group: dict, live: list[tuple[int, torch.Tensor]]) -> None:
        """One step of a group's parameters that have a grad (with their indices): masters through torch's fused
        AdamW, tensors the kernel takes in one launch per step count, dtypes and alignment (FSDP2 shards and plain
        tensors alike: the launch takes local tensors), the rest in eager torch. What is decided per parameter is
        kept in a _Plan and reused while the same parameters have grads and nothing the plan read has changed: what
        is left per parameter is the check and the grad's address. 338 tensors (Qwen2.5-1.5B's shapes / 256, fp32,
        kernel launch stubbed, 2-core x86 CPU): 1.15 ms of host time per step, 4.4-4.6 ms before plans."""
        params = [p for _, p in live]
        grads = [p.grad for p in params]
        plan = self._plans.get(id(group))
        if plan is None or not plan.holds(group, live, grads, self.state):
            # a removed group's plan would keep its states alive
            self._plans = {key: kept for key, kept in self._plans.items()
                           if any(kept.group is g for g in self.param_groups)}
            plan = self._plans[id(group)] = self._plan(group, live)
        plan.counters += 1  # every live parameter's `step`, a view of this one tensor
        plan.expected.copy_(plan.counters)
        plan.steps += 1
        beta1, beta2 = group["betas"]
        lr, weight_decay = float(group["lr"]), group["weight_decay"]
        for i in plan.masters:
            p, state = params[i], plan.states[i]
            adamw_step_master_(*(_local(t) for t in (p, grads[i], state["master"], state["exp_avg"],
                                                     state["exp_avg_sq"])), state["step"], lr=lr, beta1=beta1,
                               beta2=beta2, weight_decay=weight_decay, eps=group["eps"])
        for i in plan.eager:
            step, state = int(plan.counters[i]), plan.states[i]
            adamw_step_torch_(*(_local(t) for t in (params[i], grads[i], state["exp_avg"], state["exp_avg_sq"])),
                              **_scalars(group, step),
                              seed=step_seed(group["seed"], live[i][0], step, _shard_coordinates(params[i])))
        if not plan.launches:
            return
        from fastgrpo.kernels import adamw as kernels

        for launch in plan.launches:
            step = launch.first_step + plan.steps
            local_grads = [_local(grads[i]) for i in launch.positions]
            # a copy, if any, lives in local_grads until the kernel is queued
            local_grads = [g if g.is_contiguous() else g.contiguous() for g in local_grads]
            rows = launch.rows
            rows[:, 1] = torch.tensor([g.data_ptr() for g in local_grads], dtype=torch.int64)
            rows[:, 5] = step_seeds(launch.prefixes, step, launch.shards)
            aligned = launch.aligned & (rows[:, 1] % 16 == 0)
            parts = [(rows, True)] if aligned.all() else [(rows[aligned], True), (rows[~aligned], False)]
            for part, is_aligned in parts:
                if len(part):
                    kernels.adamw_multi_tensor_launch_(part, launch.device, launch.p_dtype, launch.g_dtype,
                                                       is_aligned, **_scalars(group, step))

    def _plan(self, group: dict, live: list[tuple[int, torch.Tensor]]) -> _Plan:
        """What a step of these live parameters does, decided per parameter (the code path, the launch, the
        table's fixed columns); their states made if new, and their step counters moved into one tensor."""
        for _, p in live:
            if p.grad.is_sparse:
                raise RuntimeError("StochasticRoundingAdamW does not support sparse gradients")
            if not self.state[p]:
                self.state[p].update(self._new_state(p))
        params = [p for _, p in live]
        states = [self.state[p] for p in params]
        counters = torch.tensor([float(state["step"]) for state in states], dtype=torch.float32)
        for i, state in enumerate(states):
            state["step"] = counters[i]  # a 0-d fp32 CPU tensor, as torch keeps it: state_dict() is unchanged
        masters, eager, launches = [], [], {}
        for i, ((index, p), state) in enumerate(zip(live, states)):
            if "master" in state:
                masters.append(i)
                continue
            tensors = [_local(t) for t in (p, p.grad, state["exp_avg"], state["exp_avg_sq"])]
            if not _kernel_fits(*tensors) or tensors[0].numel() == 0:
                if tensors[0].numel():
                    eager.append(i)
                continue
            local, _, m, v = tensors
            shard = _shard_coordinates(p)
            row = [local.data_ptr(), 0, m.data_ptr(), v.data_ptr(), local.numel(), 0]
            key = (local.device, local.dtype, p.grad.dtype, int(counters[i]))
            launches.setdefault(key, []).append((i, row, step_key_prefix(group["seed"], index),
                                                 shard if any(shard) else (), (row[0] | row[2] | row[3]) % 16 == 0))
        return _Plan(
            group=group, seed=group["seed"], state_map=self.state, live=[(index, id(p)) for index, p in live],
            states=states, counters=counters, expected=counters.clone(),
            fingerprint=_fingerprint(params, [p.grad for p in params], states), masters=masters, eager=eager,
            launches=_launches(launches),
        )


def _launches(grouped: dict[tuple, list[tuple]]) -> list[_Launch]:
    """(device, param dtype, grad dtype, step) -> [(position, table row, key prefix, shard coordinates, aligned)]
    as _plan collects them -> one _Launch each, the coordinates padded with -1 to the longest."""
    width = max((len(item[3]) for items in grouped.values() for item in items), default=0)
    return [_Launch(
        positions=[item[0] for item in items], rows=torch.tensor([item[1] for item in items]),
        prefixes=torch.tensor([item[2] for item in items], dtype=torch.int64),
        shards=torch.tensor([list(item[3]) + [-1] * (width - len(item[3])) for item in items],
                            dtype=torch.int64).reshape(len(items), width),
        aligned=torch.tensor([item[4] for item in items]), device=device, p_dtype=p_dtype, g_dtype=g_dtype,
        first_step=step,
    ) for (device, p_dtype, g_dtype, step), items in grouped.items()]


def _fingerprint(params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict]) -> list[tuple]:
    """What a _Plan read from each parameter, its grad and its state, that may change under it: addresses, shape,
    dtypes, the grad's layout (sparse grads are refused when planning) and device (a DTensor grad's local shard may
    move), the state's step counter."""
    return [(_local(p).data_ptr(), p.dtype, p.shape, g.dtype, g.layout, _local(g).device,
             _local(s["exp_avg"]).data_ptr(), _local(s["exp_avg_sq"]).data_ptr(), "master" in s, id(s["step"]))
            for p, g, s in zip(params, grads, states)]


@dataclasses.dataclass(eq=False)
class _Launch:
    """One kernel launch of a plan (one per device, param dtype, grad dtype, step count; split by 16-byte alignment
    when a grad's address breaks it): rows as adamw_multi_tensor_launch_ takes them, grad address and seed filled in
    each step; the Philox key prefixes and shard coordinates step_seeds takes; whether param and moments align."""

    positions: list[int]
    rows: torch.Tensor  # [tensors, 6] int64
    prefixes: torch.Tensor  # [tensors] int64
    shards: torch.Tensor  # [tensors, k] int64, -1 padded
    aligned: torch.Tensor  # [tensors] bool
    device: torch.device
    p_dtype: torch.dtype
    g_dtype: torch.dtype
    first_step: int  # the tensors' step count when planned: a step of the plan counts first_step + plan.steps


@dataclasses.dataclass(eq=False)
class _Plan:
    """A param group's step for one set of live parameters. Valid while the optimizer's state is the same object
    (load_state_dict replaces it), the same parameters have grads and their fingerprints are unchanged."""

    group: dict
    seed: int
    state_map: dict
    live: list[tuple[int, int]]  # (index, id) of each live parameter
    states: list[dict]
    counters: torch.Tensor  # [live] fp32: the live parameters' `step` states are views of it
    expected: torch.Tensor  # what counters held after the plan's last step: an in-place write (dcp.load) differs
    fingerprint: list[tuple]
    masters: list[int]
    eager: list[int]
    launches: list[_Launch]
    steps: int = 0  # steps taken with this plan

    def holds(self, group: dict, live: list[tuple[int, torch.Tensor]], grads: list[torch.Tensor],
              state_map: dict) -> bool:
        # the plan holds the states (and so the counters), and the state map's keys hold the parameters: their ids
        # are not reused while it lives
        return (group is self.group and group["seed"] == self.seed and state_map is self.state_map
                and [(index, id(p)) for index, p in live] == self.live
                and all(state_map.get(p) is state for (_, p), state in zip(live, self.states))
                and torch.equal(self.counters, self.expected)
                and _fingerprint([p for _, p in live], grads, self.states) == self.fingerprint)


def _scalars(group: dict, step: int) -> dict[str, float]:
    """The step's scalars as fastgrpo.kernels.adamw.adamw_step_ takes them (the seed aside)."""
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    return dict(decay=1.0 - lr * group["weight_decay"], beta1=beta1, beta2=beta2, step_size=lr / (1.0 - beta1**step),
                bias2_sqrt=(1.0 - beta2**step) ** 0.5, eps=group["eps"])
