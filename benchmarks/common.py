"""Shared measurement and reporting for the GPU benchmark suites.

Every suite times with CUDA events (triton.testing.do_bench, median) after warm-up, measures peak memory above
what was allocated before the case, and writes one JSON file per suite and card to benchmarks/results/.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import itertools
import json
import math
import os
import platform
import re
import tempfile
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"
GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class RolloutSizes:
    """The rollout the rollout benchmarks time (bench_rollout's setting): prompts x generations rows, prompts of
    prompt_len tokens, new_tokens generated; each benchmark adds its own fields."""

    prompts: int = 8
    generations: int = 8
    prompt_len: int = 256
    new_tokens: int = 1024

    @property
    def rows(self) -> int:
        return self.prompts * self.generations

# Shapes of the public checkpoints; the suites use random weights (no model hub on the GPU machine).
QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
    vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
)
LLAMA31_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=5e5, rms_norm_eps=1e-5,
)


def card_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "triton", "transformers", "peft", "liger-kernel", "trl", "bitsandbytes", "fastgrpo"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


GRAPH_CALLS = 20  # kernel calls per CUDA graph in kernel_us


def kernel_us(calls: list, device: str) -> float:
    """Microseconds per call of the kernel each of `calls` runs (one per copy of its inputs, taken in turn: a
    decode step reads each weight or cache from HBM, not from L2). On CUDA, kernel time: GRAPH_CALLS calls captured
    in one CUDA graph, after warm-up calls outside it (compiles, cuBLAS's workspace), the replay's median (do_bench)
    divided by GRAPH_CALLS; called from Python outside a graph, a Triton launch's ~35 us of host time exceeds a
    64-row GEMM. Elsewhere (dry run) the wall time of one eager call after one warm-up call (compiles): a dry run
    checks the code, and under Triton's interpreter each call of a decode shape takes seconds."""
    if device != "cuda":
        calls[0]()
        start = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - start) * 1e6
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(GRAPH_CALLS):
            calls[i % len(calls)]()
    return triton.testing.do_bench(graph.replay, warmup=10, rep=50, return_mode="median") * 1e3 / GRAPH_CALLS



def timed_row(row: dict, us: float, nbytes: int, bandwidth: float | None, **checks) -> dict:
    """A kernel benchmark's row with its time: us, GB/s for the `nbytes` it must move, the checks given, and the share
    of the copy bandwidth where measured; printed as one line as it is measured (a sweep's progress)."""
    row.update(us=us, gb_s=nbytes / us / 1e3, **checks)
    if bandwidth:
        row["bw_share"] = nbytes / (us * 1e-6) / bandwidth
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    return row


def failed_row(row: dict, err: Exception) -> dict:
    """A kernel benchmark's row for a case that did not run (a tile past the card's shared memory, say): its error."""
    return row | {"error": f"{type(err).__name__}: {str(err)[:120]}"}

def copies_past_l2(nbytes: int, device) -> int:
    """How many copies of a kernel's inputs (`nbytes` each) kernel_us should take in turn so that together they pass
    3x the device's L2 (every call then reads from HBM, as a decode step does): at most GRAPH_CALLS, 1 off CUDA."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return min(GRAPH_CALLS, max(1, math.ceil(3 * l2 / nbytes)))


def measure(fn, *, warmup_ms: int = 100, rep_ms: int = 500) -> dict[str, float]:
    """Median ms of fn() and its peak memory above the memory allocated before it (GiB).

    Returns {"ms": None, "peak_gib": None, "oom": True} when the case runs out of memory.
    """
    import triton.testing

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        fn()  # first call: compile / autotune, and the peak of one call
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / GIB
        ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return {"ms": None, "peak_gib": None, "oom": True}
    return {"ms": ms, "peak_gib": peak, "oom": False}


def measure_step(benchmark, make_step, tokens: int, on_warmup=None) -> dict:
    """One training-step case of a pytest-benchmark suite: build the step (make_step()), one warm-up call (kernels
    compiled, optimizer state allocated), then 3 synchronized calls timed by `benchmark`. Returns {ms, peak_gib,
    tokens_per_s} (plus on_warmup(the warm-up's return value), e.g. its loss); a case that runs out of memory or
    breaks returns ms / peak_gib None with oom or error, so a failing baseline is reported in its row, not lost.
    The step is freed before returning."""
    gc.collect()
    torch.cuda.empty_cache()
    try:
        return _timed_step(benchmark, make_step, tokens, on_warmup)
    except torch.OutOfMemoryError:
        return {"ms": None, "peak_gib": None, "oom": True}
    except Exception as error:  # noqa: BLE001 - reported in the row
        return {"ms": None, "peak_gib": None, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def _timed_step(benchmark, make_step, tokens: int, on_warmup) -> dict:
    step = make_step()
    torch.cuda.reset_peak_memory_stats()
    first = step()
    torch.cuda.synchronize()

    def synced_step():
        step()
        torch.cuda.synchronize()

    benchmark.pedantic(synced_step, rounds=3, iterations=1, warmup_rounds=0)
    ms = benchmark.stats.stats.median * 1e3
    out = {"ms": ms, "peak_gib": torch.cuda.max_memory_allocated() / GIB, "tokens_per_s": tokens / ms * 1e3}
    return {**out, **(on_warmup(first) if on_warmup else {})}


# per results file: the runs it held before this process first wrote it (a suite may write after every row)
_EARLIER_RUNS: dict[Path, list[dict]] = {}


def write_results(suite: str, rows: list[dict], config: dict | None = None, directory: Path | None = None) -> Path:
    """Write rows (one dict per measured case) with the card and library versions into `directory` (default
    RESULTS_DIR; dry runs pass a temp dir); returns the path. What the file held before this process first wrote it
    is kept under "earlier_runs" (oldest first): a run on the same card adds to the record, it does not replace it."""
    directory = RESULTS_DIR if directory is None else directory
    directory.mkdir(parents=True, exist_ok=True)
    card = card_name()
    slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
    path = directory / f"{suite}-{slug}.json"
    if path not in _EARLIER_RUNS:
        _EARLIER_RUNS[path] = earlier_runs(path)
    payload = {
        "suite": suite,
        "card": card,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "config": config or {},
        "rows": rows,
        "earlier_runs": _EARLIER_RUNS[path],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def earlier_runs(path: Path) -> list[dict]:
    """The runs a results file records, oldest first: its own earlier_runs, then the run it holds (date, versions,
    config, rows); none for a file that is not there. A file that is not JSON is moved aside, not overwritten, and
    the record names where it went."""
    if not path.exists():
        return []
    try:
        held = json.loads(path.read_text())
    except json.JSONDecodeError:
        aside = path.with_name(f"{path.name}.unreadable-{datetime.datetime.now():%Y%m%d-%H%M%S}")
        path.rename(aside)
        return [{"unreadable_file_moved_to": aside.name}]
    return [*held.get("earlier_runs", []), {key: held[key] for key in ("date", "versions", "config", "rows")
                                            if key in held}]


def listed(parser, flag: str, value: str, allowed) -> list[str]:
    """The comma-separated names of a command-line flag, each one of `allowed`; else the parser's error naming the
    flag, the unknown names and the choices."""
    names = value.split(",")
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; expected some of {', '.join(allowed)}")
    return names


def positive_ints(parser, flag: str, text: str) -> list[int]:
    """The comma-separated positive integers of a command-line flag; else the parser's error naming the flag."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = [0]
    if any(v < 1 for v in values):
        parser.error(f"{flag}: expected positive integers, comma-separated; got {text!r}")
    return values


def require_cuda(parser, cpu_check: str | None = "--dry-run") -> None:
    """A GPU run started without CUDA: the parser's one line before anything runs or is written (the scripts failed
    on their first CUDA tensor with a traceback; profile_rollout wrote results/rollout_profile-cpu.json)."""
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (torch.cuda.is_available() is False)"
                     + (f"; {cpu_check} checks its code on the CPU" if cpu_check else ""))


def check_interpreted(parser, dry_run: bool) -> None:
    """--dry-run runs the Triton kernels on the CPU, which needs Triton's interpreter on from the start."""
    if dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run: run with TRITON_INTERPRET=1 (the kernels in Triton's interpreter)")


def refuse_script_run(path: str) -> None:
    """`python -m benchmarks.<suite>` of a pytest suite (which ran nothing and exited 0): how to run it instead."""
    suite = Path(path).resolve().relative_to(Path(__file__).resolve().parents[1])
    raise SystemExit(f"{suite} is a pytest suite, not a script: run python -m pytest {suite} -q -s")


def fastest(rows: list[dict], fields: tuple[str, ...], count: int) -> list[dict]:
    """The `count` fastest ("us") of each group of rows alike in `fields`, groups in sorted order; rows that failed
    ("error") left out: a sweep's table of its best configs."""
    key = lambda r: tuple(r[f] for f in fields)  # noqa: E731
    timed = sorted((r for r in rows if "error" not in r), key=key)
    return [r for _, group in itertools.groupby(timed, key) for r in sorted(group, key=lambda r: r["us"])[:count]]


def print_table(rows: list[dict], columns: list[str]) -> None:
    """A plain fixed-width table, printed last by each suite so the device reply shows it."""
    def fmt(v):
        if v is None:
            return "-"
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]  # rows may be none
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def run_cases(suite: str, cases, measure, config: dict, dry_run: bool) -> tuple[list[dict], list[dict]]:
    """Today's rows and the sweep's rows of every case (measure(*case) -> (rows, swept)), under no_grad. The results
    file is rewritten after each case, so a case that fails keeps those before it; a dry run writes to a temporary
    folder."""
    directory = Path(tempfile.mkdtemp()) if dry_run else None
    rows, swept = [], []
    with torch.no_grad():
        for case in cases:
            done, done_sweep = measure(*case)
            rows, swept = rows + done, swept + done_sweep
            path = write_results(suite, rows + swept, config, directory)
    print(f"wrote {path}")
    return rows, swept


def print_sweep_report(rows: list[dict], swept: list[dict], show_sweep: bool, group: tuple[str, ...], best_shown: int,
                       sweep_columns: list[str], columns: list[str]) -> None:
    """With show_sweep, the sweep's best_shown fastest of each group first; then today's rows, last, so the device
    reply shows them."""
    if show_sweep:
        print_table(fastest(swept, group, best_shown), sweep_columns)
        print()
    print_table(rows, columns)


def eager_grpo_loss(d: dict, beta: float, softcap: float | None = None) -> torch.Tensor:
    """The eager baseline of the fused-loss suites: fp32 logits [B, T, V] of d["hidden"] @ d["weight"].T (soft-capped
    as HF does when softcap is given), log_softmax, and the token-level bnpo GRPO loss with old and ref log-probs."""
    from fastgrpo.loss.grpo import aggregation_weights, grpo_per_token_loss

    logits = torch.nn.functional.linear(d["hidden"], d["weight"]).float()  # logits: [B, T, V] fp32
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logps = torch.log_softmax(logits, -1).gather(-1, d["targets"][..., None]).squeeze(-1)
    per_token, *_ = grpo_per_token_loss(logps, d["mask"], d["advantages"], d["old"], d["ref"], beta=beta)
    return (per_token * aggregation_weights(d["mask"], "bnpo")).sum()
