"""Useful tokens/s of the built-in rollout engine when rows stop at different lengths, per EngineConfig.finished_rows.

    python -m benchmarks.bench_rollout_lengths             # GPU: Qwen2.5-1.5B shapes, the DEFAULT_MODES
    python -m benchmarks.bench_rollout_lengths --dry-run   # CPU check: tiny-qwen2, same code, JSON in a temp dir
    python -m benchmarks.bench_rollout_lengths --shapes llama-3.1-8b --modes triton-keep,triton-compact

bench_rollout's request (random-weight bf16 model, 8 prompts x 8 samples = 64 rows, random 256-token prompts, 1024
new tokens, temperature 1, log-probs returned) with stop tokens on: k token ids drawn at random from the vocabulary
stop a row. Under a near-uniform next-token distribution a row then stops at each step with probability about k / V,
so lengths are about geometric with mean V / k, cut at the budget: k = round(V / MEAN_LENGTH). MEAN_LENGTH = 320 of
1024 is an assumption about math tasks, not a measurement; a geometric law also has more very short rows than a
task's. A random model's distribution is not exactly uniform, so the realized lengths are recorded per mode.

Per mode: one warm-up call, then `repeats` timed calls of the same request (seed 0), wall clock, synchronized.
torch._dynamo is reset when the attention (the mode's first word) changes, so the modes of one attention share the
compiled steps they can ("skip" replays "keep"'s; "compact" adds its dynamic-batch step). Row columns:
  useful_tok_s   valid completion tokens (up to and including the stop token) / median wall seconds
  slot_tok_s     rows x steps / seconds: what the engine ran, finished rows included (bench_rollout's tok/s)
  speedup        useful_tok_s over the same attention's "keep" row
  steps          tokens of the longest row (the decode steps run); mean_len .. at_budget: the realized lengths
  buckets        the batch sizes a "compact" call went through; graphs: dynamo graphs this mode added
  first_s        the warm-up call (compiles this mode adds, CUDA-graph captures); peak_extra_gib: peak above the
                 weights in the timed calls (GPU)
Writes benchmarks/results/rollout_lengths-<card>.json (the dry run: its temp dir) after each mode.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from unittest import mock

import torch

from benchmarks import common
from benchmarks.bench_rollout import build_model
from benchmarks.common import (GIB, RolloutSizes, card_name, listed, print_table, require_cuda,
                               write_results)
from fastgrpo.rollout import compaction
from fastgrpo.rollout.decode import EngineConfig
from fastgrpo.rollout.generate import generate_with_config
from fastgrpo.rollout.sampling import SamplingParams

SHAPES = ("qwen2.5-1.5b", "llama-3.1-8b")
MODES = {
    "sdpa-keep": EngineConfig(attention="sdpa"),
    "sdpa-compact": EngineConfig(attention="sdpa", finished_rows="compact"),
    "triton-keep": EngineConfig(attention="triton"),
    "triton-skip": EngineConfig(attention="triton", finished_rows="skip"),
    "triton-compact": EngineConfig(attention="triton", finished_rows="compact"),
    "shared-keep": EngineConfig(attention="triton", shared_prefix=True),
    "shared-compact": EngineConfig(attention="triton", shared_prefix=True, finished_rows="compact"),
}
DEFAULT_MODES = "sdpa-keep,sdpa-compact,triton-keep,triton-skip,triton-compact"
DEADLINE_S = 480  # modes not started by then are reported as skipped (the device runs a command <= 10 min)
COLUMNS = ["shape", "mode", "useful_tok_s", "speedup", "slot_tok_s", "seconds", "steps", "mean_len", "median_len",
           "p90_len", "at_budget", "buckets", "graphs", "first_s", "peak_extra_gib"]


@dataclasses.dataclass(frozen=True)
class Sizes(RolloutSizes):
    mean_length: int = 320  # the target mean completion length (see the module docstring)
    repeats: int = 2


GPU_SIZES = Sizes()
# 16 rows: one compaction (to 8 rows, compaction.MIN_ROWS) within 96 tokens
DRY_SIZES = Sizes(prompts=4, generations=4, prompt_len=16, new_tokens=96, mean_length=24, repeats=1)


def build(shape: str, sizes: Sizes, device: str) -> dict:
    """bench_rollout's model and tokenizer, random prompts, and k = round(V / mean_length) random stop ids (not 0,
    the pad id)."""
    model, tokenizer = build_model(shape, device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, vocab, (sizes.prompts, sizes.prompt_len), generator=g).tolist()
    k = max(1, round(vocab / sizes.mean_length))
    stop = (torch.randperm(vocab - 1, generator=g)[:k] + 1).tolist()
    weights = torch.cuda.memory_allocated() if device == "cuda" else 0
    return dict(shape=shape, model=model, tokenizer=tokenizer, prompts=prompts, stop=stop, device=device,
                weights=weights)


def call(setup: dict, sizes: Sizes, config: EngineConfig):
    """One generate call of the request: (wall seconds, result)."""
    params = SamplingParams(max_new_tokens=sizes.new_tokens, temperature=1.0)
    _sync(setup["device"])
    start = time.perf_counter()
    result = generate_with_config(setup["model"], setup["tokenizer"], setup["prompts"], sizes.generations, params,
                                  stop=setup["stop"], seed=0, config=config)
    _sync(setup["device"])
    return time.perf_counter() - start, result


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def lengths_of(result) -> dict:
    """The realized completion lengths: summary columns and the list."""
    lengths = sorted(result.completion_mask.sum(1).tolist())
    n = len(lengths)
    return {"steps": lengths[-1], "useful_tokens": sum(lengths), "mean_len": sum(lengths) / n,
            "median_len": lengths[n // 2], "p90_len": lengths[(9 * (n - 1)) // 10],
            "at_budget": result.finish_reasons.count("length") / n, "lengths": lengths}


def measure(setup: dict, sizes: Sizes, mode: str) -> dict:
    """Warm-up and timed calls of one mode -> its row."""
    config = MODES[mode]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    buckets: list[int] = []
    compact = compaction.FinishedRows.compact

    def recorded(self):
        compact(self)
        buckets.append(self.state.done.shape[0])

    with mock.patch.object(compaction.FinishedRows, "compact", recorded), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        first_s, _ = call(setup, sizes, config)
        gc.collect()
        if setup["device"] == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(sizes.repeats):
            buckets.clear()
            seconds, result = call(setup, sizes, config)
            times.append(seconds)
    seconds = statistics.median(times)
    row = {"shape": setup["shape"], "mode": mode, "first_s": first_s, "seconds": seconds, **lengths_of(result)}
    row.update(useful_tok_s=row["useful_tokens"] / seconds,
               slot_tok_s=sizes.rows * row["steps"] / seconds,
               buckets=buckets if config.finished_rows == "compact" else None,
               graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
               fallbacks=[str(x.message)[:200] for x in w if str(x.message).startswith("rollout:")])
    if setup["device"] == "cuda":
        row["peak_extra_gib"] = (torch.cuda.max_memory_allocated() - setup["weights"]) / GIB
    return row


def with_speedups(rows: list[dict]) -> list[dict]:
    """speedup: useful_tok_s over the same shape and attention's "keep" row, where both ran."""
    for row in rows:
        attention = row["mode"].split("-")[0]
        keep = next((r for r in rows if r["shape"] == row["shape"] and r["mode"] == f"{attention}-keep"
                     and "useful_tok_s" in r), None)
        if keep is not None and "useful_tok_s" in row:
            row["speedup"] = row["useful_tok_s"] / keep["useful_tok_s"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU, results in a temp dir")
    parser.add_argument("--shapes", default=SHAPES[0], help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--modes", default=DEFAULT_MODES, help="comma-separated, of " + ", ".join(MODES))
    args = parser.parse_args(argv)
    modes = listed(parser, "--modes", args.modes, MODES)
    device, sizes = ("cpu", DRY_SIZES) if args.dry_run else ("cuda", GPU_SIZES)
    shapes = ["tiny-qwen2"] if args.dry_run else listed(parser, "--shapes", args.shapes, SHAPES)
    if not args.dry_run:
        require_cuda(parser)
    results_dir = Path(tempfile.mkdtemp(prefix="rollout_lengths_")) if args.dry_run else common.RESULTS_DIR
    deadline = time.monotonic() + DEADLINE_S
    rows: list[dict] = []
    config = {"model": "random weights, bf16", "card": card_name(), **dataclasses.asdict(sizes),
              "sampling": "temperature 1, top_k 0, top_p 1, k random stop ids", "deadline_s": DEADLINE_S}
    for shape in shapes:
        began = time.perf_counter()
        setup = build(shape, sizes, device)
        config[f"{shape}_stop_ids"] = len(setup["stop"])
        print(f"{shape} on {device}: built in {time.perf_counter() - began:.0f} s, {len(setup['stop'])} stop ids of "
              f"{setup['model'].config.vocab_size}", flush=True)
        attention = None
        for mode in modes:
            if mode.split("-")[0] != attention:
                attention = mode.split("-")[0]
                torch._dynamo.reset()
            if time.monotonic() > deadline:
                rows.append({"shape": shape, "mode": mode, "error": "skipped: deadline reached"})
                continue
            began = time.perf_counter()
            try:
                rows.append(measure(setup, sizes, mode))
            except Exception as err:  # noqa: BLE001 - a failed mode is reported; the others still run
                traceback.print_exc()
                rows.append({"shape": shape, "mode": mode, "error": repr(err)[:300]})
            print(f"{shape} / {mode}: {time.perf_counter() - began:.0f} s", flush=True)
            path = write_results("rollout_lengths", with_speedups(rows), config, results_dir)
        del setup
        torch._dynamo.reset()  # the compiled steps hold the model
        gc.collect()
    print(f"\nwrote {path}")
    for row in rows:
        if row.get("error") or row.get("fallbacks"):
            print(f"{row['shape']} {row['mode']}: {row.get('error') or row['fallbacks']}")
    print_table(rows, COLUMNS)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
