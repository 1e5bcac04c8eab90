"""Where a profiled window's GPU time goes, from a torch.profiler chrome trace: busy time per kernel category and
per annotated range, and the GPU's idle gaps with the host code that was late for each.

    python -m benchmarks.trace_gaps TRACE.json [--min-gap-us 10]     # a trace that export_chrome_trace wrote

A gap is time in which no kernel, copy or memset runs on any stream of the device. The kernel that ends it was
launched by the host either after the gap began ("host": the GPU waited for the host to issue work, e.g. Python
hooks, allocator calls, launch overhead) or before ("device": it waited on another stream or an event, e.g. a
collective that had not finished). Each gap is charged to the innermost CPU ranges (torch ops, FSDP's and the
caller's record_function labels) around that launch.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import json
import re
from pathlib import Path

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
RANGE_CATS = {"cpu_op", "user_annotation"}
# kernel name -> category: the first pattern that matches, case-insensitive
CATEGORIES = (
    ("nccl", r"nccl"),
    ("copy", r"^Memcpy|memcpy|^Memset|copy_kernel|CatArrayBatchedCopy|chunk_cat|split_with_sizes"),
    ("attention", r"flash|fmha|attention|sdpa|softmax"),
    ("gemm", r"gemm|sm90_xmma|sm80_xmma|cutlass|nvjet|cublas|matmul"),
    ("fused_loss", r"fused_linear|logprob|_grpo|_row_stats|_row_grad|logsumexp|\blse\b|log_softmax"),
    ("lora", r"lora"),
    ("norm_rope_mlp", r"rms|rope|rotary|swiglu|silu|geglu|_glu_"),
    ("optimizer", r"adam|foreach|multi_tensor"),
    ("elementwise", r"elementwise|vectorized|reduce|triton_"),
)
_PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in CATEGORIES]


def category(name: str) -> str:
    return next((c for c, p in _PATTERNS if p.search(name)), "other")


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0)


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint sorted ones (kernels of several streams may overlap)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


class Trace:
    def __init__(self, events: list[dict]):
        xs = [e for e in events if e.get("ph") == "X" and "ts" in e]
        self.device = sorted((e for e in xs if e.get("cat") in DEVICE_CATS), key=lambda e: e["ts"])
        self.launches = {e["args"]["correlation"]: e for e in xs
                         if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
        ranges = [e for e in xs if e.get("cat") in RANGE_CATS]
        # per host thread, ranges sorted by start (outer first on ties), each with its parent: they nest
        self.threads: dict = collections.defaultdict(list)
        for e in sorted(ranges, key=lambda e: (e["ts"], -e.get("dur", 0))):
            self.threads[(e["pid"], e["tid"])].append(e)
        self.parents, self.starts = {}, {}
        for key, events in self.threads.items():
            parents, open_ = [], []
            for i, e in enumerate(events):
                while open_ and _end(events[open_[-1]]) < e["ts"]:
                    open_.pop()
                parents.append(open_[-1] if open_ else None)
                open_.append(i)
            self.parents[key], self.starts[key] = parents, [e["ts"] for e in events]
        self.annotations = [e for e in ranges if e.get("cat") == "user_annotation"]

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls(json.loads(Path(path).read_text())["traceEvents"])

    def stack_at(self, launch: dict) -> list[str]:
        """Names of the CPU ranges enclosing a launch on its thread, outermost first."""
        key, t = (launch["pid"], launch["tid"]), launch["ts"]
        events, parents = self.threads.get(key, []), self.parents.get(key, [])
        i = bisect.bisect_right(self.starts.get(key, []), t) - 1  # the last range begun by t, or an ancestor
        while i is not None and i >= 0 and _end(events[i]) < t:
            i = parents[i]
        chain = []
        while i is not None and i >= 0:
            chain.append(events[i]["name"])
            i = parents[i]
        return chain[::-1]

    def window(self, name: str | None = None) -> tuple[float, float]:
        """The span of the user annotation `name` (the last one so named), or of all device work."""
        if name is not None:
            marks = [e for e in self.annotations if e["name"] == name]
            if not marks:
                raise ValueError(f"window: no record_function range named {name!r} in the trace")
            return marks[-1]["ts"], marks[-1]["ts"] + marks[-1]["dur"]
        return self.device[0]["ts"], max(e["ts"] + e["dur"] for e in self.device)

    def summary(self, window: tuple[float, float], min_gap_us: float = 10.0, top: int = 12) -> dict:
        start, end = window
        work = [e for e in self.device if start <= e["ts"] < end]
        busy = union([(e["ts"], min(e["ts"] + e["dur"], end)) for e in work])
        busy_us = sum(e - s for s, e in busy)
        per_cat: collections.Counter = collections.Counter()
        per_kernel: collections.Counter = collections.Counter()
        for e in work:
            per_cat[category(e["name"])] += e["dur"]
            per_kernel[e["name"][:90]] += e["dur"]
        # compute streams: busy time without the streams that run only collectives (they overlap compute)
        streams = collections.defaultdict(set)
        for e in work:
            streams[e["args"].get("stream")].add("nccl" in e["name"].lower())
        nccl_streams = {stream for stream, kinds in streams.items() if kinds == {True}}
        compute = union([(e["ts"], min(e["ts"] + e["dur"], end)) for e in work
                          if e["args"].get("stream") not in nccl_streams])
        gaps = collections.Counter()
        kinds = collections.Counter()
        edges = [start] + [x for iv in busy for x in iv] + [end]
        by_start = {}  # the first kernel to start at each time (another stream's may start in the same us)
        for e in work:
            by_start.setdefault(e["ts"], e)
        for gap_start, gap_end in zip(edges[0::2], edges[1::2]):
            if gap_end - gap_start < min_gap_us:
                continue
            nxt = by_start.get(gap_end)
            launch = self.launches.get(nxt["args"].get("correlation")) if nxt else None
            if launch is None:
                kinds["unattributed"] += gap_end - gap_start
                gaps[("(no launch found)",)] += gap_end - gap_start
                continue
            kind = "host" if launch["ts"] > gap_start else "device"
            kinds[kind] += gap_end - gap_start
            stack = self.stack_at(launch)
            labels = [s for s in stack if not s.startswith("aten::") and not s.startswith("cuda")]
            gaps[(kind, " > ".join(labels[-2:]) or "-", stack[-1] if stack else launch["name"])] += gap_end - gap_start
        ms = 1e-3
        return {
            "wall_ms": (end - start) * ms, "busy_ms": busy_us * ms,
            "compute_busy_ms": sum(e - s for s, e in compute) * ms,
            "idle_ms": (end - start - busy_us) * ms, "idle_host_ms": kinds["host"] * ms,
            "idle_device_ms": kinds["device"] * ms,
            "categories_ms": {k: v * ms for k, v in per_cat.most_common()},
            "top_kernels_ms": [(k, v * ms) for k, v in per_kernel.most_common(top)],
            "top_gaps_ms": [(" | ".join(k), v * ms) for k, v in gaps.most_common(top)],
            "kernels": len(work),
        }


def print_summary(title: str, s: dict) -> None:
    print(f"--- {title}: wall {s['wall_ms']:.1f} ms, GPU busy {s['busy_ms']:.1f} (compute streams "
          f"{s['compute_busy_ms']:.1f}), idle {s['idle_ms']:.1f} (host late {s['idle_host_ms']:.1f}, waiting on "
          f"the device {s['idle_device_ms']:.1f}), {s['kernels']} kernels")
    print("    by category (ms, streams summed): " + ", ".join(f"{k} {v:.1f}" for k, v in s["categories_ms"].items()))
    for name, v in s["top_kernels_ms"]:
        print(f"    {v:9.2f} ms  {name}")
    print("    idle gaps by the launch that ended them (kind | enclosing labels | innermost op):")
    for name, v in s["top_gaps_ms"]:
        print(f"    {v:9.2f} ms  {name}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--window", help="a record_function name: summarize its span (default: all device work)")
    parser.add_argument("--min-gap-us", type=float, default=10.0)
    args = parser.parse_args(argv)
    trace = Trace.load(args.trace)
    print_summary(args.window or "trace", trace.summary(trace.window(args.window), args.min_gap_us))


if __name__ == "__main__":
    main()
