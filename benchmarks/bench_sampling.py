"""The decode step's sampling: today's compiled torch `sample` on keyed_exponential's noise against the Triton
kernels (fastgrpo.kernels.sampling), per call, at the vocabularies of Qwen2.5-1.5B and Llama-3.1-8B and 32, 64 and
128 rows, noisy and greedy.

    python -m benchmarks.bench_sampling                  # GPU: both vocabularies, 32 / 64 / 128 rows
    python -m benchmarks.bench_sampling --sweep          # + the kernels over SWEEP's splits at 64 rows
    TRITON_INTERPRET=1 python -m benchmarks.bench_sampling --dry-run --sweep   # CPU: a tiny vocabulary, same code

Why: at 64 x 151936 the compiled torch sampler took 123 us a decode step on an H200 (~4.7% of Qwen2.5-1.5B's
step): Inductor runs log_softmax + argmax as one program per row, and the noise's hash in int64 with split
multiplies. Paths, per vocabulary, rows and mode:
  today   sample(logits.float(), keyed_exponential(keys, position, vocab_keys)) (greedy: no noise), torch.compile'd
          with static shapes, as the engine compiled it
  kernel  what rollout.sampling.keyed_sample runs on CUDA, torch.compile'd as the engine runs it now: step_words in
          one small Inductor kernel, then the fastgrpo::keyed_sample op (three Triton kernels), blocks_per_chunk_for's
          split
  sweep   the three kernels alone (words precomputed) at SWEEP's block x blocks_per_chunk x num_warps
Columns: config (block/blocks_per_chunk/num_warps), us per call (common.kernel_us: CUDA graphs of 20 calls over
copies of the logits that pass 3x the L2, as a decode step reads fresh logits), gb_s (the logits' bytes over that
time; the kernels read them twice), vs_today (today's us over this row's), tokens_equal (rows whose token equals
today's), max_logp_diff (max |logp - today's|; both within tests/test_sampling_kernel.py's bound). Logits: bf16,
3 x normal (the engine passes the model's bf16 logits where no filter applies). Writes
benchmarks/results/sampling-<card>.json after each case (dry run: a temp dir); prints the sweep's fastest splits,
then the table.
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

from benchmarks.common import (check_interpreted, copies_past_l2, kernel_us, listed, positive_ints,
                               print_sweep_report, require_cuda, run_cases)
from fastgrpo.rollout.sampling import keyed_exponential, mix32, row_keys, sample, step_words

VOCABS = {"qwen2.5-1.5b": 151936, "llama-3.1-8b": 128256}
DRY_VOCAB = 67
ROWS, DRY_ROWS = "32,64,128", "3"
SWEEP = dict(block=(1024, 2048, 4096), blocks_per_chunk=(1, 2, 4, 8), num_warps=(4, 8))
SWEEP_ROWS = 64
DRY_SWEEP = [(16, 1, 4), (32, 2, 4)]
POSITION = 700
COLUMNS = ["vocab", "rows", "mode", "path", "config", "us", "gb_s", "vs_today", "tokens_equal", "max_logp_diff"]
BEST_SHOWN = 5  # per vocabulary and mode, in the printed sweep table (the JSON has every config)


def compiled_paths(vocab_keys: torch.Tensor, greedy: bool) -> tuple:
    """(today, kernel): logits -> (tokens, logps), each compiled with static shapes as the engine compiles its step."""
    def today(logits, keys, position):
        return sample(logits.float(), None if greedy else keyed_exponential(keys, position, vocab_keys))

    def kernel(logits, keys, position):  # rollout.sampling.keyed_sample on CUDA; the kernels under the interpreter
        return torch.ops.fastgrpo.keyed_sample(logits, *((None, None) if greedy else step_words(keys, position)))

    if vocab_keys.is_cuda:
        return torch.compile(today, dynamic=False), torch.compile(kernel, dynamic=False)
    return today, kernel


def case_rows(vocab: str, V: int, N: int, greedy: bool, device: str, sweep: bool) -> tuple[list, list]:
    """(rows, sweep rows) of one vocabulary, row count and mode."""
    from fastgrpo.kernels.sampling import blocks_per_chunk_for, keyed_sample as kernels

    g = torch.Generator(device=device).manual_seed(0)
    copies = copies_past_l2(N * V * 2, device)
    logits = [(torch.randn(N, V, device=device, generator=g) * 3).bfloat16() for _ in range(copies)]
    keys, position = row_keys(0, list(range(N)), 1).to(device), torch.tensor([POSITION], device=device)
    torch._dynamo.reset()  # a fresh compile per case (static shapes)
    today, kernel = compiled_paths(mix32(torch.arange(V, device=device)), greedy)
    want_tokens, want_logps = today(logits[0], keys, position)
    mode = "greedy" if greedy else "noisy"

    def row(path, calls, config=None):
        us = kernel_us(calls, device)
        tokens, logps = calls[0]()
        return {"vocab": vocab, "V": V, "rows": N, "mode": mode, "path": path, "config": config, "us": us,
                "gb_s": N * V * 2 / (us * 1e-6) / 1e9, "tokens_equal": f"{int((tokens == want_tokens).sum())}/{N}",
                "max_logp_diff": (logps - want_logps).abs().max().item()}

    if device == "cuda":
        default = (2048, blocks_per_chunk_for(N, V, 2048, torch.cuda.get_device_properties(0).multi_processor_count), 4)
    else:
        default = None
    rows = [row("today", [functools.partial(today, x, keys, position) for x in logits]),
            row("kernel", [functools.partial(kernel, x, keys, position) for x in logits],
                None if default is None else "/".join(map(str, default)))]
    words = (None, None) if greedy else step_words(keys, position)
    swept = []
    configs = (itertools.product(*SWEEP.values()) if device == "cuda" else DRY_SWEEP) if sweep else []
    for block, per_chunk, warps in configs:
        split = dict(block=block, blocks_per_chunk=per_chunk, num_warps=warps)
        swept.append(row("sweep", [functools.partial(kernels, x, *words, **split) for x in logits],
                         f"{block}/{per_chunk}/{warps}"))
    for r in rows + swept:
        r["vs_today"] = rows[0]["us"] / r["us"]
    return rows, swept


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="a tiny vocabulary on the CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--vocabs", default=",".join(VOCABS), help="comma-separated, of " + ", ".join(VOCABS))
    parser.add_argument("--rows", help=f"comma-separated row counts (default {ROWS}; dry run {DRY_ROWS})")
    parser.add_argument("--sweep", action="store_true", help=f"also time the kernels over SWEEP's splits at "
                                                             f"{SWEEP_ROWS} rows (dry run: its row counts)")
    args = parser.parse_args(argv)
    vocabs = listed(parser, "--vocabs", args.vocabs, VOCABS)
    row_counts = positive_ints(parser, "--rows", args.rows or (DRY_ROWS if args.dry_run else ROWS))
    check_interpreted(parser, args.dry_run)
    if not args.dry_run:
        require_cuda(parser)
    device = "cpu" if args.dry_run else "cuda"
    cases = [("tiny", DRY_VOCAB)] if args.dry_run else [(name, VOCABS[name]) for name in vocabs]
    config = {"sweep": SWEEP, "dtype": "bfloat16", "position": POSITION,
              "timing": "common.kernel_us (CUDA graph of 20 calls, logits past L2)"}
    rows, swept = run_cases(
        "sampling", itertools.product(cases, row_counts, (False, True)),
        lambda case, N, greedy: case_rows(*case, N, greedy, device, args.sweep and (args.dry_run or N == SWEEP_ROWS)),
        config, args.dry_run)
    print_sweep_report(rows, swept, args.sweep, ("vocab", "mode"), BEST_SHOWN, COLUMNS, COLUMNS)


if __name__ == "__main__":
    main()
