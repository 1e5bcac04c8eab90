"""One StochasticRoundingAdamW step on bf16 weights, its kernel launched once per tensor (as before issue 18) or once
for all (the multi-tensor kernel), against torch.optim.AdamW(fused=True) (bf16 states, rounding to nearest).

    python -m benchmarks.bench_adamw                # a GPU: both shape sets x 3 cases (~30 s on an H100)
    python -m benchmarks.bench_adamw --dry-run      # CPU check: shapes / 256 in fp32 under TRITON_INTERPRET=1

Shape sets: Qwen2.5-1.5B's 338 parameter tensors (the HF model built on the meta device from benchmarks.common's
config: tied embedding, q/k/v biases, norms; 1.54B elements) and 256 tensors of 1536 x 1536 (604M elements).
Cases: `per_tensor` (the optimizer with its launcher replaced by one adamw_step_ per tensor: the old launches, the
new Python around them), `multi_tensor` (the optimizer as it is), `torch_fused`. Random weights and grads, the same
grads every step. Per case: --warmup steps (Triton compiles), then --steps steps, each after a synchronize, timed
by CUDA events around step() (gpu_ms: the step's wall time on the device, host gaps included: a host-bound step
shows here) and by the host clock until step() returns (host_ms: what the CPU spends, the time FSDP2's next
forward waits); medians. gbps: 14 bytes per element (param, moments read and written, grad read) / gpu_ms.
Writes benchmarks/results/adamw-<card>.json (the dry run: into a temp dir).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.common import QWEN25_15B, print_table, require_cuda, write_results

CASES = ("per_tensor", "multi_tensor", "torch_fused")
SHAPE_SETS = ("qwen2.5-1.5b", "square-256")
LR = 1e-5
COLUMNS = ["shapes", "tensors", "elements", "case", "gpu_ms", "host_ms", "gbps", "x_fused"]


def shapes(name: str, scale: int = 1) -> list[tuple[int, ...]]:
    """The parameter shapes of a shape set, each dimension divided by `scale` (the dry run's stand-ins)."""
    if name == "square-256":
        found = [(1536, 1536)] * 256
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        with torch.device("meta"):
            found = [tuple(p.shape) for p in Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B)).parameters()]
    return [tuple(max(1, d // scale) for d in shape) for shape in found]


def _one_launch_per_tensor(opt, params: list[torch.nn.Parameter]):
    """adamw_multi_tensor_launch_'s signature, the per-tensor kernel behind it: each table row's tensors found again
    by their addresses (the params, their grads and the optimizer's moments), then one adamw_step_ each."""
    from fastgrpo.kernels.adamw import adamw_step_

    tensors: dict[int, torch.Tensor] = {}

    def launch(rows, device, p_dtype, g_dtype, aligned, **scalars) -> None:
        for p, g, m, v, _, seed in rows.tolist():
            if m not in tensors:
                tensors.clear()
                for param in params:
                    state = opt.state[param]
                    tensors.update({t.data_ptr(): t for t in (param, param.grad, state["exp_avg"],
                                                              state["exp_avg_sq"])})
            adamw_step_(tensors[p], tensors[g], tensors[m], tensors[v], **scalars, seed=seed)

    return launch


def make_case(case: str, params: list[torch.nn.Parameter]):
    """(the optimizer, the context its steps run in)."""
    from fastgrpo.train.stochastic_adamw import StochasticRoundingAdamW

    if case == "torch_fused":
        return torch.optim.AdamW(params, lr=LR, fused=True), contextlib.nullcontext()
    opt = StochasticRoundingAdamW(params, lr=LR)
    if case == "multi_tensor":
        return opt, contextlib.nullcontext()
    return opt, mock.patch("fastgrpo.kernels.adamw.adamw_multi_tensor_launch_", _one_launch_per_tensor(opt, params))


def time_steps(step, warmup: int, steps: int, device: str) -> tuple[float, float]:
    """Median (device ms, host ms) of one step; on the CPU both are the host clock."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    on_device, on_host = [], []
    for i in range(warmup + steps):
        sync()
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - t0) * 1e3
        if device == "cuda":
            end.record()
            end.synchronize()
        if i >= warmup:
            on_host.append(host_ms)
            on_device.append(start.elapsed_time(end) if device == "cuda" else host_ms)
    return statistics.median(on_device), statistics.median(on_host)


def run_set(name: str, args, device: str, dtype: torch.dtype) -> list[dict]:
    gen = torch.Generator(device=device).manual_seed(0)
    set_shapes = shapes(name, args.scale)
    params = []
    for shape in set_shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype))
        p.grad = (torch.randn(shape, generator=gen, device=device) * 1e-3).to(dtype)
        params.append(p)
    elements = sum(p.numel() for p in params)
    rows = []
    for case in args.cases.split(","):
        opt, context = make_case(case, params)
        with context:
            gpu_ms, host_ms = time_steps(opt.step, args.warmup, args.steps, device)
        rows.append(dict(shapes=name, tensors=len(params), elements=elements, case=case, gpu_ms=gpu_ms,
                         host_ms=host_ms, gbps=14 * elements / gpu_ms / 1e6))
        del opt
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    fused = next((r["gpu_ms"] for r in rows if r["case"] == "torch_fused"), None)
    for row in rows:
        row["x_fused"] = row["gpu_ms"] / fused if fused else None
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPE_SETS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU: shapes / 256, fp32 (bf16 on the CPU steps fp32 masters, not the kernel), 1 step")
    args = parser.parse_args(argv)
    for value, known, flag in ((args.shapes, SHAPE_SETS, "--shapes"), (args.cases, CASES, "--cases")):
        unknown = set(value.split(",")) - set(known)
        if unknown:
            raise SystemExit(f"{flag}: expected names from {','.join(known)}, got {','.join(sorted(unknown))}")
    if not args.dry_run:
        require_cuda(parser)
    args.scale, device, dtype, directory = 1, "cuda", torch.bfloat16, None
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before fastgrpo's kernels are imported (in make_case)
        args.scale, args.steps, args.warmup, device, dtype = 256, 1, 1, "cpu", torch.float32
        directory = Path(tempfile.mkdtemp(prefix="bench-adamw-"))
    rows = [row for name in args.shapes.split(",") for row in run_set(name, args, device, dtype)]
    config = {"dtype": str(dtype), "lr": LR, "steps": args.steps, "warmup": args.warmup, "scale": args.scale,
              "timing": "median of steps, each after a synchronize: CUDA events around step() and the host clock"}
    print(f"wrote {write_results('adamw', rows, config, directory)}")
    print_table(rows, COLUMNS)


if __name__ == "__main__":
    main()
