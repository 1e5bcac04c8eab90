"""What holds the GPU memory at the peak of one GRPO training step: live allocations grouped by source line.

    python -m benchmarks.profile_memory --system fastgrpo --length 8192 --micro-batch 8

Builds the step of benchmarks/e2e.py, runs it once (optimizer state, compiled kernels), then records the CUDA
allocator's history over a second step, replays it to find the moment of the highest allocated total and prints the
allocations alive then, grouped by the innermost Python frames in fastgrpo / transformers / peft / torch code.
Allocations made in C++ (autograd's gradient buffers) show under the Python line that started the backward.
The recorded step runs with checkpoint early stop off: with history recording on, the exception that stops a
recompute early came back as "SystemError: ... returned NULL without setting an exception" (torch 2.11, H200).
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from benchmarks.common import GIB, require_cuda
from benchmarks.e2e import StepSetup, make_step

_OURS = ("/fastgrpo/", "/transformers/", "/peft/", "/torch/utils/checkpoint", "/torch/nn/", "/benchmarks/")


def _where(frames: list[dict], depth: int) -> str:
    picked = [f for f in frames if any(part in f["filename"] for part in _OURS)][:depth]
    return " <- ".join(f"{f['filename'].rsplit('/site-packages/', 1)[-1]}:{f['line']} {f['name']}" for f in picked)


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """Replay alloc / free events: the highest total above the start and the allocations alive at that moment."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: dict[int, dict] = {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b")
    parser.add_argument("--system", default="fastgrpo")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--depth", type=int, default=2, help="Python frames per group")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--first", action="store_true", help="record the first step (what bench_context measures)")
    parser.add_argument("--stacks", default="python", choices=["python", "all"], help="'all' adds C++ frames")
    args = parser.parse_args()
    require_cuda(parser, cpu_check=None)

    setup = StepSetup(model_name=args.model, system=args.system, completion_length=args.length,
                      micro_batch_size=args.micro_batch)
    step = make_step(setup)
    if not args.first:
        step()
        torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks=args.stacks)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    peak, at_peak = live_at_peak(snapshot["device_traces"][0])
    tokens = args.micro_batch * (setup.prompt_length + args.length)
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in at_peak.values():
        group = groups[_where(event["frames"], args.depth) or "(no Python frame)"]
        group[0] += event["size"]
        group[1] += 1
    print(f"{setup.system} {setup.model_name} micro-batch {args.micro_batch} x {setup.prompt_length}+{args.length} "
          f"tokens: before the step {base / GIB:.2f} GiB, peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB "
          f"(replayed: +{peak / GIB:.2f} GiB, {peak / tokens / 1024:.1f} KiB per token of a micro-batch)")
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{size / GIB:8.3f} GiB {size / tokens / 1024:7.1f} KiB/token {count:5d}x  {where}")


if __name__ == "__main__":
    main()
